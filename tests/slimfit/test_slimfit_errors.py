"""SlimFit refuses bad input with clear errors, at config time or at get_peft_model."""

from __future__ import annotations

import pytest
import torch
from helpers.slimfit_cases import slimfit_model
from helpers.tiny_models import build
from peft import LoraConfig, get_peft_model

from peft_slim import SlimFitConfig, TokenTuneConfig, slimfit_


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"freeze_ratio": 1.0}, "freeze_ratio must be a float in \\[0, 1\\)"),
        ({"freeze_ratio": -0.1}, "freeze_ratio"),
        ({"freeze_ratio": "0.9"}, "freeze_ratio"),
        ({"metric": "gradient_norm"}, "metric must be one of"),
        ({"epsilon": 0}, "epsilon must be a finite float > 0"),
        ({"schedule_every": 0}, "schedule_every must be an int >= 1"),
        ({"max_frozen_steps": 1.5}, "max_frozen_steps"),
        ({"release_after_steps": 0}, "release_after_steps"),
        ({"units": []}, "units must be a non-empty list"),
        ({"units": [3]}, "units must be a non-empty list"),
        ({"seed": "x"}, "seed must be an int"),
        ({"lora": "r=4"}, "lora must be a peft.LoraConfig"),
        ({"lora_units": "row"}, "lora_units must be one of"),
        ({"activation_compression": 8}, "activation_compression must be"),
        ({"activation_compression": {"bits": 3}}, "bits must be one of"),
        ({"token_selection": 0.3}, "token_selection must be a peft_slim.TokenSelectionConfig"),
        ({"token_selection": TokenTuneConfig(lora=LoraConfig(r=2))}, "set them on the SlimFitConfig instead"),
        ({"token_selection": TokenTuneConfig(activation_compression={"bits": 8})}, "set them on the SlimFitConfig"),
        ({"freeze_by": "units"}, r"SlimFitConfig\.freeze_by must be one of \('bytes', 'count'\)"),
        ({"catch_up": "yes"}, r"SlimFitConfig\.catch_up must be one of \('sqrt', 'linear', 'none'\), got 'yes'"),
        ({"catch_up": 1}, r"SlimFitConfig\.catch_up must be one of .*, got 1\."),
        ({"catch_up": True}, r"SlimFitConfig\.catch_up must be one of .*, got True\."),
        ({"always_train_norms": 2}, r"SlimFitConfig\.always_train_norms must be True or False, got 2"),
    ],
)
def test_bad_config_fields(fields, message):
    with pytest.raises(ValueError, match=message):
        SlimFitConfig(**fields)


def test_unit_regex_matching_nothing():
    with pytest.raises(ValueError, match=r"matched no schedulable parameter"):
        slimfit_model("llama", units=[r"model\.layers\.(\d+)\..*", r"nothing\..*"])


def test_always_trainable_matching_nothing():
    with pytest.raises(ValueError, match="always_trainable"):
        slimfit_model("llama", always_trainable=["no_such_module"])


def test_no_unit_left_to_schedule():
    with pytest.raises(ValueError, match="no parameter left to schedule"):
        slimfit_model("llama", always_trainable=".*")
    with pytest.raises(ValueError, match="no parameter left to schedule"):  # LoRA's only module always trains
        slimfit_model("llama", lora=True, always_trainable=".*")


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_tokentune_on_an_unsupported_model_refused_before_changes(lora):
    model = build("llama", attn_implementation="eager")
    model.config._attn_implementation = "flash_attention_2"
    before = {name: (param.requires_grad, param.detach().clone()) for name, param in model.named_parameters()}
    fields = {"lora": LoraConfig(r=2, target_modules=["q_proj"])} if lora else {}
    config = SlimFitConfig(token_selection=TokenTuneConfig(), activation_compression=None, **fields)
    with pytest.raises(ValueError, match="attn_implementation"):
        get_peft_model(model, config) if lora else slimfit_(model, config)
    # the model is as it was: no LoRA layer, no hook, the same parameters and trainable flags
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(
        after[name].requires_grad == flag and torch.equal(after[name], value) for name, (flag, value) in before.items()
    )
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())


def test_slimfit_step_before_any_optimizer_step_frees_nothing():
    """No optimizer has stepped yet: there is no state to free, and the schedule still advances."""
    model = slimfit_model("llama")
    model.slimfit_step()
    assert model.base_model.scheduler.step == 1


def test_scheduler_state_for_another_model():
    state = slimfit_model("llama").base_model.slimfit_state_dict()
    with pytest.raises(ValueError, match="other units"):
        slimfit_model("bert").base_model.load_slimfit_state_dict(state)
