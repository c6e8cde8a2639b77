"""``python -m benchmarks.gpu --device cpu --tiny``: the GPU benchmark's smoke mode runs every method in-process.

On a CPU it measures nothing about a GPU; it checks that every method builds, trains a step and lands in the report
(or says why not: Liger-Kernel needs CUDA), and that the kernels' bandwidth section is filled in. And the device
script that runs the CUDA checks in one go, dry: it parses and its commands take their arguments.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from benchmarks import gpu


def test_smoke_mode_reports_every_method(tmp_path, capsys):
    report = gpu.main(["--device", "cpu", "--tiny", "--out", str(tmp_path)])
    names = [method.name for method in gpu.methods()]
    results = report["results"]
    assert list(results) == sorted(names, key=lambda n: n in {m.name for m in gpu.methods() if m.liger})
    for name, result in results.items():
        if "liger" in name:
            assert "skipped" in result  # no CUDA here
            continue
        assert "skipped" not in result, (name, result.get("skipped"))
        assert result["peak_bytes"] > 0 and len(result["step_seconds"]) == 1 and result["median_step_seconds"] > 0
        assert result["peak_ratio"] > 0 and result["step_ratio"] > 0
    assert results["lora"]["peak_ratio"] == 1.0
    assert set(report["kernels"]["rows"]) == {
        f"{b}-bit {p}" for b in (8, 4, 2) for p in ("default path", "torch path")
    }
    assert all(row["quantize_GBps"] > 0 and row["dequantize_GBps"] > 0 for row in report["kernels"]["rows"].values())
    assert json.loads((tmp_path / "gpu_tiny.json").read_text())["setup"]["machine"].startswith("CPU")
    table = (tmp_path / "gpu_tiny.md").read_text()
    assert all(f"| {name} |" in table for name in names)


def test_full_shapes_on_cpu_are_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu"])
    assert "--tiny" in capsys.readouterr().err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal without CUDA")
def test_cuda_without_a_device_is_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--tiny"])
    assert "no CUDA device" in capsys.readouterr().err


def test_unknown_method_names_are_refused(capsys):
    with pytest.raises(SystemExit):
        gpu.main(["--device", "cpu", "--tiny", "--methods", "lora,lora+ckpt,lroa", "--dry-run"])
    err = capsys.readouterr().err
    assert "'lroa'" in err and "lora+liger+ckpt" in err


def test_the_device_script_parses():
    subprocess.run(["bash", "-n", str(Path(__file__).parents[2] / "benchmarks" / "gpu_check.sh")], check=True)


@pytest.mark.slow  # about 40 s (it collects the whole suite); run it before a session with a GPU uses the script
def test_the_device_script_dry_run(tmp_path):
    """``benchmarks/gpu_check.sh --dry-run`` (no GPU): it parses, collects the ``cuda`` tests and checks each benchmark
    run's arguments, every step exiting 0."""
    script = Path(__file__).parents[2] / "benchmarks" / "gpu_check.sh"
    env = {**os.environ, "OUT": str(tmp_path), "PYTHON": sys.executable}
    result = subprocess.run(
        ["bash", str(script), "--dry-run"], cwd=script.parents[1], env=env, capture_output=True, text=True, timeout=600
    )
    log = (tmp_path / "check.log").read_text()
    assert result.returncode == 0 and result.stdout.count(": exit 0 after") == 3, result.stdout + log[-3000:]
    assert "test_the_compiled_kernels_pass_their_check" in log and "would run on cuda, shape 8b: lora," in log, log
