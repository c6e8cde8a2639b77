"""Supervised fine-tuning of a real chat model: SmolLM2-135M-Instruct on the embedded chatterbot-corpus QA set.

Completion-only loss (the prompt and chat markup labelled -100), every method built by the same code as
``peft-slim train`` (its flags, ``wrap`` below), trained by one small AdamW loop, 3 seeds. Measured
per run, on this machine and in this process (nothing estimated):

* held-out answer perplexity, exp(mean NLL over the answer tokens of the held-out split), and token accuracy
  (argmax = the answer token), both on every 5th example of the data set, never trained on;
* saved activations: bytes autograd saves in one training forward on the first batch, parameters excluded
  (``peft_slim.memory.SavedActivationBytes``; what the compression stores where a method compresses); with
  checkpointing, a checkpointed layer's input (held by the checkpoint) is not counted;
* peak memory of the last training step (forward, backward, AdamW step) above what was held before it
  (``peft_slim.memory.peak_memory_bytes``);
* step time: the median process CPU time of a step (one intra-op thread), the first step excluded.

Memory and time are reported as ratios to LoRA in the same run. LoRA and LoRA + checkpointing compute the same
numbers, so checkpointing runs one seed. ``python -m benchmarks.bench_sft`` (about an hour of one CPU core) or
``--quick`` (2 methods, 1 seed, 3 steps: a smoke test into benchmarks/results/quick).
"""

from __future__ import annotations

import argparse
import copy
import functools
import json
import math
import os
import platform
import random
import re
import statistics
import sys
import time
import types
from contextlib import nullcontext

import torch
from torch.nn.utils.rnn import pad_sequence
from transformers.modeling_outputs import CausalLMOutput

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from benchmarks.report import markdown_table, write_report  # noqa: E402
from peft_slim.cli import models, sft_data  # noqa: E402
from peft_slim.cli import train as cli  # noqa: E402
from peft_slim.compression import compress_activations  # noqa: E402
from peft_slim.memory import SavedActivationBytes, peak_memory_bytes  # noqa: E402
from peft_slim.recipe import LABEL_FIRST, Recipe  # noqa: E402
from peft_slim.slimfit import find_slimfit  # noqa: E402
from peft_slim.token_selection.selection import IGNORE_INDEX  # noqa: E402
from peft_slim.tuner.transform import find_transform  # noqa: E402

RESULTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "results")
HELD_OUT_EVERY = 5
LORA = ["--lora-r", "8", "--lora-target-modules", "all-linear"]
SELECT = LABEL_FIRST
# name -> (peft-slim train flags, seeds it needs: "all" or 1)
METHODS: dict[str, tuple[list[str], str | int]] = {
    "lora": (["--method", "lora", *LORA], "all"),
    "lora+ckpt": (["--method", "lora", *LORA, "--gradient-checkpointing"], 1),
    "tokentune-0.2-random": (["--token-ratio", "0.2", "--selection", "random", *LORA], "all"),
    f"tokentune-0.2-{SELECT}": (["--token-ratio", "0.2", "--selection", SELECT, *LORA], "all"),
    "tokentune-0.3-random": (["--token-ratio", "0.3", "--selection", "random", *LORA], "all"),
    f"tokentune-0.3-{SELECT}": (["--token-ratio", "0.3", "--selection", SELECT, *LORA], "all"),
    "slimfit-0.9+lora": (["--method", "slimfit", "--freeze-ratio", "0.9", "--compression-bits", "none", *LORA], "all"),
    # Base weights trained (no LoRA; --base-learning-rate): full fine-tuning and SlimFit on the model's own weights,
    # with SlimFit's default activation compression (issue 17's rows).
    "full": (["--method", "full"], "all"),
    **{
        f"slimfit-{r:g}": (["--method", "slimfit", "--freeze-ratio", str(r), "--lora-r", "0"], "all")
        for r in (0.8, 0.9, 0.95)
    },
    **{  # without catch-up: the paper's update
        f"slimfit-{r:g}-none": (
            ["--method", "slimfit", "--freeze-ratio", str(r), "--lora-r", "0", "--catch-up", "none"],
            "all",
        )
        for r in (0.8, 0.9, 0.95)
    },
    f"stack: slimfit-0.9+tokentune-0.2-{SELECT}+lora+comp": (
        ["--method", "slimfit", "--freeze-ratio", "0.9", "--token-ratio", "0.2", "--selection", SELECT, *LORA],
        "all",
    ),
}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 methods, 1 seed, 3 steps, 16 held-out examples")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0, 1, 2])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--learning-rate", type=float, default=1e-3, help="of the methods that train adapters")
    parser.add_argument(
        "--base-learning-rate", type=float, default=1e-4, help="of the methods that train the base weights"
    )
    parser.add_argument("--max-length", type=int, default=96)
    parser.add_argument("--held-out", type=int, default=48, help="held-out examples evaluated (every 5th, in order)")
    parser.add_argument("--methods", nargs="+", choices=list(METHODS), default=list(METHODS))
    parser.add_argument("--out", default=None, help="default benchmarks/results (quick: benchmarks/results/quick)")
    parser.add_argument("--plot-only", action="store_true", help="no training: table and plot from <out>/sft.json")
    parser.add_argument("--part", help="write only <out>/sft.part-<PART>.json (run method groups in parallel)")
    parser.add_argument("--merge", nargs="+", metavar="JSON", help="no training: one report from these parts")
    args = parser.parse_args(argv)
    if args.quick:
        args.seeds, args.steps, args.held_out = [0], 3, 16
        args.methods = ["lora", f"tokentune-0.2-{SELECT}"]
    args.out = args.out or (os.path.join(RESULTS, "quick") if args.quick else RESULTS)
    return args


