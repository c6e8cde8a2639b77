"""LoRA-stacked training is bit-identical to the code before the tuner became LoRA's own model class (``LoraModel``):
the sha256 of every gradient of two AdamW steps, and of every parameter (with its ``requires_grad``) after them, for
TokenTune with a second adapter, SlimFit with token selection and compression, and SlimFit with DoRA on a classifier.
``tests/helpers/data/lora_stacked.json`` was recorded by this file's ``__main__`` on the earlier code, at one intra-op
thread (with more, torch sums some gradients in another order)."""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from helpers.adapter_cases import bert_dora_config, method_config
from helpers.recorded import VERSIONS_KEY, load_recorded, record_path, versions
from helpers.tiny_models import build, make_batch
from peft import LoraConfig, get_peft_model

from peft_slim import TokenTuneConfig

RECORD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "data", "lora_stacked.json")


def _configs():
    return {
        "tt": ("llama", method_config("tokentune_lora")),
        "sf": ("llama", method_config("full_stack")),
        "sf_bert": ("bert", bert_dora_config()),
    }


def _digest(tensor: torch.Tensor) -> str:
    return hashlib.sha256(tensor.detach().numpy().tobytes()).hexdigest()


def run(name: str) -> dict[str, str]:
    arch, config = _configs()[name]
    torch.manual_seed(0)
    model = get_peft_model(build(arch, seed=0), config)
    if name == "tt":
        second = LoraConfig(r=2, target_modules=["k_proj"])
        model.add_adapter("second", TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, seed=1, lora=second))
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if hasattr(model, "slimfit_attach"):
        model.slimfit_attach(optimizer)
    out = {}
    for step in range(2):
        model(**make_batch(arch, seed=step)).loss.backward()
        for key, param in model.named_parameters():
            if param.grad is not None:
                out[f"{name}/{step}/grad/{key}"] = _digest(param.grad)
        optimizer.step()
        optimizer.zero_grad()
        if hasattr(model, "slimfit_step"):
            model.slimfit_step()
    for key, param in model.named_parameters():
        out[f"{name}/param/{key}"] = _digest(param) + str(param.requires_grad)
    return out


@pytest.mark.parametrize("name", sorted(_configs()))
def test_bit_identical_to_the_recorded_steps(name, one_thread):
    record = load_recorded(RECORD)
    recorded = {key: value for key, value in record.items() if key.startswith(f"{name}/")}
    got = run(name)
    assert got.keys() == recorded.keys()
    differ = sorted(key for key in recorded if got[key] != recorded[key])
    assert not differ, differ[:5]


if __name__ == "__main__":
    torch.set_num_threads(1)
    record = {key: value for name in sorted(_configs()) for key, value in run(name).items()}
    record[VERSIONS_KEY] = versions()
    with open(record_path(RECORD), "w") as handle:
        json.dump(record, handle, indent=0, sort_keys=True)
        handle.write("\n")
