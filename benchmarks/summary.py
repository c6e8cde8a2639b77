"""Per task: the seeds of each method summarised, ratios to LoRA and to full fine-tuning, the issue's targets,
and the Markdown tables."""

from __future__ import annotations

import statistics

from .methods import Method
from .report import markdown_table, size

BASELINES = {"lora": "LoRA", "full-ft": "full FT"}
MEMORY_PARTS = ("parameters", "gradients", "optimizer_state", "activations")
TOKENTUNE, SLIMFIT, STACK = "tokentune-0.2+lora", "slimfit-0.9+comp", "slimfit-0.9+tokentune-0.2+lora+comp"


def spread(values: list[float]) -> dict:
    return {
        "mean": statistics.mean(values),
        "std": statistics.stdev(values) if len(values) > 1 else 0.0,
        "values": values,
    }


def summarise_method(runs: list[dict]) -> dict:
    """Memory from the first seed's run (the one profiled), time as the median of the seeds' medians."""
    first = runs[0]
    return {
        "saved_activation_bytes": first["saved_activation_bytes"],
        "memory": first["memory"],
        "total_bytes": first["memory"]["total_bytes"],
        "median_step_seconds": statistics.median(r["median_step_seconds"] for r in runs),
        "tokens_per_second": statistics.median(r["tokens_per_second"] for r in runs),
        "metrics": {key: spread([r["metrics"][key] for r in runs]) for key in first["metrics"]},
        "seeds": [r["seed"] for r in runs],
    }


def add_timing(summaries: dict[str, dict], timing: dict[str, dict]) -> None:
    """The interleaved pass's step time and tokens/s replace the training runs' (see ``measure.time_steps``)."""
    for name, summary in summaries.items():
        summary["timing"] = timing[name]
        summary["median_step_seconds"] = timing[name]["median_step_seconds"]
        summary["tokens_per_second"] = timing[name]["tokens_per_second"]


def add_ratios(summaries: dict[str, dict]) -> None:
    for summary in summaries.values():
        summary["ratios"] = {
            f"{quantity}_vs_{baseline}": summary[quantity] / summaries[baseline][quantity]
            for baseline in BASELINES
            if baseline in summaries
            for quantity in ("saved_activation_bytes", "total_bytes", "median_step_seconds")
        }


def targets(summaries: dict[str, dict], metric: str, higher_is_better: bool) -> dict[str, bool | None]:
    """The issue's targets; None where a method did not run or (perplexity) the bound is in accuracy points."""

    def ratio(name, key):
        return summaries[name]["ratios"].get(key) if name in summaries else None

    def within(name, baseline, points):
        if name not in summaries or baseline not in summaries or not higher_is_better:
            return None
        return (
            summaries[baseline]["metrics"][metric]["mean"] - summaries[name]["metrics"][metric]["mean"] <= points / 100
        )

    def at_most(value, bound):
        return None if value is None else value <= bound

    lowest = min(summaries, key=lambda name: summaries[name]["total_bytes"]) if STACK in summaries else None
    return {
        f"{TOKENTUNE}: saved activations <= 0.3x LoRA": at_most(
            ratio(TOKENTUNE, "saved_activation_bytes_vs_lora"), 0.3
        ),
        f"{TOKENTUNE}: step time <= 0.85x LoRA": at_most(ratio(TOKENTUNE, "median_step_seconds_vs_lora"), 0.85),
        f"{TOKENTUNE}: {metric} within 1 point of LoRA": within(TOKENTUNE, "lora", 1),
        f"{SLIMFIT}: total memory <= 0.45x full FT": at_most(ratio(SLIMFIT, "total_bytes_vs_full-ft"), 0.45),
        f"{SLIMFIT}: {metric} within 1 point of full FT": within(SLIMFIT, "full-ft", 1),
        "full stack: lowest total memory": None if lowest is None else lowest == STACK,
        f"full stack: {metric} within 2 points of LoRA": within(STACK, "lora", 2),
    }


def metric_cell(spread_: dict, digits: int) -> str:
    return f"{spread_['mean']:.{digits}f} ± {spread_['std']:.{digits}f}"


def ratio_cells(summary: dict, quantity: str, baselines: list[str]) -> list[str]:
    return [f"{summary['ratios'][f'{quantity}_vs_{b}']:.2f}x" for b in baselines]


def step_time_note(summaries: dict[str, dict]) -> str:
    timing = next((s["timing"] for s in summaries.values() if "timing" in s), None)
    if timing is None:
        return "Step time: median wall time of the training steps."
    clock = "CPU time of the process (one intra-op thread)" if timing["clock"] == "cpu" else "wall time"
    return (
        f"Step time: {clock} per step (forward, backward, optimizer), median of {len(timing['wall_seconds'])} steps "
        "of an interleaved pass (each round builds every method in turn, on the same batches); tokens/s from it."
    )


def task_markdown(task_report: dict, methods: dict[str, Method]) -> str:
    summaries, skipped = task_report["methods"], task_report["skipped"]
    metric_keys = list(next(iter(summaries.values()))["metrics"]) if summaries else []
    baselines = [b for b in BASELINES if b in summaries]
    versus = [f"vs {BASELINES[b]}" for b in baselines]
    header = ["method", "saved activations", *versus, "peak memory", *versus, "step time", *versus, "tokens/s"]
    header += metric_keys
    rows, split_rows = [], []
    for name in methods:
        if name in skipped:
            rows.append([name, f"skipped: {skipped[name]}", *["–"] * (len(header) - 2)])
        if name not in summaries:
            continue
        s = summaries[name]
        rows.append(
            [name, size(s["saved_activation_bytes"]), *ratio_cells(s, "saved_activation_bytes", baselines)]
            + [size(s["total_bytes"]), *ratio_cells(s, "total_bytes", baselines)]
            + [f"{s['median_step_seconds']:.3f} s", *ratio_cells(s, "median_step_seconds", baselines)]
            + [f"{s['tokens_per_second']:.0f}"]
            + [metric_cell(s["metrics"][key], 2 if key == "perplexity" else 3) for key in metric_keys]
        )
        split_rows.append([name] + [size(s["memory"][part]) for part in MEMORY_PARTS] + [size(s["total_bytes"])])
    split_header = ["method", "parameters", "gradients", "optimizer state", "activations + temporaries", "total"]
    verdict = {True: "met", False: "MISSED", None: "not measured"}
    lines = [
        f"### {task_report['name']}",
        "",
        f"Setup: {task_report['description']}; seeds {task_report['seeds']}.",
        "",
        markdown_table(header, rows),
        "",
        "Peak training memory by category (first seed, one profiled step):",
        "",
        markdown_table(split_header, split_rows),
        "",
        step_time_note(summaries),
        "",
        "Targets (issue 5): " + "; ".join(f"{k}: {verdict[v]}" for k, v in task_report["targets"].items()) + ".",
    ]
    notes = [f"`{name}`: {m.note}" for name, m in methods.items() if m.note and name in summaries]
    if notes:
        lines += ["", "Notes: " + "; ".join(notes) + "."]
    return "\n".join(lines)