def trains_base_weights(flags: list[str]) -> bool:
    """Full fine-tuning, or SlimFit with ``--lora-r 0`` (its units are then the model's own weights)."""
    return not Recipe.from_train_args(cli.parse_flags(flags)).uses_lora


def method_args(flags: list[str], args: argparse.Namespace, seed: int) -> argparse.Namespace:
    """The flags parsed and checked exactly as ``peft-slim train`` does."""
    rate = args.base_learning_rate if trains_base_weights(flags) else args.learning_rate
    extra = ["--seed", str(seed), "--learning-rate", str(rate), "--max-steps", str(args.steps)]
    return cli.parse_flags(flags + extra)


def wrap(model, parsed: argparse.Namespace):
    """The model ready to train the parsed flags' recipe, and the context every training forward runs in
    (compression for 'lora' and 'full', which train compressed only inside ``compress_activations``)."""
    recipe = Recipe.from_train_args(parsed)
    model, _ = recipe.apply(model, seed=parsed.seed)  # --lora-r 0: the plain model, transformed
    compression = recipe.activation_compression() if parsed.method in ("lora", "full") else None
    return model, (lambda: compress_activations(compression)) if compression is not None else nullcontext


def tokenize(rows: list[dict], tokenizer, max_length: int) -> list[dict]:
    """``input_ids`` and ``labels`` (the assistant turns) of chat rows, as ``peft-slim train`` labels them, cut to
    ``max_length``; rows keeping no scored label are dropped, as the command drops them."""
    columns = sft_data.find_columns(rows)
    if columns.format == "prompt-completion":  # rendered as one user and one assistant turn, as the command does
        rows = [
            {
                "messages": [
                    {"role": "user", "content": r[columns.prompt]},
                    {"role": "assistant", "content": r[columns.completion]},
                ]
            }
            for r in rows
        ]
        columns = sft_data.find_columns(rows)
    dataset = sft_data.to_dataset(rows, columns, tokenizer)
    if "completion_mask" not in dataset.column_names:
        raise ValueError("the benchmarks' data sets are chat or prompt/completion rows, for a chat template")
    examples = []
    for row in dataset:
        ids, mask = row["input_ids"][:max_length], row["completion_mask"][:max_length]
        labels = [token if labelled else IGNORE_INDEX for token, labelled in zip(ids, mask)]
        if any(label != IGNORE_INDEX for label in labels[1:]):  # position 0's label is never scored
            examples.append({"input_ids": ids, "labels": labels})
    return examples


