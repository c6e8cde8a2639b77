"""Loading peft_slim adapters is never silently wrong:

* an adapter loaded for inference (``is_trainable=False``) and then made trainable (PEFT's ``set_adapter``) refuses a
  training forward by name, instead of training without its method; loaded trainable, it trains with it;
* a refused ``peft_slim.from_pretrained`` / ``peft_slim.load_adapter`` / ``get_peft_model`` leaves the model exactly
  as it was (modules, hooks, attention implementation, optimizer hooks, requires_grad, state dict), and a retry works;
* ``adapter_config.json`` and ``peft_slim_config.json`` that disagree on the LoRA adapter are refused, naming both
  files and the fields; a broken ``peft_slim_config.json`` is named with what is wrong.
"""

from __future__ import annotations

import copy
import functools
import gc
import json
import re
import shutil

import pytest
import torch
from helpers.adapter_cases import method_config
from helpers.slimfit_cases import step_hook_counts
from helpers.tiny_models import build, make_batch
from peft import get_peft_model
from safetensors import SafetensorError

import peft_slim

REFUSED = (ValueError, OSError, SafetensorError)  # what the refused loads below raise


def _config(name: str):
    """``method_config(name)``, TokenTune selecting a quarter of the tokens."""
    config = method_config(name)
    if name == "tokentune_lora":
        config.token_ratio = 0.25
    return config


def _wide_llama():
    """The tiny Llama with hidden size 48 instead of 32: another base model, of other shapes."""
    config = copy.deepcopy(build("llama").config)
    config.hidden_size = 48
    torch.manual_seed(0)
    return type(build("llama"))._from_config(config, attn_implementation="sdpa")


def _train_step(model, seed: int = 0):
    """One training step; returns (loss, token mask or None, names of the parameters that got a gradient)."""
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.SGD(trainable, lr=1e-2)
    if hasattr(model.base_model, "slimfit_attach"):
        model.base_model.slimfit_attach(optimizer)
    loss = model(**make_batch("llama", seed=seed)).loss
    loss.backward()
    graded = sorted(n for n, p in model.named_parameters() if p.grad is not None)
    optimizer.step()
    optimizer.zero_grad()
    tuner = model.base_model
    if hasattr(tuner, "slimfit_step"):
        tuner.slimfit_step()
    mask = tuner.last_token_mask
    return loss.detach(), None if mask is None else mask.clone(), graded


def _plain_loss(model) -> torch.Tensor:
    """A training forward's loss on a plain transformers model."""
    model.train()
    return model(**make_batch("llama", seed=3)).loss.detach()


def _snapshot(model) -> dict:
    """Everything a load may change on ``model``."""
    gc.collect()  # SlimFit's optimizer hooks of models discarded earlier go when these are collected
    return {
        "modules": [(name, type(module).__name__) for name, module in model.named_modules()],
        "hooks": [
            (name, len(m._forward_hooks), len(m._forward_pre_hooks), len(m._backward_hooks))
            for name, m in model.named_modules()
        ],
        "attn_implementation": model.config._attn_implementation,
        "requires_grad": {name: p.requires_grad for name, p in model.named_parameters()},
        "state_dict": {key: value.clone() for key, value in model.state_dict().items()},
        "peft_config": "peft_config" in model.__dict__,
        "optimizer_hooks": step_hook_counts(),
    }


def _assert_same(before: dict, after: dict) -> None:
    for key in before:
        if key == "state_dict":
            assert before[key].keys() == after[key].keys()
            assert all(torch.equal(before[key][k], after[key][k]) for k in before[key])
        else:
            assert before[key] == after[key], key


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """For each method: a trained adapter saved from the tiny Llama ('good') and one saved from a wider Llama."""
    root = tmp_path_factory.mktemp("loading")
    for name in ("tokentune_lora", "slimfit_lora", "full_stack"):
        for folder, base in (("good", build("llama")), ("wide", _wide_llama())):
            model = get_peft_model(base, _config(name))
            if folder == "good":
                _train_step(model)
            model.save_pretrained(root / name / folder)
    return root


