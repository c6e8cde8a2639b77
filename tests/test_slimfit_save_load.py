"""SlimFit save → load (fresh processes), export_lora, merge_and_unload, unload, and eval-mode outputs."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file
from slimfit_cases import slimfit_model, train
from tiny_models import build, make_batch
from transformers import PreTrainedModel

from peft_slim import (
    ActivationCompressionConfig,
    SlimFitConfig,
    SlimFitModel,
    TokenSelectionConfig,
    TokenTuneConfig,
    export_lora,
)

HERE = os.path.dirname(os.path.abspath(__file__))
PREFIX = "base_model.model."


def _eval_logits(model, arch: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        batch = {k: v for k, v in make_batch(arch).items() if k != "labels"}
        return model(**batch).logits


def _run_fresh(code: str) -> None:
    env = {**os.environ, "PYTHONPATH": HERE}
    result = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-4000:]


def test_eval_outputs_equal_the_base_model_before_training():
    for arch in ("bert", "llama"):
        base_logits = _eval_logits(build(arch), arch)
        assert torch.equal(_eval_logits(slimfit_model(arch), arch), base_logits)


def test_standalone_saves_only_changed_tensors_and_reloads_exactly(tmp_path):
    model = slimfit_model("bert", freeze_ratio=0.9, max_frozen_steps=50)
    train(model, "bert", steps=2)
    tuner = model.base_model
    ever_trained = {
        n
        for i, unit in enumerate(tuner._units)
        if any(r[i] for r in tuner.scheduler.history)
        for n in unit.param_names
    }
    model.save_pretrained(tmp_path)
    saved = load_file(tmp_path / "adapter_model.safetensors")
    base = dict(build("bert").named_parameters())
    tuned = {n.removeprefix(PREFIX): p for n, p in model.named_parameters()}
    changed = {n for n, p in base.items() if n in tuned and not torch.equal(p, tuned[n])}
    assert changed, "training changed nothing: the test would prove nothing"
    keys = {k.removeprefix(PREFIX).replace("base_model.model.", "") for k in saved}
    # every changed base tensor is saved; never-trained units (unchanged) are not
    assert changed <= keys
    never = {n for unit in tuner._units for n in unit.param_names} - ever_trained
    assert never and not (never & keys)
    assert {k for k in keys if k.startswith("classifier")} == {"classifier.weight", "classifier.bias"}
    expected = _eval_logits(model, "bert")
    torch.save(expected, tmp_path / "expected.pt")
    _run_fresh(f"""
        import torch, peft_slim
        from peft import PeftModel
        from tiny_models import build, make_batch
        model = PeftModel.from_pretrained(build("bert"), {str(tmp_path)!r})
        assert isinstance(model.base_model, peft_slim.SlimFitModel)
        model.eval()
        batch = {{k: v for k, v in make_batch("bert").items() if k != "labels"}}
        with torch.no_grad():
            logits = model(**batch).logits
        assert torch.equal(logits, torch.load({str(tmp_path / "expected.pt")!r})), (logits,)
    """)


def test_lora_stack_saves_reloads_and_exports_for_vanilla_peft(tmp_path):
    tokentune = TokenTuneConfig(token_ratio=0.5, seed=0)
    compression = ActivationCompressionConfig(bits=4, min_numel=0)
    model = slimfit_model(
        "llama", lora=True, freeze_ratio=0.5, tokentune=tokentune, activation_compression=compression
    )
    train(model, "llama", steps=3)
    model.save_pretrained(tmp_path / "adapter")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert config["peft_type"] == "SLIMFIT" and config["tokentune"]["token_ratio"] == 0.5
    assert config["activation_compression"]["bits"] == 4 and config["lora"]["r"] == 4
    export_lora(model, str(tmp_path / "lora"))
    torch.save(_eval_logits(model, "llama"), tmp_path / "expected.pt")
    load = f"""
        import torch
        from tiny_models import build, make_batch
        from peft import PeftModel
        batch = {{k: v for k, v in make_batch("llama").items() if k != "labels"}}
        expected = torch.load({str(tmp_path / "expected.pt")!r})
    """
    _run_fresh(
        load
        + f"""
        import peft_slim
        model = PeftModel.from_pretrained(build("llama"), {str(tmp_path / "adapter")!r}).eval()
        assert model.peft_config["default"].tokentune.token_ratio == 0.5
        with torch.no_grad():
            assert torch.equal(model(**batch).logits, expected)
    """
    )
    _run_fresh(
        load
        + f"""
        import sys
        model = PeftModel.from_pretrained(build("llama"), {str(tmp_path / "lora")!r}).eval()
        assert "peft_slim" not in sys.modules
        with torch.no_grad():
            assert torch.allclose(model(**batch).logits, expected, atol=1e-6)
    """
    )


def test_merge_and_unload_returns_a_plain_tuned_model():
    model = slimfit_model("llama", freeze_ratio=0.5)
    train(model, "llama", steps=2)
    expected = _eval_logits(model, "llama")
    merged = model.merge_and_unload()
    assert isinstance(merged, PreTrainedModel) and not isinstance(merged, SlimFitModel)
    assert not merged._forward_pre_hooks and not merged._forward_hooks
    assert all(p.requires_grad for p in merged.parameters())
    assert torch.equal(_eval_logits(merged, "llama"), expected)


def test_merge_and_unload_with_lora():
    model = slimfit_model("llama", lora=True, freeze_ratio=0.5)
    train(model, "llama", steps=2)
    expected = _eval_logits(model, "llama")
    merged = model.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_eval_logits(merged, "llama"), expected, atol=1e-5)


def test_unload_without_kept_weights_is_refused_and_with_them_restores_the_base():
    model = slimfit_model("llama", freeze_ratio=0.5)
    train(model, "llama", steps=2)
    with pytest.raises(ValueError, match="keep_base_weights=True"):
        model.unload()
    assert _eval_logits(model, "llama") is not None  # still usable after the refusal

    kept = slimfit_model("llama", freeze_ratio=0.5, keep_base_weights=True)
    train(kept, "llama", steps=2)
    base = build("llama")
    restored = kept.unload()
    for (name, a), b in zip(restored.named_parameters(), base.parameters()):
        assert torch.equal(a, b), name
    assert not restored._forward_pre_hooks


def test_unload_untrained_model_is_allowed():
    model = slimfit_model("bert")
    assert model.unload() is not None


def test_config_round_trip_through_json(tmp_path):
    config = SlimFitConfig(
        freeze_ratio=0.8,
        units=[r".*layers\.(\d+)\..*"],
        tokentune=TokenTuneConfig(num_tokens=8),
        activation_compression={"bits": 4},
        task_type="CAUSAL_LM",
    )
    config.save_pretrained(tmp_path)
    loaded = SlimFitConfig.from_pretrained(tmp_path)
    assert loaded.to_dict() == config.to_dict()
    assert isinstance(loaded.tokentune, TokenSelectionConfig) and loaded.tokentune.num_tokens == 8
    assert loaded.activation_compression == config.activation_compression


def test_push_to_hub_uploads_the_saved_files(offline_hub, tmp_path):
    model = slimfit_model("bert", freeze_ratio=0.8)
    train(model, "bert", steps=2)
    model.push_to_hub("someone/tiny-slimfit", private=True)
    assert offline_hub["http"] == []
    uploaded = offline_hub["uploaded"]
    model.save_pretrained(tmp_path)
    assert set(uploaded) == set(os.listdir(tmp_path))
    assert uploaded["adapter_model.safetensors"] == (tmp_path / "adapter_model.safetensors").read_bytes()
    assert json.loads(uploaded["adapter_config.json"])["peft_type"] == "SLIMFIT"
