"""Every method on every task, side by side: memory, time and accuracy, as tables, JSON and plots.

``python -m benchmarks.run`` (full mode: real models and data, 3 seeds) or ``--quick`` (tiny random models, one
seed, a few steps: a smoke test). Writes ``<out>/<stem>.md``, ``<out>/<stem>.json`` and ``<out>/<stem>_*.png``,
where the stem is ``bench`` or ``bench_quick`` and the folder ``benchmarks/results`` or, for ``--quick``, the
git-ignored ``benchmarks/results/quick``. See benchmarks/README.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import multiprocessing
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
from .summary import SLIMFIT, add_ratios, add_timing, summarise_method, targets, task_markdown
from .tasks import TASKS

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
QUICK_RESULTS = os.path.join(RESULTS, "quick")  # git-ignored: a smoke test's output is no result to commit


def parse_args(argv=None) -> argparse.Namespace:
    methods = list(all_methods())
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="tiny random models, 1 seed, 4 steps (seconds)")
    parser.add_argument("--tasks", nargs="+", choices=list(TASKS), default=list(TASKS))
    parser.add_argument(
        "--methods", nargs="+", choices=methods, default=methods, metavar="METHOD", help=", ".join(methods)
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=None, help="default: 0 1 2 (quick: 0)")
    parser.add_argument(
        "--out", default=None, help="output folder (default benchmarks/results; quick: benchmarks/results/quick)"
    )
    parser.add_argument("--stem", default=None, help="output file stem (default bench, quick: bench_quick)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default torch's; quick: 1)")
    parser.add_argument(
        "--jobs", type=int, default=1, help="CPU: run the seeds in this many processes at once (default 1)"
    )
    parser.add_argument(
        "--merge", nargs="+", metavar="JSON", help="no training: one report from these earlier runs' JSON files"
    )
    parser.add_argument(
        "--rounds", type=int, default=None, help="rounds of the interleaved step-time pass (default 3, quick: 1)"
    )
    parser.add_argument(
        "--retime", action="store_true", help="with --merge: measure the step times again (interleaved pass)"
    )
    parser.add_argument(
        "--reprofile", nargs="+", metavar="METHOD", help="with --merge: measure these methods' memory again"
    )
    args = parser.parse_args(argv)
    args.rounds = args.rounds or (1 if args.quick else 3)
    args.threads = args.threads or (1 if args.quick else None)
    args.seeds = args.seeds or ([0] if args.quick else [0, 1, 2])
    args.stem = args.stem or ("bench_quick" if args.quick else "bench")
    args.out = args.out or (QUICK_RESULTS if args.quick else RESULTS)
    return args


def machine(device: torch.device, jobs: int) -> str:
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    used = f"{torch.get_num_threads()} used" + (f" by each of {jobs} processes" if jobs > 1 else "")
    return f"{where}; {platform.machine()}, {os.cpu_count()} CPU threads ({used}), torch {torch.__version__}, fp32"


def run_seed(task, args, methods: dict, runnable: list[str], device, index: int, seed: int) -> dict[str, dict | str]:
    """Every runnable method with one seed, in order: method -> its run, or the error it failed with."""
    out: dict[str, dict | str] = {}
    with tqdm(total=len(runnable), desc=f"{task.name} seed {seed}", position=index, leave=args.jobs == 1) as bar:
        for method_name in runnable:
            bar.set_postfix_str(method_name)
            try:
                out[method_name] = result = measure.run(
                    task, methods[method_name], seed, index == 0, device, args.jobs + index
                )
                metrics = ", ".join(f"{key} {value:.4g}" for key, value in result["metrics"].items())
                tqdm.write(
                    f"{task.name} {method_name} seed {seed}: {metrics}, {result['median_step_seconds']:.3f} s/step"
                )
            except Exception as error:  # noqa: BLE001 -- reported in the table, and the run exits non-zero
                traceback.print_exc()
                out[method_name] = f"failed: {type(error).__name__}: {error}".replace("|", "/")[:200]
            bar.update()
    return out


_FORKED: tuple = ()  # what the worker processes of ``--jobs`` inherit: (task, args, methods, runnable, device)


def _run_forked_seed(index: int, seed: int) -> dict[str, dict | str]:
    if _FORKED[1].threads:
        torch.set_num_threads(_FORKED[1].threads)
    return run_seed(*_FORKED, index, seed)


def run_task(name: str, args, methods: dict, device: torch.device, failures: list[str]) -> dict:
    global _FORKED
    task = TASKS[name](args.quick)
    skipped = {}
    if not slimfit_available():
        skipped = {m: "peft_slim has no SlimFitConfig yet" for m, method in methods.items() if method.needs_slimfit}
    runnable = [m for m in methods if m not in skipped]
    # Seed-major: within a seed the methods alternate, so machine noise hits every method alike. With --jobs the
    # seeds run at once in forked processes (each sees the same load); memory is profiled in the first seed's.
    seeds = list(enumerate(args.seeds))
    if args.jobs > 1 and device.type == "cpu":
        _FORKED = (task, args, methods, runnable, device)
        context = multiprocessing.get_context("fork")
        with context.Pool(min(args.jobs, len(seeds))) as pool:
            per_seed = pool.starmap(_run_forked_seed, seeds, chunksize=1)
        _FORKED = ()
    else:
        per_seed = [run_seed(task, args, methods, runnable, device, index, seed) for index, seed in seeds]
    runs: dict[str, list[dict]] = {m: [] for m in runnable}
    for outcome in per_seed:
        for method_name, result in outcome.items():
            if isinstance(result, str):
                skipped.setdefault(method_name, result)
            else:
                runs[method_name].append(result)
    for method_name in [m for m in runnable if m in skipped]:
        failures.append(f"{name}/{method_name}")
        runs.pop(method_name)
    summaries = {m: summarise_method(r) for m, r in runs.items() if r}
    add_timing(
        summaries, measure.time_steps(task, {m: methods[m] for m in summaries}, args.seeds[0], device, args.rounds)
    )
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


def render(tasks: list[dict], setups: list[dict], out: str, stem: str) -> list[str]:
    """Plots, ``<stem>.md`` and ``<stem>.json`` of ``tasks``; ``setups``: the runs they came from. Returns failures."""
    methods = all_methods()
    methods = {
        name: methods[name] for name in methods if any(name in t["methods"] or name in t["skipped"] for t in tasks)
    }
    failures = [f"{t['name']}/{m}" for t in tasks for m, why in t["skipped"].items() if why.startswith("failed")]
    figures = plot(tasks, out, stem)
    mode = "quick" if all(s["mode"] == "quick" for s in setups) else "full"
    markdown = [f"# Benchmark ({mode} mode)", ""]
    for setup in setups:
        command = setup.get("command", "python -m benchmarks.run ...")
        retimed = f" Step times measured again afterwards by {setup['retimed']}." if "retimed" in setup else ""
        if "reprofiled" in setup:
            retimed += f" Memory measured again (last step) by {setup['reprofiled']}."
        markdown.append(f"Measured on: {setup['machine']}. Command: `{command}`.{retimed}")
    markdown.append(
        "Ratios are to LoRA and to full fine-tuning from the same run; metrics are mean ± sd over the seeds."
    )
    for task in tasks:
        markdown += ["", task_markdown(task, methods)]
    markdown += ["", *[f"![{name}]({name})" for name in figures]]
    if failures:
        markdown += ["", f"FAILED: {', '.join(failures)}"]
    report = {"setup": setups[0] if len(setups) == 1 else setups, "tasks": tasks, "figures": figures}
    write_report(out, stem, report, "\n".join(markdown))
    return failures


def merge(args) -> int:
    """One report (tables, JSON, plots) from the tasks of earlier runs' ``<stem>.json`` files, in the given order;
    ``--retime``: their step times measured again by the interleaved pass (on this machine, now)."""
    tasks, setups = [], []
    if args.retime or args.reprofile:
        if args.threads:
            torch.set_num_threads(args.threads)
        torch.set_flush_denormal(True)
        hf_logging.set_verbosity_error()
    for path in args.merge:
        with open(path) as handle:
            report = json.load(handle)
        for setup in report["setup"] if isinstance(report["setup"], list) else [report["setup"]]:
            if args.retime:
                setup["retimed"] = (
                    f"`--merge ... --retime` ({args.rounds} rounds, {torch.get_num_threads()} thread(s))"
                )
            setups.append(setup)
        for task in report["tasks"]:
            if args.reprofile:
                reprofile(task, setups[-1]["mode"] == "quick", args)
                setups[-1]["reprofiled"] = f"`--merge ... --reprofile {' '.join(args.reprofile)}`"
            if args.retime:
                retime(task, setups[-1]["mode"] == "quick", args)
            tasks.append(task)
    return 1 if render(tasks, setups, args.out, args.stem) else 0


def reprofile(task: dict, quick: bool, args) -> None:
    """Memory of ``args.reprofile``'s methods measured again: the first seed's run repeated, profiling its last step.
    Its metrics must come out as before (recorded as ``reprofile_same_metrics``)."""
    device = torch.device(args.device)
    built = TASKS[task["name"]](quick)
    for name in [m for m in args.reprofile if m in task["methods"]]:
        first = task["runs"][name][0]
        again = measure.run(built, all_methods()[name], first["seed"], True, device)
        for key in ("saved_activation_bytes", "memory"):
            first[key] = task["methods"][name][key] = again[key]
        task["methods"][name]["total_bytes"] = again["memory"]["total_bytes"]
        task["methods"][name]["reprofile_same_metrics"] = again["metrics"] == first["metrics"]
    add_ratios(task["methods"])
    task["targets"] = targets(task["methods"], task["metric"], task["higher_is_better"])


def retime(task: dict, quick: bool, args) -> None:
    device = torch.device(args.device)
    methods = {name: method for name, method in all_methods().items() if name in task["methods"]}
    timing = measure.time_steps(TASKS[task["name"]](quick), methods, task["seeds"][0], device, args.rounds)
    add_timing(task["methods"], timing)
    add_ratios(task["methods"])
    task["targets"] = targets(task["methods"], task["metric"], task["higher_is_better"])


def main(argv=None) -> int:
    args = parse_args(argv)
    # The imports' half a million objects live to the end: out of the collector's sight, the collection after each
    # method (measure.py) scans only what the runs made (0.25 s less per method and per timing round on 2 cores).
    gc.freeze()
    if args.merge:
        return merge(args)
    if args.threads:
        torch.set_num_threads(args.threads)  # tiny models: one thread waits on no busy core
    torch.set_flush_denormal(True)  # AdamW's first steps on CPU otherwise crawl through denormal numbers
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    device = torch.device(args.device)
    methods = {name: method for name, method in all_methods().items() if name in args.methods}
    failures: list[str] = []
    tasks = [run_task(name, args, methods, device, failures) for name in args.tasks]
    setup = {
        "mode": "quick" if args.quick else "full",
        "machine": machine(device, args.jobs),
        "seeds": args.seeds,
        "command": " ".join(["python -m benchmarks.run", *(sys.argv[1:] if argv is None else argv)]),
    }
    render(tasks, [setup], args.out, args.stem)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
