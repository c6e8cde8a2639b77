"""docs/planner.md's timing of the 8B example is the one benchmarks/bench_planner_speed.py recorded."""

from __future__ import annotations

import json
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[2]


def test_the_docs_quote_the_recorded_times():
    runs = json.loads((ROOT / "benchmarks" / "results" / "planner_speed.json").read_text())["runs"]
    text = " ".join((ROOT / "docs" / "planner.md").read_text().split())
    for run in runs.values():
        assert f"{run['seconds']:.0f} s ({run['cpu_seconds']:.0f} CPU seconds)" in text
    assert f"load average {runs['example']['load_average'][0]:.1f};" in text
