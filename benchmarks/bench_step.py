"""One training step of each method on each equal-budget task: its peak memory, its time, what it keeps for backward.

The settings and data of ``benchmarks.bench_budget`` (SmolLM2-135M-Instruct, LoRA r=8 on every linear layer,
completion-only loss; the tasks' lengths and batch size), measured on a few batches per task and method, methods
interleaved step by step in one process with one intra-op thread:

* step peak: memory of one training step (forward, backward, AdamW) above what was held before it
  (``peft_slim.memory.peak_memory_bytes``), on the same batch for every method;
* saved for backward: bytes autograd keeps after the forward (``peft_slim.memory.SavedActivationBytes``);
* step time: the median process CPU time of ``--steps`` steps (the first, a warm-up, excluded).

Rows: the baseline a TRL user has (LoRA + checkpointing with the LM head only at labelled positions, TRL's fused
LM head), LoRA + checkpointing, TokenTune's defaults and ``--token-ratio 0.5``, and TokenTune's previous step
(the selected tokens run with grad in the forward; forced here by a random draw that changes nothing in every
block, which is what a block with dropout takes), with and without checkpointing.

``python -m benchmarks.bench_step`` writes ``benchmarks/results/step/step.json`` and ``step.md``.
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_budget, bench_sft  # noqa: E402
from benchmarks.report import markdown_table, write_report  # noqa: E402

LORA = bench_sft.LORA
CKPT = ["--gradient-checkpointing"]
BASELINE = "lora+ckpt+trl-head"
LABELLED = "lora+ckpt+labelled-head"
# The methods a user has without this package: the step time ratios are also given against the fastest of them.
BASELINES = (BASELINE, "lora+ckpt", LABELLED)
# name -> (`peft-slim train` flags, the LM head: the model's own, "trl" or "labelled", the previous TokenTune step)
METHODS: dict[str, tuple[list[str], str, bool]] = {
    BASELINE: (["--method", "lora", *LORA, *CKPT], "trl", False),
    "lora+ckpt": (["--method", "lora", *LORA, *CKPT], "model", False),
    LABELLED: (["--method", "lora", *LORA, *CKPT], "labelled", False),
    "tokentune (defaults)": (["--method", "tokentune", *LORA], "model", False),
    "tokentune-0.5": (["--method", "tokentune", "--token-ratio", "0.5", *LORA], "model", False),
    "tokentune (defaults), previous step": (["--method", "tokentune", *LORA], "model", True),
    "tokentune (defaults), previous step + ckpt": (["--method", "tokentune", *LORA, *CKPT], "model", True),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=bench_budget.TASKS, default=list(bench_budget.TASKS))
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--steps", type=int, default=4, help="timed steps per method and task (+1 warm-up)")
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--out", default=os.path.join(bench_sft.RESULTS, "step"))
    parser.add_argument("--report", action="store_true", help="no measuring: <out>/step.md from <out>/step.json")
    return parser.parse_args(argv)


def draw_in_every_block(model) -> list:
    """Forward hooks that draw a random number in every block and change nothing: TokenTune then takes the step of a
    block with dropout (its previous step)."""
    import torch

    from peft_slim.token_selection.blocks import find_blocks

    def draw(module, args) -> None:
        torch.rand(1)

    _, blocks = find_blocks(model.get_base_model())  # inside the block's forward, where TokenTune looks for draws
    return [next(block.children()).register_forward_pre_hook(draw) for block in blocks]


def measure_task(task: str, base, tokenizer, args) -> list[dict]:
    from peft_slim.memory import SavedActivationBytes, peak_memory_bytes

    budget_args = bench_budget.parse_args(["--tasks", task, "--batch-size", str(args.batch_size)])
    train, _, description = bench_budget.task_data(task, tokenizer, budget_args)
    stream = bench_budget.batches_for(train, 0, args.batch_size, tokenizer.pad_token_id)
    batches = [next(stream) for _ in range(args.steps + 1)]
    runs = {}
    for name in args.methods:
        flags, head, previous = METHODS[name]
        parsed = bench_sft.method_args(
            flags, argparse.Namespace(steps=100, learning_rate=1e-3, base_learning_rate=1e-4), 0
        )
        model, context, optimizer, after_step = bench_sft.build_method(
            base, parsed, 0, trl_head=head == "trl", labelled_head=head == "labelled"
        )
        if previous:
            draw_in_every_block(model)
        runs[name] = (model, context, optimizer, after_step, {"fused_lm_head": True} if head == "trl" else {})
    seconds = {name: [] for name in runs}
    for index, batch in enumerate(batches):  # methods interleaved, step by step
        for name, (model, context, optimizer, after_step, extra) in runs.items():
            start = time.process_time()
            bench_sft.train_step(model, optimizer, batch | extra, context, after_step)
            if index:
                seconds[name].append(time.process_time() - start)
    rows = []
    for name, (model, context, optimizer, after_step, extra) in runs.items():
        batch = batches[0] | extra
        with context(), SavedActivationBytes(model.parameters()) as saved:
            loss = model(**batch).loss
        del loss
        optimizer.zero_grad(set_to_none=True)
        step = functools.partial(bench_sft.train_step, model, optimizer, batch, context, after_step)
        peak = peak_memory_bytes(step)
        rows.append(
            {
                "task": task,
                "task_description": description,
                "method": name,
                "flags": METHODS[name][0],
                "step_peak_bytes": peak,
                "saved_bytes": saved.bytes,
                "step_cpu_seconds": seconds[name],
                "batch_shape": list(batches[0]["input_ids"].shape),
            }
        )
        print(
            f"  {task} {name}: peak {peak / 2**20:.1f} MiB, step {statistics.median(seconds[name]):.2f} s",
            file=sys.stderr,
        )
    return rows


def markdown(report: dict) -> str:
    lines = []
    for task in report["tasks"]:
        rows = [r for r in report["rows"] if r["task"] == task]
        base = next(r for r in rows if r["method"] == BASELINE)
        base_time = statistics.median(base["step_cpu_seconds"])
        fastest = min((r for r in rows if r["method"] in BASELINES), key=lambda r: statistics.median(r["step_cpu_seconds"]))
        fastest_time = statistics.median(fastest["step_cpu_seconds"])
        table = []
        for r in rows:
            peak, time_ = r["step_peak_bytes"], statistics.median(r["step_cpu_seconds"])
            table.append(
                [
                    r["method"],
                    f"{peak / 2**20:.1f} MiB ({peak / base['step_peak_bytes']:.2f}x)",
                    f"{r['saved_bytes'] / 2**20:.1f} MiB",
                    f"{time_:.2f} s ({time_ / base_time:.2f}x)",
                    f"{time_ / fastest_time:.2f}x",
                ]
            )
        lines += [f"*{rows[0]['task_description']}*, batch {rows[0]['batch_shape']}", ""]
        lines += [
            markdown_table(
                [
                    "method",
                    "step peak (/ baseline)",
                    "saved for backward",
                    "step time (/ baseline)",
                    f"/ fastest baseline ({fastest['method']})",
                ],
                table,
            ),
            "",
        ]
    return "\n".join(lines)


def main(argv=None) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from peft_slim.cli import models

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    args = parse_args(argv)
    if args.report:
        with open(os.path.join(args.out, "step.json")) as handle:
            report = json.load(handle)
        write_report(args.out, "step", report, markdown(report))
        return report
    path, gguf_file, model_name = models.resolve_model(None, None)
    base, tokenizer = models.load_model(path, gguf_file)
    rows = [row for task in args.tasks for row in measure_task(task, base, tokenizer, args)]
    report = {
        "model": model_name,
        "tasks": args.tasks,
        "steps": args.steps,
        "rows": rows,
        "environment": bench_budget.environment(),
        "command": " ".join(["python", "-m", "benchmarks.bench_step", *(sys.argv[1:] if argv is None else argv)]),
    }
    os.makedirs(args.out, exist_ok=True)
    write_report(args.out, "step", report, markdown(report))
    return report


if __name__ == "__main__":
    main()
