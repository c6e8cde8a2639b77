"""Full fine-tuning through the transforms (``peft_slim.tokentune_`` / ``slimfit_``): bit-identical gradients and
AdamW steps to the standalone PEFT types they replace (recorded in tests/helpers/data/full_finetuning.json by
tools/record_full_finetuning.py), a plain checkpoint, ``remove()``, and the refusals."""

from __future__ import annotations

import pytest
import torch
from helpers.adapter_cases import without_peft_slim
from helpers.full_finetuning_cases import CASES, recorded, run_case
from helpers.tiny_models import build, make_batch, trainer_kwargs
from peft import LoraConfig, get_peft_model

import peft_slim
from peft_slim import SlimFitConfig, TokenTuneConfig

RECORDED = recorded()


def transform(model, method, fields):
    if method == "tokentune":
        return model, peft_slim.tokentune_(model, TokenTuneConfig(**fields))
    return model, peft_slim.slimfit_(model, SlimFitConfig(**fields))


@pytest.mark.parametrize("case", sorted(CASES))
def test_bit_identical_to_the_standalone_types(case, one_thread):
    model_and_handle = {}

    def wrap(model, method, fields):
        trained, handle = transform(model, method, fields)
        model_and_handle["handle"] = handle
        return trained, (handle if method == "slimfit" else None)

    got = run_case(case, wrap)
    want = RECORDED["cases"][case]
    for step, (got_step, want_step) in enumerate(zip(got["grads"], want["grads"])):
        assert got_step.keys() == want_step.keys(), f"step {step}: other parameters got gradients"
        differ = [name for name in want_step if got_step[name][0] != want_step[name][0]]
        assert not differ, f"step {step}: gradients differ for {differ[:5]}"
    differ = [name for name in want["params"] if got["params"][name][0] != want["params"][name][0]]
    assert not differ, f"parameters after {len(want['grads'])} steps differ: {differ[:5]}"


def test_remove_restores_a_plain_model():
    model = build("llama")
    model.lm_head.weight.requires_grad_(False)
    handle = peft_slim.slimfit_(model, SlimFitConfig(token_selection={"token_ratio": 0.5}))
    assert peft_slim.tokentune.find_token_selector(model) is handle.token_selector is not None
    handle.remove()
    assert not model._forward_pre_hooks and not model._forward_hooks
    assert not model.lm_head.weight.requires_grad and model.model.embed_tokens.weight.requires_grad
    assert peft_slim.tokentune.find_token_selector(model) is None
    peft_slim.tokentune_(model, TokenTuneConfig(token_ratio=0.5)).remove()  # a second transform after remove()


@pytest.mark.parametrize(
    ("arch", "method", "fields"), [("gpt2", "tokentune", {"token_ratio": 0.5}), ("bert", "slimfit", {})]
)
def test_saves_a_plain_checkpoint(arch, method, fields, tmp_path):
    model, handle = transform(build(arch), method, fields)
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    if method == "slimfit":
        handle.slimfit_attach(optimizer)
    model(**make_batch(arch)).loss.backward()
    optimizer.step()
    model.save_pretrained(tmp_path)
    names = {p.name for p in tmp_path.iterdir()}
    assert (
        {"config.json", "model.safetensors"} <= names <= {"config.json", "model.safetensors", "generation_config.json"}
    )
    assert "peft_slim" not in (tmp_path / "config.json").read_text()
    # transformers alone, in a fresh process that never imports peft_slim, loads it
    report = without_peft_slim(
        "import sys, torch, transformers\n"
        f"model = transformers.{type(model).__name__}.from_pretrained({str(tmp_path)!r})\n"
        f"torch.save(model.state_dict(), {str(tmp_path / 'loaded.pt')!r})\n"
        "print('RESULT=' + str(any(m.startswith('peft_slim') for m in sys.modules)).lower())"
    )
    assert report is False
    loaded, untrained = torch.load(tmp_path / "loaded.pt"), build(arch).state_dict()
    assert any(not torch.equal(value, untrained[name]) for name, value in loaded.items())  # training changed it
    for name, value in loaded.items():
        assert torch.equal(value, model.state_dict()[name]), name
    handle.remove()


def test_trainer_with_slimfit_callback(tmp_path):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    model = build("llama")
    handle = peft_slim.slimfit_(model, SlimFitConfig(activation_compression=None))
    rows = [{k: v[0] for k, v in make_batch("llama", batch=1, seed=i).items()} for i in range(8)]
    args = TrainingArguments(**trainer_kwargs(tmp_path, max_steps=3))
    trainer = Trainer(
        model=model, args=args, train_dataset=Dataset.from_list(rows), callbacks=[peft_slim.SlimFitCallback()]
    )
    trainer.train()
    assert len(handle.slimfit_history()["trained"]) == 3
    assert all(p.requires_grad for p in model.parameters())  # every unit trainable again after train()


def test_refusals():
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    with pytest.raises(ValueError, match="get_peft_model"):
        peft_slim.tokentune_(build("llama"), TokenTuneConfig(lora=lora))
    with pytest.raises(TypeError, match="SlimFitConfig"):
        peft_slim.slimfit_(build("llama"), TokenTuneConfig())
    model = build("llama")
    handle = peft_slim.slimfit_(model, SlimFitConfig())
    with pytest.raises(ValueError, match="remove"):
        peft_slim.tokentune_(model, TokenTuneConfig())
    handle.remove()
    with pytest.raises(ValueError, match="adapters"):
        peft_slim.slimfit_(get_peft_model(build("llama"), lora), SlimFitConfig())


def test_a_recipe_without_lora_applies_the_transform_and_with_lora_wraps():
    from peft import PeftModel

    from peft_slim.recipe import Recipe

    model = build("llama")
    trained, handle = Recipe("tokentune", lora_r=0, token_ratio=0.5).apply(model, seed=0)
    assert trained is model and isinstance(handle, peft_slim.TokenTuneTransform)
    assert all(p.requires_grad for p in model.parameters())
    trained, handle = Recipe("slimfit", lora_r=4).apply(build("llama"), seed=0)
    assert isinstance(trained, PeftModel) and handle is None
    trained, handle = Recipe("full").apply(build("llama"))
    assert handle is None and all(p.requires_grad for p in trained.parameters())
