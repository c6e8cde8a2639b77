"""Weights the checkpoint did not provide (transformers initialised them in from_pretrained) train at every step
and are never scheduled; a model built from a config, `train_new_weights=False` and files saved before the field
keep the rule of every weight scheduled."""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.distributed as dist
from helpers.slimfit_cases import FullFineTuned, loss_of
from helpers.tiny_models import make_batch
from peft import get_peft_model
from transformers import BertConfig, BertForSequenceClassification, BertModel
from transformers.utils import logging as hf_logging

from peft_slim import SlimFitConfig, slimfit_
from peft_slim.planner.setup import base_model, resolve_workload

CONFIG = dict(hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64, vocab_size=97)
CONFIG.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, num_labels=3, pad_token_id=0)
NEW = ("bert.pooler.dense.weight", "classifier.weight")  # what the headless checkpoint lacks (biases always train)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A BertModel saved without a pooler: loaded as BertForSequenceClassification, transformers initialises
    the pooler and the classifier."""
    path = str(tmp_path_factory.mktemp("headless"))
    torch.manual_seed(0)
    BertModel(BertConfig(**CONFIG), add_pooling_layer=False).save_pretrained(path)
    return path


def load(path: str, **kwargs) -> BertForSequenceClassification:
    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()  # transformers' own report of the missing keys
    try:
        return BertForSequenceClassification.from_pretrained(path, **kwargs)
    finally:
        hf_logging.set_verbosity(verbosity)


def wrap(model, note: str = "were not in the checkpoint", **fields):
    """``model`` with SlimFit's full fine-tuning, and the warnings that say ``note``."""
    fields.setdefault("activation_compression", None)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        transformed = FullFineTuned(model, slimfit_(model, SlimFitConfig(freeze_ratio=0.9, **fields)))
    return transformed, [str(w.message) for w in caught if note in str(w.message)]


def test_the_new_weights_are_transformers_missing_keys(checkpoint):
    """The definition: the parameters from_pretrained reports as missing (output_loading_info) are no unit."""
    _, info = BertForSequenceClassification.from_pretrained(checkpoint, output_loading_info=True)
    assert {n for n in info["missing_keys"] if n.endswith(".weight")} == set(NEW)
    model, _ = wrap(load(checkpoint))
    units = model.base_model.unit_names
    assert not set(NEW) & set(units)
    assert len(units) == len([n for n, _ in model.named_parameters() if "LayerNorm" not in n and "bias" not in n]) - 2


def test_new_weights_train_at_every_step_and_the_others_follow_the_schedule(checkpoint):
    model, _ = wrap(load(checkpoint))
    tuner = model.base_model
    new = {name: tuner.model.get_parameter(name) for name in NEW}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    model.train()
    for step in range(8):
        before = {name: p.detach().clone() for name, p in new.items()}
        loss_of(model, make_batch("bert", seed=step)).backward()
        trained = tuner.scheduler.trained
        assert 0 < sum(trained) < len(trained), "the schedule freezes some units and trains some"
        for unit, train in zip(tuner._state.units, trained):
            for param in unit.params:
                assert param.requires_grad == train and (param.grad is not None) == train, (step, unit.name)
        for name, param in new.items():
            assert param.requires_grad and param.grad is not None, (step, name)
        optimizer.step()
        optimizer.zero_grad()
        model.slimfit_step()
        for name, param in new.items():
            assert not torch.equal(param.detach(), before[name]), f"{name} did not change at step {step}"


def test_one_warning_names_the_new_weights(checkpoint):
    _, notes = wrap(load(checkpoint))
    assert len(notes) == 1 and "bert.pooler.dense, classifier;" in notes[0] and "train_new_weights=False" in notes[0]


def test_a_model_built_from_a_config_keeps_every_weight_scheduled():
    model, notes = wrap(BertForSequenceClassification._from_config(BertConfig(**CONFIG)))
    assert not notes and set(NEW) <= set(model.base_model.unit_names)


def test_a_fully_loaded_model_has_no_new_weights(checkpoint, tmp_path):
    load(checkpoint).save_pretrained(str(tmp_path))
    model, notes = wrap(load(str(tmp_path)))
    assert not notes and set(NEW) <= set(model.base_model.unit_names)


