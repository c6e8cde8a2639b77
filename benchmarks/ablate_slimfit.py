"""What SlimFit's accuracy in short, small-data runs depends on: one variant of its settings per run, recorded.

``python -m benchmarks.ablate_slimfit --task minilm-condition --variants paper bytes --seeds 0 1`` trains each
variant (a SlimFitConfig set apart from the defaults, or a baseline of ``benchmarks.methods``) with each seed,
and writes one JSON per run to ``benchmarks/results/ablation/<task>/<variant>_s<seed>.json`` (a run already there
is skipped). ``--table`` prints the Markdown summary of every run recorded for the task; ``--report TASK ...``
writes the benchmark's methods on those tasks (accuracy ± sd over the recorded seeds, total memory) to
``results/ablation/accuracy.md`` with ``accuracy_vs_memory.png``.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import sys

import torch
from transformers.utils import logging as hf_logging

from . import measure, plots
from .methods import Method, all_methods, lora, slimfit, tokentune
from .report import markdown_table, size, write_report
from .tasks import SMALL_TASKS, TASKS

ALL_TASKS = {**SMALL_TASKS, **TASKS}

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results", "ablation")
# The paper's rule.
PAPER = {"freeze_by": "count", "catch_up": "none", "always_train_norms": False, "train_new_weights": False}
BYTES = {**PAPER, "freeze_by": "bytes"}
NORMS = {**BYTES, "always_train_norms": True}
# name -> (freeze ratio, SlimFitConfig fields): what each variant sets apart from the current defaults.
VARIANTS: dict[str, tuple[float, dict]] = {
    **{f"paper-{r:g}": (r, PAPER) for r in (0.5, 0.8, 0.9, 0.95)},
    **{f"bytes-{r:g}": (r, BYTES) for r in (0.8, 0.9, 0.95)},
    "paper-0.9+norms": (0.9, {**PAPER, "always_train_norms": True}),
    "paper-0.9+catchup": (0.9, {**PAPER, "catch_up": "linear"}),
    "paper-0.9+minshare": (0.9, {**PAPER, "max_frozen_steps": 10}),
    "paper-0.9+keepstate": (0.9, {**PAPER, "release_frozen_optimizer_state": False}),
    "bytes-0.9+catchup": (0.9, {**BYTES, "catch_up": "linear"}),
    "bytes-0.9+norms+catchup": (0.9, {**BYTES, "always_train_norms": True, "catch_up": "linear"}),
    "bytes-0.9+minshare": (0.9, {**BYTES, "max_frozen_steps": 10}),
    **{
        f"bytes-{r:g}+norms+catchup": (r, {**BYTES, "always_train_norms": True, "catch_up": "linear"})
        for r in (0.8, 0.95)
    },
    "stack-0.9+catchup": (0.9, {**BYTES, "catch_up": "linear", "stack": True}),  # + TokenTune 0.2 + LoRA
    # The trade-off curves: freeze ratio 0.5 -> 0.95, with the paper's update and with catch-up by sqrt(k).
    **{f"bytes-{r:g}+norms": (r, NORMS) for r in (0.5, 0.7, 0.8, 0.9, 0.95)},
    **{f"bytes-{r:g}+norms+sqrt": (r, {**NORMS, "catch_up": "sqrt"}) for r in (0.5, 0.7, 0.8, 0.9, 0.95)},
    "stack-0.9": (0.9, {**NORMS, "stack": True}),
    "stack-0.9+sqrt": (0.9, {**NORMS, "catch_up": "sqrt", "stack": True}),
}
# SlimFit's defaults, spelled out (so that a later change of defaults cannot rename a recorded row), and the settings
# measured against them on the one-learning-rate tasks (benchmarks.bench_slimfit_accuracy).
DEFAULTS = {
    **NORMS,
    "catch_up": "sqrt",
    "train_new_weights": True,
    "metric": "relative_change",
    "max_frozen_steps": 100,
}
# The defaults since: every unit trains at least once per round of 1 / (1 - freeze_ratio) steps, and moves as far
# as the steps it missed (catch-up k times for k steps).
ROTATION = {**DEFAULTS, "catch_up": "linear", "max_frozen_steps": None}
VARIANTS.update(
    {
        # benchmarks.methods names the defaults with compression "slimfit-R+comp" and without "slimfit-R" (those
        # rows, at 0.8 / 0.9 / 0.95, are its own methods); these are the curve's further points, with compression.
        **{f"slimfit-{r:g}+comp": (r, DEFAULTS) for r in (0.5, 0.7)},
        "slimfit-0.9-newweights": (0.9, {**DEFAULTS, "train_new_weights": False}),
        "slimfit-0.9-newweights+pooler": (
            0.9,
            {**DEFAULTS, "train_new_weights": False, "always_trainable": ["pooler"]},
        ),
        "slimfit-0.9+pooler": (0.9, {**DEFAULTS, "always_trainable": ["pooler"]}),
        **{f"slimfit-{r:g}+gradient": (r, {**DEFAULTS, "metric": "gradient"}) for r in (0.5, 0.8, 0.9, 0.95)},
        "slimfit-0.9+pooler+gradient": (0.9, {**DEFAULTS, "always_trainable": ["pooler"], "metric": "gradient"}),
        "slimfit-0.9+linear": (0.9, {**DEFAULTS, "catch_up": "linear"}),
        "slimfit-0.9+pooler+linear": (0.9, {**DEFAULTS, "always_trainable": ["pooler"], "catch_up": "linear"}),
        "slimfit-0.9+gradient+linear": (0.9, {**DEFAULTS, "metric": "gradient", "catch_up": "linear"}),
        **{f"rotation-{r:g}": (r, ROTATION) for r in (0.5, 0.7, 0.8, 0.9, 0.95)},
        **{f"rotation-{r:g}+gradient": (r, {**ROTATION, "metric": "gradient"}) for r in (0.7, 0.8, 0.9)},
        "rotation-0.8+sqrt": (0.8, {**ROTATION, "catch_up": "sqrt"}),
    }
)
TOKENTUNE = {f"tokentune-{r:g}+lora": r for r in (0.5, 0.7)}
# The runs of bytes-*+norms+catchup and stack-0.9+catchup in results/ablation/ were made as SlimFit's benchmark
# methods (slimfit-0.8/0.9/0.95+comp, slimfit-0.9+tokentune-0.2+lora+comp) while catch-up was on by default, and
# renamed after the run to the settings they ran with (their "fields" say so).


# LoRA that also trains the pooler in full: on the one-learning-rate tasks (the model's own [CLS] pooler, which
# PEFT's SEQ_CLS task type leaves frozen) plain LoRA stays at the majority class.
EXTRA = {"lora+pooler": Method("lora+pooler", lambda t, s: lora(t, s, also_save=["pooler"]), "modules_to_save pooler")}


def method(name: str) -> Method:
    baselines = {**all_methods(), **EXTRA}
    if name in baselines:
        return baselines[name]
    if name in TOKENTUNE:  # the TokenTune side of the trade-off curve, beyond the benchmark's ratios
        return Method(name, lambda task, seed: tokentune(task, seed, TOKENTUNE[name]))
    ratio, fields = VARIANTS[name]
    return Method(name, lambda task, seed: slimfit(task, seed, ratio, compression=True, **fields), str(fields))


def run(task_name: str, variants: list[str], seeds: list[int]) -> None:
    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    hf_logging.set_verbosity_error()
    task = ALL_TASKS[task_name](False)
    folder = os.path.join(OUT, task_name)
    os.makedirs(folder, exist_ok=True)
    for seed in seeds:
        for variant in variants:
            path = os.path.join(folder, f"{variant}_s{seed}.json")
            if os.path.exists(path):
                continue
            result = measure.run(task, method(variant), seed, True, torch.device("cpu"))
            result.pop("slimfit_history", None)
            result.update(
                variant=variant, fields=method(variant).note, task=task.description, environment=environment()
            )
            with open(path + ".tmp", "w") as handle:
                json.dump(result, handle)
            os.replace(path + ".tmp", path)
            print(f"{task_name} {variant} s{seed}: {result['metrics']}", flush=True)


def environment() -> dict[str, str]:
    """Versions a run's numbers depend on: the same seed gives another head initialisation (MiniLM) or another
    pretrained ViT under other versions, so runs of one seed are comparable only within one environment."""
    import numpy
    import peft
    import transformers

    modules = {"torch": torch, "transformers": transformers, "peft": peft, "numpy": numpy}
    return {name: module.__version__ for name, module in modules.items()}


# The benchmark's rows (explicit settings, so that a later change of defaults cannot rename them): SlimFit's
# defaults are bytes-*+norms+sqrt (byte-aware freezing, norms always train, catch-up by sqrt(k)) and
# stack-0.9+sqrt (SlimFit 0.9 + TokenTune 0.2 + LoRA + compression); bytes-0.9+norms is the previous default
# (no catch-up) and paper-0.9 the paper's rule.
BENCH = [
    "full-ft",
    "lora",
    "tokentune-0.2+lora",
    "tokentune-0.3+lora",
    "paper-0.9",
    "bytes-0.9+norms",
    "bytes-0.8+norms+sqrt",
    "bytes-0.9+norms+sqrt",
    "bytes-0.95+norms+sqrt",
    "stack-0.9+sqrt",
]
# Further points of the trade-off curves (accuracy against memory as the ratio moves), shown after the rows.
CURVE = [
    "tokentune-0.5+lora",
    "bytes-0.5+norms+sqrt",
    "bytes-0.7+norms+sqrt",
    "bytes-0.5+norms",
    "bytes-0.7+norms",
    "bytes-0.8+norms",
    "bytes-0.95+norms",
    "stack-0.9",
]
# The curves the plot draws through its points, in ratio order.
LINES = {
    "SlimFit (defaults: catch-up sqrt), freeze 0.5 -> 0.95": [
        f"bytes-{r}+norms+sqrt" for r in (0.5, 0.7, 0.8, 0.9, 0.95)
    ],
    "SlimFit without catch-up, freeze 0.5 -> 0.95": [f"bytes-{r}+norms" for r in (0.5, 0.7, 0.8, 0.9, 0.95)],
    "TokenTune + LoRA, token ratio 0.5 -> 0.2": ["tokentune-0.5+lora", "tokentune-0.3+lora", "tokentune-0.2+lora"],
}


def recorded(task_name: str) -> dict[str, list[dict]]:
    """Every run recorded for the task: variant -> its runs, in seed order."""
    runs: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(OUT, task_name, "*.json"))):
        with open(path) as handle:
            result = json.load(handle)
        runs.setdefault(result["variant"], []).append(result)
    return runs


def summary(task_name: str, variants: list[str] | None = None) -> dict:
    """The task in the shape ``benchmarks.plots`` draws: per variant, total memory (first seed's) and accuracy."""
    runs = recorded(task_name)
    variants = [v for v in variants if v in runs] if variants else list(runs)
    methods = {}
    for variant in variants:
        results = runs[variant]
        metrics = {}
        for key in ("accuracy", "macro_f1"):
            values = [r["metrics"][key] for r in results]
            metrics[key] = {
                "mean": statistics.mean(values),
                "std": statistics.stdev(values) if len(values) > 1 else 0.0,
            }
        methods[variant] = {
            "total_bytes": results[0]["memory"]["total_bytes"],
            "memory": results[0]["memory"],
            "metrics": metrics,
            "seeds": [r["seed"] for r in results],
            # keyed by environment and seed: only runs of one environment pair up (``paired_difference``)
            "accuracy_by_seed": {f"{environment_name(r)}|{r['seed']}": r["metrics"]["accuracy"] for r in results},
            "environments": [environment_name(r) for r in results],
            "fields": results[0]["fields"],
        }
    description = runs[variants[0]][0]["task"] if variants else ""
    return {"name": task_name, "description": description, "metric": "accuracy", "higher_is_better": True,
            "methods": methods}  # fmt: skip


def environment_name(result: dict) -> str:
    versions = result.get("environment")
    return f"transformers {versions['transformers']}" if versions else "unrecorded (before 2026-12-01 09:30)"


def reference(name: str) -> str:
    """What a row is judged against (issue 17): TokenTune + LoRA against LoRA, the rest against full FT."""
    return "lora" if name.startswith("tokentune") else "full-ft"


def paired_difference(m: dict, ref: dict) -> str:
    """Accuracy minus the reference's, in points, over the seeds both ran (same seed: same data order and head
    initialisation, within one environment): mean ± sd (number of pairs)."""
    seeds = [s for s in m["accuracy_by_seed"] if s in ref["accuracy_by_seed"]]
    diffs = [100 * (m["accuracy_by_seed"][s] - ref["accuracy_by_seed"][s]) for s in seeds]
    if not diffs:
        return ""
    spread = f" ± {statistics.stdev(diffs):.1f}" if len(diffs) > 1 else ""
    return f"{statistics.mean(diffs):+.1f}{spread} ({len(diffs)})"


def table(task: dict, settings: bool = True) -> str:
    methods = task["methods"]
    full = methods.get("full-ft", {}).get("total_bytes")
    header = ["method", "seeds", "accuracy", "macro-F1", "Δ acc, points (pairs)", "vs", "total memory", "vs full FT"]
    rows = []
    for name, m in methods.items():
        accuracy, f1 = m["metrics"]["accuracy"], m["metrics"]["macro_f1"]
        ref = reference(name)
        difference = paired_difference(m, methods[ref]) if ref in methods and name != ref else ""
        row = [name, len(m["seeds"]), f"{accuracy['mean']:.3f} ± {accuracy['std']:.3f}", f"{f1['mean']:.3f}"]
        row += [difference, ref if difference else ""]
        row += [size(m["total_bytes"]), f"{m['total_bytes'] / full:.2f}" if full else ""]
        if settings:
            row.append(m["fields"] if name in VARIANTS else "")
        rows.append(row)
    return markdown_table(header + (["settings"] if settings else []), rows)


def report(tasks: list[str], out: str) -> None:
    """The benchmark's methods on ``tasks``: ``<out>/accuracy.md`` (tables) and ``accuracy_vs_memory.png``."""
    summaries = [summary(name, BENCH + CURVE) for name in tasks]
    text = ["# Accuracy of the methods on short, small-data runs (benchmarks.ablate_slimfit --report)", ""]
    for task in summaries:
        text += [f"## {task['name']}", "", task["description"], "", table(task, settings=False), ""]
        by_environment: dict[str, set] = {}
        for m in task["methods"].values():
            for seed, env in zip(m["seeds"], m["environments"]):
                by_environment.setdefault(env, set()).add(seed)
        text += ["Seeds by environment: " + "; ".join(f"{e}: {sorted(s)}" for e, s in by_environment.items()), ""]
    text.append("![accuracy against memory](accuracy_vs_memory.png)")
    plots.accuracy_vs_memory(summaries, os.path.join(out, "accuracy_vs_memory.png"), lines=LINES)
    write_report(out, "accuracy", {"tasks": summaries}, "\n".join(text))


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(ALL_TASKS), default="minilm-condition")
    parser.add_argument(
        "--variants", nargs="+", default=[], metavar="VARIANT", help=", ".join([*VARIANTS, *TOKENTUNE])
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1])
    parser.add_argument("--table", action="store_true", help="print the summary of the task's recorded runs")
    parser.add_argument("--report", nargs="+", metavar="TASK", help="tables and plot of the benchmark's methods")
    args = parser.parse_args(argv)
    if args.table:
        print(table(summary(args.task)))
        return 0
    if args.report:
        report(args.report, OUT)
        return 0
    run(args.task, args.variants, args.seeds)
    return 0


if __name__ == "__main__":
    sys.exit(main())
