"""The planner's estimates equal, to the byte, those recorded before its speed-up
(tests/helpers/data/planner_estimates*.json, recorded by tests/helpers/planner_cases.py): every setting of each
case's ladder and full fine-tuning, one by one through ``estimate_memory``, and ``plan``'s own answer. A few
settings per tiny case by default; every one, and the Llama-3-8B-like config of docs/planner.md's example, in the
slow run."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import replace

import pytest
from helpers.planner_cases import RECORDED_CASES, estimate_case

from peft_slim.planner import plan
from peft_slim.planner.plan import ladder

DATA = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "helpers", "data")


def _recorded(name: str) -> dict:
    with open(os.path.join(DATA, name)) as handle:
        return json.load(handle)["cases"]


RECORDED = {"tiny": _recorded("planner_estimates.json"), "8b": _recorded("planner_estimates_8b.json")}
QUICK = {  # case -> the settings checked by default
    "llama 2 blocks": ("tokentune-0.05+lora-r8+4bit+ckpt", "full"),
    "llama 6 blocks bf16": ("lora+lora-r8", "tokentune-0.2+lora-r8+8bit+ckpt"),  # "full" of 2 blocks: below
    "llama 5 blocks q,v sgd": ("tokentune-0.5+lora-r4+4bit",),
    "bert 4 blocks": ("tokentune-0.3+lora-r8+ckpt",),
    "vit 4 blocks": ("tokentune-0.5+lora-r8+8bit",),
}


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def params():
    for group, cases in RECORDED_CASES.items():
        for name in cases:
            quick = group == "tiny" and name in QUICK
            yield pytest.param(group, name, QUICK[name] if quick else None, id=f"{name} (all)", marks=pytest.mark.slow)
            if quick:
                yield pytest.param(group, name, QUICK[name], id=name)


@pytest.mark.parametrize(("group", "name", "only"), list(params()))
def test_estimates_equal_the_recorded_ones(group, name, only):
    model, arguments = RECORDED_CASES[group][name]()
    recorded = RECORDED[group][name]
    if only is None:
        assert estimate_case(model, arguments) == recorded
    else:
        assert estimate_case(model, arguments, only) == {setting: recorded[setting] for setting in only}


@pytest.mark.slow
@pytest.mark.parametrize(("group", "name"), [(g, n) for g, cases in RECORDED_CASES.items() for n in cases])
def test_plan_answers_with_the_recorded_estimates(group, name):
    """``plan`` with no budget: every setting of the ladder with its recorded estimate, and each checkpointed one
    exactly where its recorded peak is below the same setting's without checkpointing."""
    model, arguments = RECORDED_CASES[group][name]()
    recorded = RECORDED[group][name]
    found = plan(model, None, **arguments, rank="ladder")
    assert {c.name: c.estimate.to_dict() for c in found} == {c.name: recorded[c.name] for c in found}
    plain = ladder(arguments.get("lora_r", 8), arguments.get("min_token_ratio", 0.1))
    kept = [replace(c, gradient_checkpointing=True).name for c in plain]
    kept = [n for n in kept if recorded[n]["peak"] < recorded[n.removesuffix("+ckpt")]["peak"]]
    assert [c.name for c in found] == [c.name for c in plain] + kept
