"""Every method on every task, side by side: memory, time and accuracy, as tables, JSON and plots.

``python -m benchmarks.run`` (full mode: real models and data, 3 seeds) or ``--quick`` (tiny random models, one
seed, a few steps: a smoke test). Writes ``<out>/<stem>.md``, ``<out>/<stem>.json`` and ``<out>/<stem>_*.png``,
where the stem is ``bench`` or ``bench_quick``. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import traceback

import torch
from tqdm.auto import tqdm
from transformers.utils import logging as hf_logging

from . import measure, plots
from .methods import all_methods, slimfit_available
from .report import write_report
from .summary import SLIMFIT, add_ratios, summarise_method, targets, task_markdown
from .tasks import TASKS

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")


def parse_args(argv=None) -> argparse.Namespace:
    methods = list(all_methods())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny random models, 1 seed, 4 steps (about 40 s)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument(
        "--methods", nargs="+", choices=methods, default=methods, metavar="METHOD", help=", ".join(methods)
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (quick: 0)")
    parser.add_argument("--out", default=RESULTS, help="output folder (default benchmarks/results)")
    parser.add_argument("--stem", default=None, help="output file stem (default bench, quick: bench_quick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's; quick: 1)")
    args = parser.parse_args(argv)
    args.threads = args.threads or (1 if args.quick else None)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.stem = args.stem or ("bench_quick" if args.quick else "bench")
    return args


def machine(device: torch.device) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    return (
        f"{where}; {platform.machine()}, {os.cpu_count()} CPU threads ({torch.get_num_threads()} used), "
        f"torch {torch.__version__}, fp32"
    )


def run_task(name: str, args, methods: dict, device: torch.device, failures: list[str]) -> dict:
    task = TASKS[name](args.quick)
    skipped = {}
    if not slimfit_available():
        skipped = {m: "peft_slim has no SlimFitConfig yet" for m, method in methods.items() if method.needs_slimfit}
    runnable = [m for m in methods if m not in skipped]
    runs: dict[str, list[dict]] = {m: [] for m in runnable}
    with tqdm(total=len(runnable) * len(args.seeds), desc=name, position=0) as bar:
        for index, seed in enumerate(args.seeds):  # seed-major: machine noise hits every method alike
            for method_name in runnable:
                if method_name in skipped:
                    continue
                bar.set_postfix_str(f"{method_name} seed {seed}")
                try:
                    runs[method_name].append(measure.run(task, methods[method_name], seed, index == 0, device))
                except Exception as error:  # noqa: BLE001 -- reported in the table, and the run exits non-zero
                    traceback.print_exc()
                    skipped[method_name] = f"failed: {type(error).__name__}: {error}".replace("|", "/")[:200]
                    failures.append(f"{name}/{method_name}")
                    runs.pop(method_name)
                bar.update()
    summaries = {m: summarise_method(r) for m, r in runs.items() if r}
    add_ratios(summaries)
    return {
        "name": name,
        "description": task.description,
        "metric": task.metric,
        "higher_is_better": task.higher_is_better,
        "seeds": args.seeds,
        "methods": summaries,
        "skipped": skipped,
        "targets": targets(summaries, task.metric, task.higher_is_better),
        "runs": runs,
    }


def plot(tasks: list[dict], out: str, stem: str) -> list[str]:
    files = [f"{stem}_memory.png", f"{stem}_pareto.png"]
    plots.memory_breakdown(tasks, os.path.join(out, files[0]))
    plots.accuracy_vs_memory(tasks, os.path.join(out, files[1]))
    for task in tasks:
        slimfit = [
            m for m in (SLIMFIT, *task["runs"]) if m in task["runs"] and "slimfit_history" in task["runs"][m][0]
        ]
        if slimfit:
            files.append(f"{stem}_slimfit_{task['name']}.png")
            history = task["runs"][slimfit[0]][0]["slimfit_history"]
            plots.freeze_heatmap(history, f"{slimfit[0]} on {task['name']}", os.path.join(out, files[-1]))
    return files


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)  # tiny models: one thread waits on no busy core
    torch.set_flush_denormal(True)  # AdamW's first steps on CPU otherwise crawl through denormal numbers
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device(args.device)
    methods = {name: method for name, method in all_methods().items() if name in args.methods}
    failures: list[str] = []
    tasks = [run_task(name, args, methods, device, failures) for name in args.tasks]
    setup = {"mode": "quick" if args.quick else "full", "machine": machine(device), "seeds": args.seeds}
    figures = plot(tasks, args.out, args.stem)
    markdown = [
        f"# Benchmark ({setup['mode']} mode)",
        "",
        f"Measured on: {setup['machine']}. Command: `python -m benchmarks.run {' '.join(sys.argv[1:])}`.",
        "Ratios are to LoRA and to full fine-tuning from the same run; metrics are mean ± sd over the seeds.",
    ]
    for task in tasks:
        markdown += ["", task_markdown(task, methods)]
    markdown += ["", *[f"![{name}]({name})" for name in figures]]
    if failures:
        markdown += ["", f"FAILED: {', '.join(failures)}"]
    write_report(args.out, args.stem, {"setup": setup, "tasks": tasks, "figures": figures}, "\n".join(markdown))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
