"""SlimFit's gradients against their definition, its composition with LoRA, TokenTune and compression, and
Trainer (callback, checkpoint resume)."""

from __future__ import annotations

import pytest
import torch
from helpers.slimfit_cases import PAPER, TASK, FullFineTuned, loss_of, slimfit_model, train
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from helpers.tokentune_cases import assert_grads_match, reference_loss_and_grads
from helpers.trainer_cases import slimfit_trainer
from peft import LoraConfig, get_peft_model

from peft_slim import ActivationCompressionConfig, SlimFitCallback, TokenTuneConfig
from peft_slim.memory import SavedActivationBytes

PREFIX = "base_model.model."


def _plain_name(name: str) -> str:
    return name.removeprefix(PREFIX).replace(".modules_to_save.default", "")


def _ordinary_grads(arch: str, lora: bool, slimfit) -> dict[str, torch.Tensor]:
    """Gradients of the same weights in an ordinary model (plain transformers, or vanilla PEFT LoRA)."""
    weights = {_plain_name(n): p.detach() for n, p in slimfit.named_parameters() if ".original_module." not in n}
    if lora:
        config = LoraConfig(r=4, lora_alpha=8, target_modules=set(LORA_TARGETS[arch]), task_type=TASK[arch])
        model = get_peft_model(build(arch), config)
    else:
        model = build(arch)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".original_module." not in name:
                param.copy_(weights[_plain_name(name)])
    model.train()
    torch.manual_seed(0)
    loss_of(model, make_batch(arch)).backward()
    return {_plain_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2", "llama"])
def test_trained_units_get_the_ordinary_gradient_and_frozen_units_none(arch, lora):
    model = slimfit_model(arch, lora=lora, freeze_ratio=0.6)
    tuner = model.base_model
    model.train()
    torch.manual_seed(0)
    loss_of(model, make_batch(arch)).backward()
    actual = {_plain_name(n): p.grad for n, p in model.named_parameters() if p.grad is not None}
    expected = _ordinary_grads(arch, lora, model)
    trained = [unit for unit, t in zip(tuner._state.units, tuner.scheduler.trained) if t]
    frozen = [unit for unit, t in zip(tuner._state.units, tuner.scheduler.trained) if not t]
    assert trained and frozen
    assert all(p.grad is None for unit in frozen for p in unit.params)
    assert all(p.grad is not None for unit in trained for p in unit.params)
    assert_grads_match(actual, {name: expected[name] for name in actual}, rtol=1e-5)


@pytest.mark.parametrize("lora", [False, True])
def test_freezing_removes_the_cached_inputs_of_frozen_layers(lora):
    """Measured saved-activation bytes fall as more units freeze (a frozen linear, or a frozen LoRA pair, caches
    no input)."""
    saved = {}
    for ratio in (0.0, 0.9):
        units = None if lora else [r".*layers\.(\d+)\.mlp\..*"]
        model = slimfit_model("llama", lora=lora, freeze_ratio=ratio, units=units)
        model.train()
        with SavedActivationBytes() as counter:
            loss = loss_of(model, make_batch("llama", batch=4, length=32))
        loss.backward()
        saved[ratio] = counter.bytes
    assert saved[0.9] < 0.9 * saved[0.0], saved


@pytest.mark.parametrize("lora", [False, True])
def test_composition_with_tokentune_matches_the_tokentune_definition(lora):
    """SlimFit + TokenTune (+ LoRA): trained units get the TokenTune gradient (tests/helpers/reference.py), frozen
    none."""
    tokentune = TokenTuneConfig(token_ratio=0.5, seed=1)
    model = slimfit_model("llama", lora=lora, freeze_ratio=0.5, token_selection=tokentune)
    tuner = model.base_model
    batch = make_batch("llama")
    model.train()
    loss = loss_of(model, batch)
    loss.backward()
    mask = tuner.last_token_mask
    assert mask is not None and 0 < int(mask.sum()) < int(batch["attention_mask"].sum())
    actual = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    frozen = [unit for unit, t in zip(tuner._state.units, tuner.scheduler.trained) if not t]
    assert frozen and all(p.grad is None for unit in frozen for p in unit.params)
    expected_loss, expected = reference_loss_and_grads(model, "llama", batch, mask)
    assert torch.allclose(loss.detach(), expected_loss, rtol=1e-5)
    assert_grads_match(actual, {name: expected[name] for name in actual})


def test_default_compression_is_on_and_close_to_exact():
    """The default recipe compresses the training forward; gradients stay close to the exact ones."""
    grads = {}
    for name, compression in (("exact", None), ("default", "default")):
        fields = {} if compression == "default" else {"activation_compression": None}
        model = slimfit_model("bert", freeze_ratio=0.5, **fields) if fields else _default_compression_model()
        model.train()
        loss_of(model, make_batch("bert", batch=4, length=64)).backward()
        grads[name] = torch.cat([p.grad.flatten() for p in model.parameters() if p.grad is not None])
        stats = model.base_model.last_compression_stats
        if name == "default":
            assert stats is not None and stats.compressed > 0 and stats.ratio < 0.5, stats
    cosine = torch.nn.functional.cosine_similarity(grads["exact"], grads["default"], dim=0)
    assert cosine > 0.99, cosine


def _default_compression_model():
    from peft_slim import SlimFitConfig, slimfit_

    base = build("bert")
    return FullFineTuned(base, slimfit_(base, SlimFitConfig(freeze_ratio=0.5, seed=0, **PAPER)))


def test_compression_config_is_applied_with_lora():
    compression = ActivationCompressionConfig(bits=4, min_numel=0)
    model = slimfit_model("llama", lora=True, freeze_ratio=0.5, activation_compression=compression)
    train(model, "llama", steps=2)
    assert model.base_model.last_compression_stats.compressed > 0


# ---------------------------------------------------------------------------------------------- Trainer


def test_trainer_callback_steps_and_resume_restores_the_schedule(tmp_path):
    """Trainer + SlimFitCallback: one schedule step per optimizer step; a resumed run repeats the same schedule."""
    straight = slimfit_model("llama", freeze_ratio=0.8, seed=5)
    slimfit_trainer(tmp_path / "straight", straight, steps=6).train()
    history = straight.base_model.slimfit_history()["trained"]
    assert len(history) == 6
    assert all(sum(row) == straight.base_model.scheduler.num_trained for row in history)

    first = slimfit_model("llama", freeze_ratio=0.8, seed=5)
    slimfit_trainer(tmp_path / "resumed", first, steps=6, save_strategy="steps", save_steps=3).train()
    resumed = slimfit_model(
        "llama", freeze_ratio=0.8, seed=77, base_seed=5
    )  # another seed: the checkpoint must override it
    slimfit_trainer(tmp_path / "resumed", resumed, steps=6).train(
        resume_from_checkpoint=str(tmp_path / "resumed/checkpoint-3")
    )
    assert resumed.base_model.slimfit_history()["trained"] == history
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.allclose(a, b, atol=1e-6), name


def test_trainer_without_task_type_and_frozen_units_unchanged(tmp_path):
    model = slimfit_model("llama", freeze_ratio=0.9, task_type=None)
    units = model.base_model._state.units
    snapshots = []

    class Watch(SlimFitCallback.__mro__[1]):  # a plain TrainerCallback
        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            snapshots.append([[p.detach().clone() for p in u.params] for u in units])

        def on_optimizer_step(self, args, state, control, **kwargs):
            trained = model.base_model.scheduler.trained
            for unit, t, old in zip(units, trained, snapshots[-1]):
                same = all(torch.equal(o, p) for o, p in zip(old, unit.params))
                assert same != t, unit.name

    trainer = slimfit_trainer(tmp_path, model, steps=3)
    trainer.add_callback(Watch())
    trainer.train()
    assert len(snapshots) == 3
