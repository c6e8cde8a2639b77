"""A LoRA-stacked adapter's files are those of the code before the tuner moved onto PEFT's ``LoraModel``.

``tests/helpers/data/saved_adapters.json`` holds, for each case below, the sha256 of each saved
``adapter_config.json`` and, for ``adapter_model.safetensors``, of its tensor bytes and of its JSON header (keys
sorted). The header's ``peft_slim.config_blake2b`` metadata entry, a digest of the config files that the code of
the recording stamped into the weights and that is gone since, is left out of the header compared. Record again
(only where a change of the saved files is intended) with ``PYTHONPATH=tests python tests/saving/test_saved_bytes.py``.
"""

from __future__ import annotations

import hashlib
import json
import os

import pytest
import torch
from helpers.adapter_cases import bert_dora_config, method_config
from helpers.recorded import VERSIONS_KEY, load_recorded, record_path, versions
from helpers.tiny_models import build
from peft import LoraConfig, get_peft_model

import peft_slim
from peft_slim import SlimFitConfig

RECORD = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "data", "saved_adapters.json")
OLD_STAMP_KEY = "peft_slim.config_blake2b"


def _tokentune(**lora):
    return method_config("tokentune_lora", **lora)


CASES = {  # name: (architecture, the configs of its adapters by name)
    "tokentune_llama": ("llama", {"default": _tokentune()}),
    "tokentune_llama_two_adapters": (
        "llama",
        {"default": _tokentune(), "second": _tokentune(r=2, target_modules=["k_proj"], use_rslora=True)},
    ),
    "slimfit_llama_full_stack": ("llama", {"default": method_config("full_stack")}),
    "slimfit_gpt2_bias_all": (
        "gpt2",
        {
            "default": SlimFitConfig(
                task_type="CAUSAL_LM", seed=0, lora=LoraConfig(r=4, target_modules=["c_attn"], bias="all")
            )
        },
    ),
    "slimfit_bert_dora_head": ("bert", {"default": bert_dora_config()}),
}


def build_case(name: str):
    """The case's PeftModel, every adapter weight (LoRA and saved heads) set from a seeded generator."""
    arch, configs = CASES[name]
    (first, config), *others = configs.items()
    model = get_peft_model(build(arch, seed=0), config, adapter_name=first)
    for adapter, other in others:
        model.add_adapter(adapter, other)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for key, param in sorted(model.named_parameters()):
            if "lora_" in key or "modules_to_save" in key:
                param.copy_(torch.randn(param.shape, generator=generator))
    return model


def file_digests(folder: str) -> dict[str, str]:
    """sha256 of every adapter_config.json under ``folder`` and of each adapter_model.safetensors' header (without
    the old stamp) and tensor bytes, by relative path."""
    digests = {}
    for top, _, files in sorted(os.walk(folder)):
        for file in sorted(files):
            path = os.path.join(top, file)
            relative = os.path.relpath(path, folder)
            with open(path, "rb") as handle:
                data = handle.read()
            if file == "adapter_config.json":
                digests[relative] = hashlib.sha256(data).hexdigest()
            elif file == "adapter_model.safetensors":
                length = int.from_bytes(data[:8], "little")
                header = json.loads(data[8 : 8 + length])
                header.get("__metadata__", {}).pop(OLD_STAMP_KEY, None)
                text = json.dumps(header, sort_keys=True).encode()
                digests[relative + ":header"] = hashlib.sha256(text).hexdigest()
                digests[relative + ":tensors"] = hashlib.sha256(data[8 + length :]).hexdigest()
    return digests


def saved_digests(name: str, folder: str, how: str) -> dict[str, str]:
    model = build_case(name)
    if how == "peft":
        model.save_pretrained(folder)
    else:
        peft_slim.save_pretrained(model, folder)
    return file_digests(folder)


@pytest.mark.parametrize("how", ["peft", "peft_slim"])
@pytest.mark.parametrize("name", sorted(CASES))
def test_saved_files_are_those_recorded(name, how, tmp_path):
    record = load_recorded(RECORD)
    recorded = record[name]
    assert saved_digests(name, str(tmp_path), how) == recorded


if __name__ == "__main__":
    import tempfile

    record = {}
    for case in sorted(CASES):
        with tempfile.TemporaryDirectory() as folder:
            record[case] = saved_digests(case, folder, "peft")
    record[VERSIONS_KEY] = versions()
    with open(record_path(RECORD), "w") as handle:
        json.dump(record, handle, indent=1, sort_keys=True)
        handle.write("\n")
