"""SlimFit's accuracy, memory and step time against full fine-tuning and LoRA, all methods in one run.

``python -m benchmarks.bench_slimfit_accuracy --task minilm-condition-1lr0.0001 --seeds 0 1 2 --methods full-ft lora
slimfit-0.9 ...`` trains each method (a baseline of ``benchmarks.methods``, or a SlimFit variant of
``benchmarks.ablate_slimfit.VARIANTS``) with each seed, the methods alternating within each seed, and writes
``benchmarks/results/<stem>.json`` (every run: accuracy, the last step's peak above what was held before it, total
memory, CPU time per step) and ``<stem>.md`` generated from it: per method the mean over seeds, and ratios against full
fine-tuning run with the same seed. Each finished run is kept in ``<stem>.partial.json``, so that a run cut short
resumes where it stopped; ``--report`` rewrites the Markdown from the JSON alone.

Step time is the process's CPU time per training step (median over the run's steps after the first), at one thread.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys

import torch
from transformers.utils import logging as hf_logging

from peft_slim.configuration import atomic_write_text

from . import measure
from .ablate_slimfit import ALL_TASKS, environment, method
from .report import markdown_table, mib

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
BASELINE = "full-ft"


def train_all(
    task_name: str, methods: list[str], seeds: list[int], partial: str, quick: bool = False
) -> tuple[list[dict], str]:
    """Every method with every seed (methods alternating within a seed); runs already in ``partial`` are kept.
    Returns the runs and the task's description."""
    runs = []
    if os.path.exists(partial):
        with open(partial) as handle:
            runs = json.load(handle)
    done = {(r["method"], r["seed"]) for r in runs}
    task = ALL_TASKS[task_name](quick)
    for seed in seeds:
        for name in methods:
            if (name, seed) in done:
                continue
            built = method(name)
            result = measure.run(task, built, seed, True, torch.device("cpu"))
            history = result.pop("slimfit_history", None)
            if history is not None:  # steps each unit trained in: min / median / max over the scheduled units
                counts = [sum(row[u] for row in history["trained"]) for u in range(len(history["units"]))]
                result["unit_steps"] = [min(counts), statistics.median(counts), max(counts)]
            result.pop("step_seconds")
            result.update(method=name, settings=built.note)
            runs.append(result)
            atomic_write_text(partial, json.dumps(runs))
            print(
                f"{task_name} {name} s{seed}: {result['metrics']} {result['median_step_cpu_seconds']:.2f} s",
                flush=True,
            )
    return runs, task.description


def summarise(runs: list[dict]) -> dict[str, dict]:
    """Per method: accuracy mean and sd over seeds, its difference from full FT of the same seed (points), and the
    ratios of memory and CPU step time to full FT's, averaged over the seeds both ran."""
    by = {(r["method"], r["seed"]): r for r in runs}
    out = {}
    for name in dict.fromkeys(r["method"] for r in runs):
        mine = [r for r in runs if r["method"] == name]
        pairs = [(r, by[(BASELINE, r["seed"])]) for r in mine if (BASELINE, r["seed"]) in by]
        accuracy = [r["metrics"]["accuracy"] for r in mine]

        def ratio(get, pairs=pairs, over=statistics.mean):
            return over(get(r) / get(b) for r, b in pairs) if pairs else None

        diffs = [100 * (r["metrics"]["accuracy"] - b["metrics"]["accuracy"]) for r, b in pairs]
        out[name] = {
            "seeds": [r["seed"] for r in mine],
            "accuracy": statistics.mean(accuracy),
            "accuracy_sd": statistics.stdev(accuracy) if len(accuracy) > 1 else 0.0,
            "accuracy_by_seed": accuracy,
            "macro_f1": statistics.mean(r["metrics"]["macro_f1"] for r in mine),
            "points_vs_full_ft": statistics.mean(diffs) if diffs else None,
            "points_vs_full_ft_sd": statistics.stdev(diffs) if len(diffs) > 1 else 0.0,
            "step_peak_bytes": statistics.mean(r["memory"]["step_peak"] for r in mine),
            "total_bytes": statistics.mean(r["memory"]["total_bytes"] for r in mine),
            "step_cpu_seconds": statistics.mean(r["median_step_cpu_seconds"] for r in mine),
            "step_peak_max_bytes": max(r["memory"]["step_peak"] for r in mine),
            "total_max_bytes": max(r["memory"]["total_bytes"] for r in mine),
            "step_peak_ratio": ratio(lambda r: r["memory"]["step_peak"]),
            "total_ratio": ratio(lambda r: r["memory"]["total_bytes"]),
            # The largest seed's: SlimFit's step peak depends on the units the step trains.
            "step_peak_ratio_max": ratio(lambda r: r["memory"]["step_peak"], over=max),
            "total_ratio_max": ratio(lambda r: r["memory"]["total_bytes"], over=max),
            "step_time_ratio": ratio(lambda r: r["median_step_cpu_seconds"]),
            "unit_steps": mine[0].get("unit_steps"),
            "settings": mine[0]["settings"],
        }
    return out


