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


def test_seeds_in_parallel_processes_and_merging_reports(tmp_path):
    """``--jobs 2`` runs two seeds at once; ``--merge`` rebuilds one report from two runs' JSON files, and
    ``--retime`` measures their step times again."""
    base = [sys.executable, "-m", "benchmarks.run", "--quick", "--out", str(tmp_path), "--methods", "lora", "full-ft"]
    for task, extra in (("vit-mnist", ["--seeds", "0", "1", "--jobs", "2"]), ("minilm-drugs", [])):
        command = [*base, "--tasks", task, "--stem", task, *extra]
        result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
        assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    vit = json.loads((tmp_path / "vit-mnist.json").read_text())["tasks"][0]
    assert [run["seed"] for run in vit["runs"]["lora"]] == [0, 1]
    assert "memory" in vit["runs"]["lora"][0] and "memory" not in vit["runs"]["lora"][1]  # first seed profiled

    files = [str(tmp_path / "minilm-drugs.json"), str(tmp_path / "vit-mnist.json")]
    command = [
        sys.executable,
        "-m",
        "benchmarks.run",
        "--merge",
        *files,
        "--retime",
        "--rounds",
        "1",
        "--threads",
        "1",
    ]
    command += ["--out", str(tmp_path), "--stem", "merged"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stdout[-5000:] + result.stderr[-5000:]
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert [task["name"] for task in merged["tasks"]] == ["minilm-drugs", "vit-mnist"]
    markdown = (tmp_path / "merged.md").read_text()
    assert markdown.count("Measured on:") == 2 and markdown.count("| method | saved activations |") == 2
    assert markdown.count("Step times measured again") == 2
    for task in merged["tasks"]:
        assert {run["clock"] for run in (s["timing"] for s in task["methods"].values())} == {"cpu"}
        assert task["methods"]["lora"]["ratios"]["median_step_seconds_vs_lora"] == 1.0
    assert (tmp_path / "merged_pareto.png").read_bytes()[:8] == PNG_MAGIC
