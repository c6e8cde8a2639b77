"""How long ``peft-slim plan`` takes on docs/planner.md's example: a Llama-3-8B-like config
(tests/helpers/data/llama3_8b_config.json) with ``--budget 24GB --batch-size 4 --seq-len 4096 --dtype bfloat16``,
and the same with ``--no-checkpointing --min-token-ratio 0.3``; each run as a user runs it, in a fresh process, which
shares the settings with one process it forks, each on one intra-op thread. Wall-clock and CPU seconds (user + system
of both processes) are given with the machine's load average, since other processes on the machine stretch the
wall-clock time.

Run: ``python benchmarks/bench_planner_speed.py`` (writes benchmarks/results/planner_speed.{md,json}).
"""

from __future__ import annotations

import argparse
import os
import platform
import resource
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from benchmarks.report import markdown_table, write_report  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join("tests", "helpers", "data", "llama3_8b_config.json")
EXAMPLE = ["--model", CONFIG, "--budget", "24GB", "--batch-size", "4", "--seq-len", "4096", "--dtype", "bfloat16"]
RUNS = {
    "example": EXAMPLE,
    "no checkpointing, min token ratio 0.3": [*EXAMPLE, "--no-checkpointing", "--min-token-ratio", "0.3"],
}


def timed(argv: list[str]) -> dict:
    """One run of ``peft-slim plan argv`` in a fresh process: seconds, CPU seconds (its forked process's included: a
    process waited for counts in its parent's children), load average, settings listed."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    before, load = resource.getrusage(resource.RUSAGE_CHILDREN), os.getloadavg()[0]
    start = time.perf_counter()
    done = subprocess.run(
        [sys.executable, "-m", "peft_slim", "plan", *argv], cwd=ROOT, env=env, capture_output=True, text=True
    )
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode not in (0, 1):
        raise RuntimeError(done.stderr[-2000:])
    cpu = after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime
    rows = [line for line in done.stdout.splitlines() if " | " in line][1:]
    return {
        "seconds": round(wall, 1),
        "cpu_seconds": round(cpu, 1),
        "load_average": [load, os.getloadavg()[0]],
        "settings_listed": len(rows),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default=os.path.join(ROOT, "benchmarks", "results"))
    args = parser.parse_args()
    machine = f"{platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}"
    report = {"machine": machine, "config": CONFIG, "runs": {}}
    for name, argv in RUNS.items():
        report["runs"][name] = {"argv": ["peft-slim", "plan", *argv], **timed(argv)}
    rows = [
        [
            name,
            f"{run['seconds']:.1f}",
            f"{run['cpu_seconds']:.1f}",
            f"{run['load_average'][0]:.1f}",
            run["settings_listed"],
        ]
        for name, run in report["runs"].items()
    ]
    table = markdown_table(["run", "seconds", "CPU seconds", "load average before", "settings listed"], rows)
    write_report(
        args.out,
        "planner_speed",
        report,
        f"`peft-slim plan` on {CONFIG} ({machine}, two processes of one thread each)\n\n{table}",
    )


if __name__ == "__main__":
    main()