def test_a_head_of_another_shape_is_new(checkpoint, tmp_path):
    load(checkpoint).save_pretrained(str(tmp_path))
    model, notes = wrap(load(str(tmp_path), num_labels=5, ignore_mismatched_sizes=True))
    assert len(notes) == 1 and ": classifier;" in notes[0]
    assert "classifier.weight" not in model.base_model.unit_names
    assert "bert.pooler.dense.weight" in model.base_model.unit_names  # loaded this time


def test_the_field_off_schedules_them_like_the_others(checkpoint):
    model, notes = wrap(load(checkpoint), train_new_weights=False)
    assert not notes and set(NEW) <= set(model.base_model.unit_names)


def test_with_lora_the_base_model_stays_frozen(checkpoint):
    from peft import LoraConfig

    lora = LoraConfig(r=2, target_modules=["query", "value"])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = get_peft_model(
            load(checkpoint), SlimFitConfig(freeze_ratio=0.9, activation_compression=None, lora=lora)
        )
    assert not [w for w in caught if "were not in the checkpoint" in str(w.message)]
    assert not model.base_model.model.get_parameter(NEW[0]).requires_grad


def test_the_byte_budget_counts_the_scheduled_units_only(checkpoint):
    """freeze_ratio's budget is (1 - freeze_ratio) of the scheduled units' bytes; the new weights are outside it."""
    model, _ = wrap(load(checkpoint))
    scheduler = model.base_model.scheduler
    scheduled = sum(p.numel() * p.element_size() for unit in model.base_model._state.units for p in unit.params)
    assert sum(scheduler.sizes) == scheduled and scheduler.budget == pytest.approx(0.1 * scheduled)


@pytest.mark.parametrize("device", ["meta", "cpu"])
def test_the_planner_trains_them_at_every_step_too(checkpoint, device):
    """The planner copies the model it sizes (estimate: on the meta device; measure: on the device): the copy
    keeps the record of which weights the checkpoint lacked."""
    workload = resolve_workload(load(checkpoint), SlimFitConfig(), 2, 8, "adamw", "float32", None)
    model, notes = wrap(base_model(workload, device))
    assert len(notes) == 1 and not set(NEW) & set(model.base_model.unit_names)


def test_is_fsdp_enabled_means_fsdp_efficient_loading(monkeypatch, tmp_path):
    """The check units.new_weights makes: transformers' is_fsdp_enabled, true only under FSDP with CPU-RAM-efficient
    loading in a process group (where other processes than the first mark every weight as loaded)."""
    from peft_slim.slimfit import units

    if not dist.is_available() or dist.is_initialized():
        pytest.skip("needs torch.distributed and no process group yet")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert not units.is_fsdp_enabled()
        monkeypatch.setenv("ACCELERATE_USE_FSDP", "true")
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "true")
        assert units.is_fsdp_enabled()
        monkeypatch.setenv("FSDP_CPU_RAM_EFFICIENT_LOADING", "false")
        assert not units.is_fsdp_enabled()
    finally:
        dist.destroy_process_group()


def test_under_fsdp_efficient_loading_they_are_scheduled_with_a_warning(checkpoint, monkeypatch):
    """Processes other than the first mark every weight as loaded there: all processes must schedule the same
    units, so none is treated as new."""
    from peft_slim.slimfit import units

    monkeypatch.setattr(units, "is_fsdp_enabled", lambda: True)
    model, notes = wrap(load(checkpoint), note="CPU-RAM-efficient loading")
    assert len(notes) == 1 and "train_new_weights has no effect" in notes[0]
    assert set(NEW) <= set(model.base_model.unit_names)


def test_resuming_a_schedule_saved_with_other_units_names_them(checkpoint):
    """A run started with new weights scheduled (before the field existed) resumes only with the field off."""
    old = wrap(load(checkpoint), train_new_weights=False)[0].base_model.slimfit_state_dict()
    with pytest.raises(
        ValueError, match=r"(?s)only in the state: \['bert.pooler.dense.weight'.*train_new_weights=False"
    ):
        wrap(load(checkpoint))[0].base_model.load_slimfit_state_dict(old)
    wrap(load(checkpoint), train_new_weights=False)[0].base_model.load_slimfit_state_dict(old)


# ---------------------------------------------------------------------------------------------- the field


def test_the_field_is_on_by_default_and_checked():
    assert SlimFitConfig().train_new_weights is True
    with pytest.raises((ValueError, TypeError), match="SlimFitConfig.train_new_weights"):
        SlimFitConfig(train_new_weights="yes")