def collate(examples: list[dict], pad_token_id: int) -> dict:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding) of a batch."""
    ids = [torch.tensor(example["input_ids"]) for example in examples]
    labels = [torch.tensor(example["labels"]) for example in examples]
    return {
        "input_ids": pad_sequence(ids, batch_first=True, padding_value=pad_token_id),
        "attention_mask": pad_sequence([torch.ones_like(i) for i in ids], batch_first=True, padding_value=0),
        "labels": pad_sequence(labels, batch_first=True, padding_value=IGNORE_INDEX),
    }


def split(examples: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [e for i, e in enumerate(examples) if i % HELD_OUT_EVERY]
    held_out = [e for i, e in enumerate(examples) if not i % HELD_OUT_EVERY]
    return train, held_out


@torch.no_grad()
def evaluate(model, held_out: list[dict], pad_id: int, batch_size: int = 16) -> dict:
    """Answer perplexity and next-token accuracy over the labelled positions of ``held_out``."""
    model.eval()
    nll, correct, count = 0.0, 0, 0
    for start in range(0, len(held_out), batch_size):
        batch = collate(held_out[start : start + batch_size], pad_id)
        # The head runs only at the positions some row of the batch scores (position t predicts label t + 1).
        scored = (batch["labels"][:, 1:] != IGNORE_INDEX).any(dim=0).nonzero().flatten()
        inputs = {"input_ids": batch["input_ids"], "attention_mask": batch["attention_mask"]}
        logits = model(**inputs, logits_to_keep=scored).logits.float()
        labels = batch["labels"][:, 1:][:, scored]
        mask = labels != IGNORE_INDEX
        nll += torch.nn.functional.cross_entropy(logits[mask], labels[mask], reduction="sum").item()
        correct += (logits[mask].argmax(-1) == labels[mask]).sum().item()
        count += mask.sum().item()
    model.train()
    return {"answer_perplexity": math.exp(nll / count), "token_accuracy": correct / count, "answer_tokens": count}


def train_step(model, optimizer, batch, context, after_step) -> float:
    with context():
        loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    after_step()
    optimizer.zero_grad(set_to_none=True)
    return loss.item()


def record(losses: list[float], step) -> None:
    losses.append(step())


def saved_activation_bytes(model, batch: dict, context) -> int:
    """Bytes autograd saves for backward in one training forward, parameters excluded (what a method's own
    activation compression stores, where it compresses)."""
    model.train()
    with context() as compression:
        if compression is not None:  # compress_activations around the forward: its own count
            loss = model(**batch).loss
            del loss
            return compression.stats.stored_bytes
        with SavedActivationBytes(model.parameters()) as saved:
            loss = model(**batch).loss
    del loss
    method = find_transform(model)  # full fine-tuning's transform (--lora-r 0), else the PEFT tuner
    stats = getattr(getattr(model, "base_model", None) if method is None else method, "last_compression_stats", None)
    return saved.bytes if stats is None else stats.stored_bytes


def add_labelled_head(model) -> None:
    """A training forward given ``labels`` runs the LM head and the loss only at the positions a label scores, as a
    careful user writes it: the body's output, ``keep = labels[:, 1:] != -100``, ``lm_head(h[:, :-1][keep])``,
    cross-entropy in fp32. The same loss as the model's own (its mean over labelled positions), without the
    full-vocabulary logits of every position. Without ``labels`` the forward is the model's own."""
    original = model.forward

    def forward(self, *args, labels=None, **kwargs):
        if labels is None:
            return original(*args, **kwargs)
        body = getattr(self, self.base_model_prefix)
        hidden = body(*args, **(kwargs | {"use_cache": False})).last_hidden_state[:, :-1]
        labels = labels[:, 1:]
        keep = labels != IGNORE_INDEX
        logits = self.get_output_embeddings()(hidden[keep])
        return CausalLMOutput(loss=torch.nn.functional.cross_entropy(logits.float(), labels[keep]))

    model.forward = types.MethodType(forward, model)


def build_method(base, parsed: argparse.Namespace, seed: int, trl_head: bool = False, labelled_head: bool = False):
    """A copy of ``base`` wrapped as ``parsed`` (the method's `peft-slim train` flags) asks, in training mode, with
    its AdamW and what to call after each optimizer step. Returns (model, context, optimizer, after_step).

    ``trl_head``: the copy gets TRL's fused LM head first (``add_fused_lm_head``, what SFTTrainer's default loss
    uses): a forward given ``fused_lm_head=True`` runs the head in tiles of the vocabulary (at labelled positions
    only on a GPU with Triton; on a CPU at every position). ``labelled_head``: ``add_labelled_head``."""
    torch.manual_seed(seed)
    model = copy.deepcopy(base)
    if trl_head:
        from trl.trainer.utils import add_fused_lm_head

        add_fused_lm_head(model)
    if labelled_head:
        add_labelled_head(model)
    if parsed.gradient_checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model, context = wrap(model, parsed)
    model.train()
    slimfit = parsed.method == "slimfit"
    # SlimFit decides per step which parameters get gradients: AdamW holds them all and skips those without one.
    params = list(model.parameters()) if slimfit else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=parsed.learning_rate, weight_decay=0.0)
    schedule = find_slimfit(model) if slimfit else None  # the tuner, or the transform with --lora-r 0
    if schedule is not None:
        schedule.slimfit_attach(optimizer)
    after_step = (lambda: schedule.slimfit_step(optimizer)) if slimfit else (lambda: None)
    return model, context, optimizer, after_step


