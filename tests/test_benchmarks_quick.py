"""``python -m benchmarks.run --quick`` runs every method on the three tiny tasks and writes well-formed results."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("matplotlib")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_quick_benchmark_writes_tables_json_and_plots(tmp_path):
    command = [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path)]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]

    report = json.loads((tmp_path / "bench_quick.json").read_text())
    assert [task["name"] for task in report["tasks"]] == ["minilm-drugs", "smollm2-pydocs", "vit-mnist"]
    for task in report["tasks"]:
        methods = task["methods"]
        assert {"full-ft", "lora", "lora+ckpt", "lora+offload", "lora-fa", "tokentune-0.2+lora"} <= set(methods)
        assert not any(reason.startswith("failed") for reason in task["skipped"].values()), task["skipped"]
        for name, summary in methods.items():
            memory = summary["memory"]
            assert memory["total_bytes"] == sum(
                memory[k] for k in ("parameters", "gradients", "optimizer_state", "activations")
            )
            assert memory["parameters"] > 0 and summary["saved_activation_bytes"] > 0, name
            assert summary["median_step_seconds"] > 0 and summary["tokens_per_second"] > 0, name
            assert summary["ratios"]["total_bytes_vs_lora"] > 0, name
            assert task["metric"] in summary["metrics"], name
        assert methods["lora"]["ratios"]["median_step_seconds_vs_lora"] == 1.0
        # TokenTune saves activations for a fifth of the tokens: fewer bytes than LoRA even on a tiny model.
        assert methods["tokentune-0.2+lora"]["saved_activation_bytes"] < methods["lora"]["saved_activation_bytes"]

    markdown = (tmp_path / "bench_quick.md").read_text()
    for task in report["tasks"]:
        assert f"### {task['name']}" in markdown
    assert markdown.count("| method | saved activations |") == 3
    assert "FAILED" not in markdown
    for figure in report["figures"]:
        assert (tmp_path / figure).read_bytes()[:8] == PNG_MAGIC, figure
    assert {"bench_quick_memory.png", "bench_quick_pareto.png"} <= set(report["figures"])
    if any(task["methods"].keys() & {"slimfit-0.9+comp", "slimfit-0.9"} for task in report["tasks"]):
        assert any(figure.startswith("bench_quick_slimfit_") for figure in report["figures"])