def markdown(report: dict) -> str:
    header = ["method", "seeds", "accuracy (mean ± sd)", "Δ vs full FT, points", "macro-F1", "step peak (max)"]
    header += ["vs full FT (max)", "total memory (max)", "vs full FT (max)", "step CPU time", "vs full FT"]
    header += ["unit steps (min/med/max)"]
    rows = []
    for name, m in report["summary"].items():

        def x(value, worst=None):
            return "" if value is None else f"{value:.2f}x" + ("" if worst is None else f" ({worst:.2f}x)")

        points = (
            ""
            if m["points_vs_full_ft"] is None or name == BASELINE
            else f"{m['points_vs_full_ft']:+.1f} ± {m['points_vs_full_ft_sd']:.1f}"
        )
        steps = "/".join(f"{s:g}" for s in m["unit_steps"]) if m["unit_steps"] else ""
        rows.append([
            name, len(m["seeds"]), f"{m['accuracy']:.3f} ± {m['accuracy_sd']:.3f}", points, f"{m['macro_f1']:.3f}",
            f"{mib(m['step_peak_bytes'])} ({mib(m['step_peak_max_bytes'])})",
            x(m["step_peak_ratio"], m["step_peak_ratio_max"]),
            f"{mib(m['total_bytes'])} ({mib(m['total_max_bytes'])})", x(m["total_ratio"], m["total_ratio_max"]),
            f"{m['step_cpu_seconds']:.2f} s", x(m["step_time_ratio"]), steps,
        ])  # fmt: skip
    settings = [f"- `{name}`: {m['settings']}" for name, m in report["summary"].items() if m["settings"]]
    text = [
        f"# {report['task']}: SlimFit against full fine-tuning and LoRA (benchmarks.bench_slimfit_accuracy)",
        "",
        f"Task: {report['description']}.",
        "",
        f"Command: `{report['command']}`. Machine: {report['machine']}. Versions: "
        + ", ".join(f"{k} {v}" for k, v in report["environment"].items())
        + ".",
        "",
        "Step peak: the last training step's peak above what was held before it (activations, gradients, "
        "temporaries); total memory: parameters + the run's largest optimizer state + largest gradients + the last "
        "step's activations; each the mean over seeds, the largest seed's in brackets. Step CPU time: median over the "
        "run's steps. Ratios and Δ: against full fine-tuning with the same seed, averaged over seeds (in brackets: "
        "the largest). Unit steps: how many of the run's steps each scheduled unit trained in "
        "(first seed).",
        "",
        markdown_table(header, rows),
        "",
        "Settings of the SlimFit rows (beyond freeze ratio and the default compression):",
        "",
        *settings,
    ]
    return "\n".join(text) + "\n"


# The template of docs/benchmarks.md, which tools/build_benchmarks_page.py renders.
DOCS = os.path.join(os.path.dirname(os.path.dirname(RESULTS)), "tools", "benchmarks_page.md")


def docs_markers(stem: str) -> tuple[str, str]:
    command = f"python -m benchmarks.bench_slimfit_accuracy --report --stem {stem} --docs"
    begin = f"<!-- generated by `{command}` from benchmarks/results/{stem}.json -->"
    return begin, f"<!-- end of {stem} -->"