def run_one(name: str, base, train, held_out, pad_id: int, args: argparse.Namespace, seed: int) -> dict:
    flags, _ = METHODS[name]
    parsed = method_args(flags, args, seed)
    model, context, optimizer, after_step = build_method(base, parsed, seed)
    order = random.Random(seed).sample(range(len(train)), len(train))
    batches = [
        collate([train[order[(s * args.batch_size + i) % len(train)]] for i in range(args.batch_size)], pad_id)
        for s in range(args.steps)
    ]
    saved = saved_activation_bytes(model, batches[0], context)
    losses, cpu_seconds, peak = [], [], None
    for index, batch in enumerate(batches):
        if index == len(batches) - 1:
            step = functools.partial(train_step, model, optimizer, batch, context, after_step)
            peak = peak_memory_bytes(functools.partial(record, losses, step))
            continue
        start = time.process_time()
        losses.append(train_step(model, optimizer, batch, context, after_step))
        if index > 0:
            cpu_seconds.append(time.process_time() - start)
        print(f"  {name} seed {seed} step {index + 1}/{args.steps} loss {losses[-1]:.3f}", file=sys.stderr, flush=True)
    result = {
        "seed": seed,
        "losses": losses,
        "saved_activation_bytes": saved,
        "step_peak_bytes": peak,
        "step_cpu_seconds": statistics.median(cpu_seconds) if cpu_seconds else float("nan"),
        **evaluate(model, held_out, pad_id),
    }
    return result


def summarise(report: dict) -> tuple[list[list], dict]:
    """Table rows (mean ± std over seeds; ratios to LoRA's mean) and the per-method summary."""
    runs, summary = report["runs"], {}
    lora = runs["lora"]

    def mean(values):
        return statistics.mean(values)

    base = {k: mean([r[k] for r in lora]) for k in ("saved_activation_bytes", "step_peak_bytes", "step_cpu_seconds")}
    rows = []
    untrained = report["untrained"]
    rows.append(
        ["(untrained)", f"{untrained['answer_perplexity']:.2f}", f"{untrained['token_accuracy']:.3f}", "", "", "", 0]
    )
    for name, results in runs.items():
        ppl = [r["answer_perplexity"] for r in results]
        acc = [r["token_accuracy"] for r in results]
        ratios = {k: mean([r[k] for r in results]) / base[k] for k in base}
        summary[name] = {"answer_perplexity": ppl, "token_accuracy": acc, "ratios_to_lora": ratios}

        def spread(values, digits):
            return f"{mean(values):.{digits}f}" + (
                f" ± {statistics.stdev(values):.{digits}f}" if len(values) > 1 else ""
            )

        rows.append(
            [
                name,
                spread(ppl, 2),
                spread(acc, 3),
                f"{ratios['saved_activation_bytes']:.2f}",
                f"{ratios['step_peak_bytes']:.2f}",
                f"{ratios['step_cpu_seconds']:.2f}",
                len(results),
            ]
        )
    return rows, summary


