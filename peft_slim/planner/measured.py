"""What the equal-budget benchmark measured, for ranking the planner's settings by time to quality.

``measured.json`` (next to this module) is written by ``tools/build_benchmarks_page.py`` from the benchmark's
``benchmarks/results/budget/budget.json``; a test checks it is what the script would write now. For each method
the benchmark ran it holds the key (``Recipe.key``) of the recipe its ``peft-slim train`` flags give, and per task
the mean over seeds of its ratios against LoRA + gradient checkpointing of the same seed. A planner setting gets a
measurement only where its recipe has the same key (method, token ratio and selection rule, compression, SlimFit's
freezing, checkpointing); the LoRA rank and targets and the prompt ratio may differ, and the evidence line says
which were measured.
A method the later runs against LoRA + checkpointing with TRL's fused LM head (``budget_trl`` and the long-prompt
``budget_trl_longqa``) also measured carries those ratios too (``against_trl_head``, their tasks together); the
ranking uses the first run's, one baseline for all.
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
    against_trl_head: dict | None = None  # {"report", "tasks"}: ratios against LoRA + ckpt with TRL's fused head
    prompt_ratio: float | None = None  # the prompt ratio it was measured with (answer-first token selection)

    def sort_key(self) -> tuple:
        """Those that reach LoRA's final perplexity (within 2%) in the time budget in every seed of every task first,
        soonest first (mean over tasks of the time to it / the budget); then the rest by best perplexity within the
        budget / LoRA's final (mean over tasks)."""
        if _reaches(self.tasks):
            return (0, _mean_over(self.tasks, "time_to_reference_ratio"))
        best = _mean_over(self.tasks, "best_within_budget_ratio")
        return (1, math.inf if best is None else best)

    def brief(self) -> str:
        """The evidence in a table cell: the measured time to LoRA's final perplexity (or how many runs got there)
        against LoRA + checkpointing; ``evidence`` gives the rest."""
        if _reaches(self.tasks):
            time = _mean_over(self.tasks, "time_to_reference_ratio")
            return f"measured: LoRA's final perplexity in {time:.2f}x the time of LoRA + ckpt"
        seeds = sum(len(t["seeds"]) for t in self.tasks.values())
        reached = sum(t["seeds_reaching_reference"] for t in self.tasks.values())
        return f"measured: LoRA's final perplexity in {reached} of {seeds} runs in LoRA + ckpt's time"

    def evidence(self) -> str:
        """The measured numbers and where they come from, against LoRA + checkpointing and, where that run has
        this setting, against LoRA + checkpointing with TRL's fused LM head (the baseline a TRL user has)."""
        lora = f"LoRA r={self.lora['r']} on {self.lora['target_modules']}"
        if self.prompt_ratio is not None:
            lora += f", prompt ratio {self.prompt_ratio:g}"
        where = f"{self.source['model']}, {lora}; {_tasks(self.tasks)}; {self.source['hardware']}; "
        text = f"measured: {_numbers(self.tasks, 'LoRA + checkpointing')} ({where}{self.source['report']})"
        if self.against_trl_head:
            stronger = self.against_trl_head
            baseline = "LoRA + checkpointing with TRL's fused LM head"
            text += f"; {_numbers(stronger['tasks'], baseline)} ({_tasks(stronger['tasks'])}; {stronger['report']})"
        return text


def _reaches(tasks: dict) -> bool:
    return all(t["seeds_reaching_reference"] == len(t["seeds"]) for t in tasks.values())


def _mean_over(tasks: dict, key: str) -> float | None:
    values = [t[key] for t in tasks.values() if t[key] is not None]
    return statistics.mean(values) if values else None


def _numbers(tasks: dict, baseline: str) -> str:
    """Time to LoRA's final perplexity (or how close the budget got) and the step peak, against ``baseline``."""
    reach = "reaches LoRA's final perplexity (within 2%) in"
    if _reaches(tasks):
        head = f"{reach} {_mean_over(tasks, 'time_to_reference_ratio'):.2f}x the time of {baseline}"
    else:
        seeds = sum(len(t["seeds"]) for t in tasks.values())
        reached = sum(t["seeds_reaching_reference"] for t in tasks.values())
        best = _mean_over(tasks, "best_within_budget_ratio")
        head = f"{reach} {reached} of {seeds} runs within the time of {baseline}; best perplexity in that time "
        head += f"{best:.3f}x LoRA's final"
    peak = _mean_over(tasks, "peak_ratio_to_budget_method")
    return head + (f", {peak:.2f}x its step peak" if peak is not None else ", step peak not measured")


def _tasks(tasks: dict) -> str:
    listed = ", ".join(f"{task} ({_count(len(t['seeds']), 'seed')})" for task, t in tasks.items())
    return f"{'task' if len(tasks) == 1 else 'tasks'} {listed}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("s" if n != 1 else "")


@cache
def _data() -> dict:
    return json.loads(resources.files(__package__).joinpath(DATA_FILE).read_text())


def measurement_for(candidate, data: dict | None = None) -> Measurement | None:
    """The measurement of exactly ``candidate``'s setting (but its LoRA and prompt ratio), or None (never a near
    one)."""
    data = _data() if data is None else data
    wanted = candidate.recipe.key
    for name, m in data["methods"].items():
        if m["setting"] == wanted:
            return Measurement(
                name, m["tasks"], m["lora"], data["source"], m.get("against_trl_head"), m.get("prompt_ratio")
            )
    return None
