"""TokenTune over transformers' model zoo (tools/architecture_sweep.py): every architecture exact against the
independent reference or refused naming the real cause. A handful of representatives run in the default suite; the
whole sweep is slow. docs/architectures.md must equal the rendering of the committed data file."""

from __future__ import annotations

import json
import pathlib
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tools"))

import architecture_sweep  # noqa: E402

# model type -> (class, what the refusal must say): one per kind of block the invariant and the checks tell apart.
REPRESENTATIVES = {
    "llama": ("exact", None),
    "gpt_oss": ("exact", None),  # eager attention with sinks and sliding windows
    "granitemoe": ("exact", None),  # the model makes a KV cache itself (no use_cache argument, config default True)
    "falcon_h1": (
        "refused",
        r"(?s)FalconH1DecoderLayer exactly.*differ from the full pass",
    ),  # a mixer beside attention
    "deepseek_v32": ("refused", r"(?s)DeepseekV32DecoderLayer exactly.*it fails"),  # a sparse-attention indexer
    "doge": ("refused", r"(?s)DogeDecoderLayer exactly.*it fails"),  # a mask computed from the hidden states
    "stablelm": ("refused", r"StableLmDecoderLayer.*does not pass its keyword arguments"),
    "cpmant": ("refused", r"CpmAntTransformerBlock.*input hidden states have shape \(2, 56, 64\)"),  # not the labels
}


@pytest.mark.parametrize("model_type", sorted(REPRESENTATIVES))
def test_representative_architectures(model_type):
    import re

    expected, message = REPRESENTATIVES[model_type]
    result = architecture_sweep.check(model_type, "causal_lm")
    assert result["class"] == expected, result
    if message is not None:
        assert re.search(message, result["reason"]), result["reason"]
    else:
        assert result["relative_error"] <= architecture_sweep.TOLERANCE


def test_encoder_classifier():
    result = architecture_sweep.check("modernbert", "encoder_classifier")
    assert result["class"] == "exact", result


@pytest.mark.slow
def test_every_architecture_is_exact_or_refused():
    results = architecture_sweep.run(architecture_sweep.architectures(), verbose=False)
    failures = {name: r for name, r in results.items() if r["class"] in ("wrong", "crash")}
    assert not failures, failures


def test_the_page_is_the_data_files_rendering():
    data = json.loads(architecture_sweep.DATA.read_text())
    assert architecture_sweep.PAGE.read_text() == architecture_sweep.render(data), (
        "docs/architectures.md is stale: run `python tools/architecture_sweep.py --page`"
    )
    counts = {name: sum(r["class"] == name for r in data["results"].values()) for name in architecture_sweep.CLASSES}
    assert counts["wrong"] == counts["crash"] == 0, counts
