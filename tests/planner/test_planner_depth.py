"""A deep model given as a config is traced at 1, 2 and 3 blocks and scaled to its depth: the estimate is the one a
trace at full depth gives, for every setting of the plan's ladder; where the blocks do not add alike (SlimFit's
share of units, a per-layer setting in the config) the model is traced at full depth."""

from __future__ import annotations

import warnings
from dataclasses import replace
from unittest import mock

import pytest
from helpers.planner_cases import llama_config

from peft_slim.planner import estimate, estimate_memory
from peft_slim.planner.plan import ladder

DEEP = 5
STEP = dict(batch_size=2, seq_len=64)


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def full_depth(config, peft_config, gradient_checkpointing=False):
    """The estimate traced at the model's own depth."""
    step = (peft_config, STEP["batch_size"], STEP["seq_len"], "adamw", "float32", None, gradient_checkpointing)
    return estimate.traced(config, step)


SETTINGS = ladder(4, 0.3)
SETTINGS = [*SETTINGS, *(replace(c, gradient_checkpointing=True) for c in SETTINGS)]
QUICK = {"lora+lora-r4", "tokentune-0.3+lora-r4", "tokentune-0.3+lora-r4+4bit+ckpt"}
# A few settings by default (LoRA; TokenTune; TokenTune compressed and checkpointed), every one of the ladder in the
# slow run (two traces of a deep model each).
PARAMS = [pytest.param(c, id=c.name, marks=() if c.name in QUICK else pytest.mark.slow) for c in SETTINGS]


@pytest.mark.parametrize("candidate", PARAMS)
def test_scaled_by_depth_is_the_full_depth_trace(candidate):
    config = llama_config(num_hidden_layers=DEEP)
    peft_config = candidate.peft_config("CAUSAL_LM", "all-linear")
    checkpointing = candidate.gradient_checkpointing
    found = estimate_memory(config, peft_config, **STEP, gradient_checkpointing=checkpointing)
    assert found == full_depth(config, peft_config, checkpointing)


def test_blocks_that_add_alike_are_scaled_and_a_slimfit_share_is_not():
    config = llama_config(num_hidden_layers=DEEP)
    depths = []
    real = estimate.traced

    def spy(model, step):
        depths.append(model.num_hidden_layers)
        return real(model, step)

    with mock.patch.object(estimate, "traced", spy):
        estimate_memory(config, SETTINGS[1].peft_config("CAUSAL_LM", "all-linear"), **STEP)  # TokenTune
        assert depths == [1, 2, 3]
        depths.clear()
        slimfit = next(c for c in SETTINGS if c.method == "slimfit")
        estimate_memory(config, slimfit.peft_config("CAUSAL_LM", "all-linear"), **STEP)
        assert depths == [DEEP]  # 20% of 7, 14, 21 units: not the same number more per block
        depths.clear()
        step = (slimfit.peft_config("CAUSAL_LM", "all-linear"), 2, 64, "adamw", "float32", None, False)
        assert estimate.scaled_by_depth(config, step) is None


def test_a_config_with_a_setting_per_layer_is_traced_at_full_depth():
    per_layer = llama_config(num_hidden_layers=DEEP, layer_types=["full_attention"] * DEEP)
    assert not estimate.depth_scalable(per_layer)
    assert estimate.depth_scalable(llama_config(num_hidden_layers=DEEP))
    assert not estimate.depth_scalable(llama_config(num_hidden_layers=3))
