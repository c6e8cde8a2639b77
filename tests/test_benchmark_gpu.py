"""``python -m benchmarks.gpu --device cpu --tiny``: the GPU benchmark's smoke mode runs every method in-process.

On a CPU it measures nothing about a GPU; it checks that every method builds, trains a step and lands in the report
(or says why not: Liger-Kernel needs CUDA), and that the kernels' bandwidth section is filled in.
"""

from __future__ import annotations

import json

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