def docs_block(report: dict) -> str:
    """The docs' table of one run: accuracy and the ratios to full fine-tuning, with the command that made it."""
    header = ["method", "accuracy (mean ± sd)", "Δ vs full FT, points", "step peak (largest seed)"]
    header += ["total memory (largest seed)", "step CPU time"]
    rows = []
    for name, m in report["summary"].items():
        points = "" if name == BASELINE else f"{m['points_vs_full_ft']:+.1f} ± {m['points_vs_full_ft_sd']:.1f}"
        rows.append([
            f"`{name}`", f"{m['accuracy']:.3f} ± {m['accuracy_sd']:.3f}", points,
            f"{m['step_peak_ratio']:.2f}x ({m['step_peak_ratio_max']:.2f}x)",
            f"{m['total_ratio']:.2f}x ({m['total_ratio_max']:.2f}x)", f"{m['step_time_ratio']:.2f}x",
        ])  # fmt: skip
    seeds = sorted({s for m in report["summary"].values() for s in m["seeds"]})
    versions = ", ".join(f"{k} {v}" for k, v in report["environment"].items())
    lines = [
        f"{report['description']}; seeds {', '.join(map(str, seeds))}. `{report['command']}`; {report['machine']}; "
        f"{versions}. Memory and time: ratios to full fine-tuning with the same seed, mean over seeds (the largest "
        "seed's in brackets); step peak: the last step's, above what was held before it.",
        "",
        markdown_table(header, rows),
    ]
    return "\n".join(lines)


def write_docs(report: dict, stem: str, path: str = DOCS) -> bool:
    """Replace the block between ``docs_markers(stem)`` in ``path``; False if the page has no such block."""
    with open(path) as handle:
        text = handle.read()
    begin, end = docs_markers(stem)
    if begin not in text or end not in text:
        return False
    head, rest = text.split(begin, 1)
    _, tail = rest.split(end, 1)
    atomic_write_text(path, f"{head}{begin}\n{docs_block(report)}\n{end}{tail}")
    return True


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=list(ALL_TASKS), default="minilm-condition-1lr0.0001")
    parser.add_argument("--methods", nargs="+", default=[BASELINE, "lora", "slimfit-0.9"])
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--stem", default="slimfit_accuracy")
    parser.add_argument("--out", default=RESULTS)
    parser.add_argument("--report", action="store_true", help="only rewrite <stem>.md from <stem>.json")
    parser.add_argument("--quick", action="store_true", help="the task's tiny random model (a smoke test)")
    parser.add_argument(
        "--docs", action="store_true", help="also rewrite this run's table in tools/benchmarks_page.md"
    )
    args = parser.parse_args(argv)
    path = os.path.join(args.out, args.stem)
    if args.report:
        with open(path + ".json") as handle:
            report = json.load(handle)
        report["summary"] = summarise(report["runs"])
        atomic_write_text(path + ".json", json.dumps(report, indent=1))
    else:
        if BASELINE not in args.methods:
            parser.error(f"--methods must include {BASELINE}: the ratios are against it")
        torch.set_num_threads(1)
        hf_logging.set_verbosity_error()
        torch.set_flush_denormal(True)  # denormals make some CPU steps many times slower, unevenly across methods
        try:
            runs, description = train_all(args.task, args.methods, args.seeds, path + ".partial.json", args.quick)
        finally:
            torch.set_flush_denormal(False)
        runs = [r for r in runs if r["method"] in args.methods and r["seed"] in args.seeds]
        report = {
            "task": args.task,
            "description": description,
            "command": "python -m benchmarks.bench_slimfit_accuracy " + " ".join(argv or sys.argv[1:]),
            "machine": f"{platform.machine()} CPU, {torch.get_num_threads()} thread, torch {torch.__version__}, fp32",
            "environment": environment(),
            "summary": summarise(runs),
            "runs": runs,
        }
        atomic_write_text(path + ".json", json.dumps(report, indent=1))
    atomic_write_text(path + ".md", markdown(report))
    if args.docs and not write_docs(report, args.stem):
        parser.error(f"tools/benchmarks_page.md has no block between {docs_markers(args.stem)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
