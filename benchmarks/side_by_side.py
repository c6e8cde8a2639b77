"""Methods measured side by side in one process: steps that alternate between methods, ratios to a baseline.

Shared by ``bench_tokentune.py`` and ``bench_compression.py``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def time_alternating(steps: dict[str, Callable[[], object]], rounds: int, log: bool = False) -> dict[str, list]:
    """Wall seconds of each method's step over ``rounds`` rounds, the methods taking turns within each round so
    that load on a shared machine hits all of them alike."""
    seconds = {name: [] for name in steps}
    for index in range(rounds):
        for name, step in steps.items():
            start = time.perf_counter()
            step()
            seconds[name].append(time.perf_counter() - start)
        if log:
            print(f"step {index}:", {n: round(s[-1], 2) for n, s in seconds.items()}, flush=True)
    return seconds


def add_ratios(results: dict, baseline: str, tokens: int, ratios: dict[str, str]) -> None:
    """Add to every result, in place: median step time, tokens/s, each ``{bytes key: ratio key}`` of ``ratios`` as
    a ratio to ``results[baseline]``, and the step-time ratio."""
    base_median = statistics.median(results[baseline]["step_seconds"])
    for result in results.values():
        result["median_step_seconds"] = statistics.median(result["step_seconds"])
        result["tokens_per_second"] = tokens / result["median_step_seconds"]
        for key, ratio in ratios.items():
            result[ratio] = result[key] / results[baseline][key]
        result["step_time_ratio"] = result["median_step_seconds"] / base_median
