"""What the equal-budget benchmark measured, for ranking the planner's settings by time to quality.

``measured.json`` (next to this module) is written by ``tools/build_benchmarks_page.py`` from the benchmark's
``benchmarks/results/budget/budget.json``; a test checks it is what the script would write now. For each method
the benchmark ran it holds the key (``Recipe.key``) of the recipe its ``peft-slim train`` flags give, and per task
the mean over seeds of its ratios against LoRA + gradient checkpointing of the same seed. A planner setting gets a
measurement only where its recipe has the same key (method, token ratio and selection rule, compression, SlimFit's
freezing, checkpointing); the LoRA rank and targets may differ, and the evidence line says which were measured.
"""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass
from functools import cache
from importlib import resources

DATA_FILE = "measured.json"


@dataclass(frozen=True)
class Measurement:
    """One benchmark method's result: means over seeds per task, ratios against LoRA + checkpointing."""

    name: str  # the benchmark's method name, e.g. "tokentune-0.3"
    tasks: dict  # task -> {"seeds", "seeds_reaching_reference", "time_to_reference_ratio", ...}
    lora: dict  # the LoRA it was measured with: {"r", "alpha", "target_modules"}
    source: dict  # the file's provenance (model, machine, report, command)

    @property
    def reaches(self) -> bool:
        """Reached LoRA's final perplexity (within 2%) in the time budget in every seed of every task."""
        return all(t["seeds_reaching_reference"] == len(t["seeds"]) for t in self.tasks.values())

    @property
    def time_to_reference(self) -> float | None:
        """Mean over tasks of the mean time to LoRA's final perplexity / the budget (seeds that reached it)."""
        values = [t["time_to_reference_ratio"] for t in self.tasks.values()]
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    @property
    def best_within_budget(self) -> float:
        """Mean over tasks of the best perplexity within the time budget / LoRA's final perplexity."""
        values = [t["best_within_budget_ratio"] for t in self.tasks.values()]
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else math.inf

    @property
    def peak(self) -> float | None:
        """Mean over tasks of the measured step peak / LoRA + checkpointing's (None: not measured)."""
        values = [t["peak_ratio_to_budget_method"] for t in self.tasks.values()]
        values = [v for v in values if v is not None]
        return statistics.mean(values) if values else None

    def sort_key(self) -> tuple:
        """Those that reach LoRA's perplexity first, soonest first; then the rest by best perplexity in the budget."""
        return (0, self.time_to_reference) if self.reaches else (1, self.best_within_budget)

    def evidence(self) -> str:
        seeds = sum(len(t["seeds"]) for t in self.tasks.values())
        reached = sum(t["seeds_reaching_reference"] for t in self.tasks.values())
        reach = "reaches LoRA's final perplexity (within 2%) in"
        if self.reaches:
            head = f"{reach} {self.time_to_reference:.2f}x the time of LoRA + checkpointing"
        else:
            head = (
                f"{reach} {reached} of {seeds} runs within LoRA + checkpointing's time; "
                f"best perplexity in that time {self.best_within_budget:.3f}x LoRA's final"
            )
        peak = self.peak
        peak = f"{peak:.2f}x its step peak" if peak is not None else "step peak not measured"
        tasks = ", ".join(f"{task} ({_count(len(t['seeds']), 'seed')})" for task, t in self.tasks.items())
        lora = f"LoRA r={self.lora['r']} on {self.lora['target_modules']}"
        where = f"{self.source['model']}, {lora}; {'task' if len(self.tasks) == 1 else 'tasks'} {tasks}; "
        where += f"{self.source['hardware']}; {self.source['report']}"
        return f"measured: {head}, {peak} ({where})"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


@cache
def _data() -> dict:
    return json.loads(resources.files(__package__).joinpath(DATA_FILE).read_text())


def measurement_for(candidate, data: dict | None = None) -> Measurement | None:
    """The measurement of exactly ``candidate``'s setting, or None (never a near one)."""
    data = _data() if data is None else data
    wanted = candidate.recipe.key
    for name, m in data["methods"].items():
        if m["setting"] == wanted:
            return Measurement(name, m["tasks"], m["lora"], data["source"])
    return None
