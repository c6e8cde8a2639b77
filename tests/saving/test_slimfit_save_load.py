"""SlimFit save → load (fresh processes): a LoRA adapter (also exported for vanilla PEFT) and a fully fine-tuned
plain checkpoint; merge_and_unload, and eval-mode outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.slimfit_cases import slimfit_model, train
from helpers.tiny_models import build, make_batch
from peft import LoraConfig
from safetensors.torch import load_file

import peft_slim
from peft_slim import (
    ActivationCompressionConfig,
    SlimFitConfig,
    TokenSelectionConfig,
    TokenTuneConfig,
)

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the helpers package is
PREFIX = "base_model.model."


def _eval_logits(model, arch: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        batch = {k: v for k, v in make_batch(arch).items() if k != "labels"}
        return model(**batch).logits


def _run_fresh(code: str) -> dict:
    """Run ``code`` in a fresh interpreter (the tests' helpers and this checkout importable); returns what it
    printed as ``RESULT=<json>``."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([HERE, os.path.dirname(HERE)])}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    return json.loads(line.removeprefix("RESULT="))


def test_eval_outputs_equal_the_base_model_before_training():
    for arch in ("bert", "llama"):
        base_logits = _eval_logits(build(arch), arch)
        assert torch.equal(_eval_logits(slimfit_model(arch), arch), base_logits)


# A fresh process loads the saved SlimFit adapter; another, which never imports peft_slim, loads the exported LoRA
# adapter with vanilla PEFT and the fully fine-tuned checkpoint with transformers.
_SLIM_CHILD = """
    import json, sys, torch, peft_slim
    from peft import PeftModel
    from helpers.tiny_models import build, make_batch
    report = {{}}
    for name, arch in (("adapter", "llama"),):
        model = peft_slim.from_pretrained(build(arch), {root!r} + "/" + name).eval()
        batch = {{k: v for k, v in make_batch(arch).items() if k != "labels"}}
        with torch.no_grad():
            torch.save(model(**batch).logits, {root!r} + "/" + name + ".reloaded.pt")
        config = model.peft_config["default"]
        report[name] = {{
            "tuner": type(model.base_model).__name__,
            "token_ratio": config.token_selection.token_ratio if config.token_selection is not None else None,
        }}
    print("RESULT=" + json.dumps(report))
"""
_VANILLA_CHILD = """
    import json, sys, torch
    from peft import PeftModel
    from helpers.tiny_models import build, make_batch
    report = {{}}
    for name in ("adapter", "lora"):  # what save_pretrained wrote, with plain_lora=True
        model = PeftModel.from_pretrained(build("llama"), {root!r} + "/" + name).eval()
        batch = {{k: v for k, v in make_batch("llama").items() if k != "labels"}}
        with torch.no_grad():
            torch.save(model(**batch).logits, {root!r} + "/" + name + ".vanilla.pt")
        report[name] = type(model.base_model).__name__
    from transformers import BertForSequenceClassification
    model = BertForSequenceClassification.from_pretrained({root!r} + "/full").eval()
    batch = {{k: v for k, v in make_batch("bert").items() if k != "labels"}}
    with torch.no_grad():
        torch.save(model(**batch).logits, {root!r} + "/full.reloaded.pt")
    report["slim_imported"] = any(m.startswith("peft_slim") for m in sys.modules)
    print("RESULT=" + json.dumps(report))
"""


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """A fully fine-tuned SlimFit BERT and a SlimFit + TokenTune + LoRA + compression Llama, trained, saved (the
    stack also exported as plain LoRA), and loaded again in fresh processes."""
    root = tmp_path_factory.mktemp("slimfit_saved")
    full = slimfit_model("bert", freeze_ratio=0.9, max_frozen_steps=50)
    train(full, "bert", steps=2)
    full.save_pretrained(root / "full")  # the plain model's own save_pretrained

    tokentune = TokenTuneConfig(token_ratio=0.5, seed=0)
    compression = ActivationCompressionConfig(bits=4, min_numel=0)
    stack = slimfit_model(
        "llama", lora=True, freeze_ratio=0.5, token_selection=tokentune, activation_compression=compression
    )
    train(stack, "llama", steps=3)
    stack.save_pretrained(root / "adapter")
    peft_slim.save_pretrained(stack, str(root / "lora"), plain_lora=True)

    slim = _run_fresh(_SLIM_CHILD.format(root=str(root)))
    vanilla = _run_fresh(_VANILLA_CHILD.format(root=str(root)))
    return {"root": root, "full": full, "stack": stack, "slim": slim, "vanilla": vanilla}


def test_full_fine_tuning_saves_a_plain_checkpoint_that_reloads_exactly(saved):
    model, root = saved["full"], saved["root"]
    assert sorted(os.listdir(root / "full")) == ["config.json", "model.safetensors"]
    assert "peft_slim" not in (root / "full" / "config.json").read_text()
    saved_tensors = load_file(root / "full" / "model.safetensors")
    assert not any("peft_slim" in key or "base_model" in key for key in saved_tensors)
    assert not torch.equal(_eval_logits(model, "bert"), _eval_logits(build("bert"), "bert"))  # training changed it
    # transformers alone, in a process that never imports peft_slim, loads it to the same outputs
    assert saved["vanilla"]["slim_imported"] is False
    assert torch.equal(torch.load(root / "full.reloaded.pt"), _eval_logits(model, "bert"))


def test_lora_stack_saves_reloads_and_exports_for_vanilla_peft(saved):
    model, root = saved["stack"], saved["root"]
    config = json.loads((root / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4  # a plain LoRA adapter...
    record = json.loads((root / "adapter" / "peft_slim_config.json").read_text())  # ...the method beside it
    assert record["peft_type"] == "SLIMFIT" and record["token_selection"]["token_ratio"] == 0.5
    assert record["activation_compression"]["bits"] == 4 and "lora" not in record  # LoRA: adapter_config.json only
    expected = _eval_logits(model, "llama")
    assert not torch.equal(expected, _eval_logits(build("llama"), "llama"))  # training changed the outputs
    assert saved["slim"]["adapter"] == {"tuner": "SlimFitModel", "token_ratio": 0.5}
    assert torch.equal(torch.load(root / "adapter.reloaded.pt"), expected)
    # the saved and the exported plain LoRA adapter, in a process that never imports peft_slim
    assert saved["vanilla"] == {"adapter": "LoraModel", "lora": "LoraModel", "slim_imported": False}
    assert torch.equal(torch.load(root / "adapter.vanilla.pt"), expected)
    assert torch.equal(torch.load(root / "lora.vanilla.pt"), expected)


def test_merge_and_unload_with_lora():
    model = slimfit_model("llama", lora=True, freeze_ratio=0.5)
    train(model, "llama", steps=2)
    expected = _eval_logits(model, "llama")
    merged = model.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_eval_logits(merged, "llama"), expected, atol=1e-5)


def test_config_round_trip_through_json(tmp_path):
    config = SlimFitConfig(
        freeze_ratio=0.8,
        units=[r".*layers\.(\d+)\..*"],
        token_selection=TokenTuneConfig(num_tokens=8),
        activation_compression={"bits": 4},
        task_type="CAUSAL_LM",
        lora=LoraConfig(r=2, target_modules=["q_proj"]),
    )
    config.save_pretrained(tmp_path)
    loaded = SlimFitConfig.from_pretrained(tmp_path)
    assert loaded.method_dict() == config.method_dict()
    assert loaded.lora_export_config().to_dict() == config.lora_export_config().to_dict()  # the same LoRA adapter
    assert isinstance(loaded.token_selection, TokenSelectionConfig) and loaded.token_selection.num_tokens == 8
    assert loaded.activation_compression == config.activation_compression


def test_push_to_hub_uploads_the_saved_files(offline_hub, tmp_path):
    model = slimfit_model("bert", lora=True, freeze_ratio=0.8)
    train(model, "bert", steps=2)
    model.push_to_hub("someone/tiny-slimfit", private=True)
    assert offline_hub["http"] == []
    uploaded = offline_hub["uploaded"]
    model.save_pretrained(tmp_path)
    assert set(uploaded) == set(os.listdir(tmp_path))
    assert uploaded["adapter_model.safetensors"] == (tmp_path / "adapter_model.safetensors").read_bytes()
    assert json.loads(uploaded["adapter_config.json"])["peft_type"] == "LORA"
    assert json.loads(uploaded["peft_slim_config.json"])["peft_type"] == "SLIMFIT"