def _broken(saved, name: str, refusal: str, tmp_path):
    """The adapter folder of ``name`` with ``refusal``: another base model's, its weights file cut short or gone."""
    if refusal == "wrong_base":
        return saved / name / "wide"
    folder = tmp_path / f"{name}-{refusal}"
    shutil.copytree(saved / name / "good", folder)
    weights = folder / "adapter_model.safetensors"
    if refusal == "truncated":
        data = weights.read_bytes()
        weights.write_bytes(data[: len(data) // 2])
    else:
        weights.unlink()
    return folder


# ---------------------------------------------------------------------------------------------- loaded for inference


@pytest.mark.parametrize("name", ["tokentune_lora", "slimfit_lora"])
def test_an_adapter_loaded_for_inference_refuses_training_and_trains_with_its_method_loaded_trainable(saved, name):
    folder = saved / name / "good"
    model = peft_slim.from_pretrained(build("llama"), folder, is_trainable=True)
    peft_slim.load_adapter(model, folder, "second")  # is_trainable=False
    model.set_adapter("second")  # PEFT's: makes the adapter's LoRA trainable however it was loaded
    assert any(p.requires_grad for n, p in model.named_parameters() if ".second." in n)
    model.train()
    with pytest.raises(ValueError, match=r"^To train adapter 'second', load it with is_trainable=True"):
        model(**make_batch("llama"))
    with torch.no_grad():  # inference stays as it is, also in train mode
        inference = model(**make_batch("llama")).logits
    alone = peft_slim.from_pretrained(build("llama"), folder)
    with torch.no_grad():
        assert torch.equal(inference, alone(**make_batch("llama")).logits)
    with pytest.raises(ValueError, match="loaded for inference"):  # the same for from_pretrained's own adapter
        alone.set_adapter("default")
        alone.train()(**make_batch("llama"))

    peft_slim.load_adapter(model, folder, "third", is_trainable=True)
    model.set_adapter("third")
    _, mask, graded = _train_step(model)
    lora = [n for n, p in model.named_parameters() if ".third." in n and "lora_" in n]
    if name == "tokentune_lora":  # token_ratio=0.25: a quarter of the tokens
        assert mask is not None and mask.sum() < mask.numel() / 2
        assert set(graded) == set(lora)
    else:  # freeze_ratio=0.5: 6 of the 12 LoRA tensors train at the first step
        assert len(lora) == 12 and len(graded) == 6


# ---------------------------------------------------------------------------------------------- refused loads


@pytest.mark.parametrize("refusal", ["wrong_base", "truncated", "missing"])
@pytest.mark.parametrize("name", ["tokentune_lora", "full_stack"])
def test_a_refused_from_pretrained_leaves_the_base_model_as_it_was(saved, name, refusal, tmp_path):
    base = build("llama")
    before, loss = _snapshot(base), _plain_loss(build("llama"))
    with pytest.raises(REFUSED):
        peft_slim.from_pretrained(base, _broken(saved, name, refusal, tmp_path), is_trainable=True)
    _assert_same(before, _snapshot(base))
    assert torch.equal(_plain_loss(base), loss)  # a plain model's training forward, no hook left
    # A retry with the good folder loads and trains as on a base model that never saw the refused load.
    retried = peft_slim.from_pretrained(base, saved / name / "good", is_trainable=True)
    fresh = peft_slim.from_pretrained(build("llama"), saved / name / "good", is_trainable=True)
    ours, theirs = _train_step(retried, seed=1), _train_step(fresh, seed=1)
    assert torch.equal(ours[0], theirs[0]) and ours[2] == theirs[2]
    assert (ours[1] is None and theirs[1] is None) or torch.equal(ours[1], theirs[1])


@pytest.mark.parametrize("refusal", ["wrong_base", "truncated", "missing"])
@pytest.mark.parametrize("name", ["tokentune_lora", "full_stack"])
def test_a_refused_load_adapter_leaves_the_model_as_it_was(saved, name, refusal, tmp_path):
    good = saved / name / "good"
    model = peft_slim.from_pretrained(build("llama"), good, is_trainable=True)
    never = peft_slim.from_pretrained(build("llama"), good, is_trainable=True)
    before = _snapshot(model)
    with pytest.raises(REFUSED):
        peft_slim.load_adapter(model, _broken(saved, name, refusal, tmp_path), "second", is_trainable=True)
    _assert_same(before, _snapshot(model))
    assert list(model.peft_config) == ["default"] and model.active_adapters == ["default"]
    ours, theirs = _train_step(model, seed=1), _train_step(never, seed=1)
    assert torch.equal(ours[0], theirs[0]) and ours[2] == theirs[2] and torch.equal(ours[1], theirs[1])
    peft_slim.load_adapter(model, good, "second", is_trainable=True)  # a retry works
    assert list(model.peft_config) == ["default", "second"]


@pytest.mark.parametrize("how", ["add_adapter", "get_peft_model"])
def test_a_refused_wrap_leaves_the_model_as_it_was(how):
    if how == "add_adapter":
        model = get_peft_model(build("llama"), _config("full_stack"))
        wrap = functools.partial(model.add_adapter, "second")
    else:
        model = build("llama")
        wrap = functools.partial(get_peft_model, model)
    before = _snapshot(model)
    config = _config("full_stack")
    config.units = ["no_such_parameter"]  # refused by SlimFit's set-up, after LoRA is injected
    with pytest.raises(ValueError, match=r"units: regex\(es\) \['no_such_parameter'\] matched no"):
        wrap(config)
    _assert_same(before, _snapshot(model))
    if how == "add_adapter":
        assert list(model.peft_config) == ["default"] and model.active_adapters == ["default"]
    wrap(_config("full_stack"))  # a retry works


# ---------------------------------------------------------------------------------------------- the two config files


def _edit(path, change) -> None:
    values = json.loads(path.read_text())
    change(values)
    path.write_text(json.dumps(values))


def test_the_lora_settings_are_written_once_in_adapter_config_json(saved, tmp_path):
    folder = tmp_path / "edited"
    shutil.copytree(saved / "tokentune_lora" / "good", folder)
    assert "lora" not in json.loads((folder / "peft_slim_config.json").read_text())
    _edit(folder / "adapter_config.json", lambda values: values.update(lora_alpha=16))
    assert peft_slim.load_config(folder).lora.lora_alpha == 16  # what vanilla PEFT loads too: one adapter


def test_a_broken_peft_slim_config_is_named_with_what_is_wrong(saved, tmp_path):
    folder = tmp_path / "broken"
    shutil.copytree(saved / "full_stack" / "good", folder)
    record = folder / "peft_slim_config.json"
    text = record.read_text()
    record.write_text(text[: len(text) // 2])
    with pytest.raises(ValueError, match=re.escape(f"{record} is not valid JSON") + ".*cut short"):
        peft_slim.from_pretrained(build("llama"), folder)
    record.write_text(text.replace('"freeze_ratio": 0.5', '"freeze_ratio": 2'))
    with pytest.raises(ValueError, match=re.escape(f"{record}: SlimFitConfig.freeze_ratio")):
        peft_slim.load_config(folder)