def plot(report: dict, summary: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, (left, right) = plt.subplots(1, 2, figsize=(13, 4.8))
    for name, entry in summary.items():
        x = entry["ratios_to_lora"]["saved_activation_bytes"]
        ppl = entry["answer_perplexity"]
        error = statistics.stdev(ppl) if len(ppl) > 1 else 0.0
        left.errorbar(x, statistics.mean(ppl), yerr=error, fmt="o", capsize=3, label=name)
    left.axhline(report["untrained"]["answer_perplexity"], color="grey", linestyle="--", label="untrained")
    left.set_xlabel("saved activations / LoRA's (one batch)")
    left.set_ylabel("held-out answer perplexity (lower is better)")
    left.legend(fontsize="x-small")
    names = list(summary)
    right.barh(names, [summary[n]["ratios_to_lora"]["step_cpu_seconds"] for n in names], color="#4c72b0")
    right.axvline(1.0, color="grey", linestyle="--")
    right.invert_yaxis()
    right.set_xlabel("step CPU time / LoRA's")
    figure.suptitle(report["setup"]["title"], fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def markdown(report: dict) -> str:
    """The results table of a report (``sft.json``), as ``sft.md`` holds it; docs/benchmarks.md is built from it."""
    rows, _ = summarise(report)
    header = [
        "method",
        "answer ppl",
        "token acc",
        "saved act. / LoRA",
        "step peak / LoRA",
        "step time / LoRA",
        "seeds",
    ]
    return "\n\n".join(
        [
            f"### {report['setup']['title']}",
            markdown_table(header, rows),
            f"Machine: {report['setup']['machine']}. {report['setup']['protocol']}",
        ]
    )


def write(report: dict, out: str) -> None:
    _, summary = summarise(report)
    report["summary"] = summary
    write_report(out, "sft", report, markdown(report))
    plot(report, summary, os.path.join(out, "sft.png"))


def main(argv=None) -> None:
    args = parse_args(argv)
    if args.plot_only:
        with open(os.path.join(args.out, "sft.json")) as handle:
            write(json.load(handle), args.out)
        return
    if args.merge:
        parts = []
        for path in args.merge:
            with open(path) as handle:
                parts.append(json.load(handle))

        # Parts may split methods or seeds: same protocol apart from the seeds, runs of a method concatenated.
        def protocol(part: dict) -> str:
            return re.sub(r", seeds \[[^]]*\]", "", part["setup"]["protocol"])

        report = parts[0]
        for part in parts[1:]:
            assert protocol(part) == protocol(report), "parts of different settings"
            for name, runs in part["runs"].items():
                have = {run["seed"]: run for run in report["runs"].setdefault(name, [])}
                for run in runs:  # a run in two parts (a reference re-run beside new methods) must agree
                    # (to 1e-4: other package versions round differently; seen 7e-7)
                    if run["seed"] in have:
                        same = math.isclose(
                            have[run["seed"]]["answer_perplexity"], run["answer_perplexity"], rel_tol=1e-4
                        )
                        assert same, f"{name} seed {run['seed']} differs between parts"
                    else:
                        report["runs"][name].append(run)
        seeds = sorted({run["seed"] for runs in report["runs"].values() for run in runs})
        report["setup"]["protocol"] = protocol(report).replace("; mean ± std", f", seeds {seeds}; mean ± std")
        report["runs"] = {name: report["runs"][name] for name in METHODS if name in report["runs"]}
        write(report, args.out)
        return
    torch.set_num_threads(1)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    path, gguf_file, model_name = models.resolve_model(None, None)
    base, tokenizer = models.load_model(path, gguf_file)
    rows = sft_data.read_rows(None, "train")
    examples = tokenize(rows, tokenizer, args.max_length)
    train, held_out = split(examples)
    held_out = held_out[: args.held_out]
    pad_id = tokenizer.pad_token_id
    report = {
        "setup": {
            "title": f"SFT: {model_name.split(' ')[0]} on chatterbot-corpus QA ({len(train)} train / "
            f"{len(held_out)} held-out), completion-only",
            "machine": f"{platform.machine()} CPU, torch {torch.__version__}, 1 intra-op thread",
            "protocol": f"{args.steps} AdamW steps (lr {args.learning_rate}; base weights {args.base_learning_rate}; "
            f"no decay), batch {args.batch_size}, "
            f"max length {args.max_length}, LoRA r=8 alpha 16 on all linear layers, seeds {args.seeds}; "
            "mean ± std over seeds; ratios against LoRA's mean in the same run.",
            "held_out_every": HELD_OUT_EVERY,
        },
        "untrained": evaluate(base, held_out, pad_id),
        "runs": {},
    }
    # Seed-major: every method has a first seed before any has a second (a part stopped early still covers all).
    for seed in args.seeds:
        for name in args.methods:
            if METHODS[name][1] != "all" and seed != args.seeds[0]:
                continue
            result = run_one(name, base, train, held_out, pad_id, args, seed)
            report["runs"].setdefault(name, []).append(result)
            os.makedirs(args.out, exist_ok=True)
            stem = f"sft.part-{args.part}" if args.part else "sft.partial"
            with open(os.path.join(args.out, f"{stem}.json"), "w") as handle:
                json.dump(report, handle)
    if not args.part:
        write(report, args.out)


if __name__ == "__main__":
    main()
