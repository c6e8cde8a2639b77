"""Activation compression (8/4/2 bits) against uncompressed LoRA: saved activation bytes, peak memory, step time.

Same model, shape, LoRA modules and batch as ``bench_tokentune.py`` (its helpers are imported), all methods
side by side in one process:

* ``lora``: plain LoRA, fp32 activations;
* ``lora+8bit`` / ``lora+4bit`` / ``lora+2bit``: the same LoRA model, its forward run inside
  ``peft_slim.compress_activations(bits=...)`` (every kind of saved tensor, default group size);
* ``tokentune0.2+lora+8bit``: TokenTune + LoRA with ``activation_compression`` in its config.

How each number is measured:

* saved activation bytes: for ``lora``, the distinct storages autograd saves (saved-tensor hooks,
  parameters excluded) -- ``peft_slim.memory.SavedActivationBytes``; with compression, the bytes of the
  storages actually held instead (packed codes, scales, minima, and the tensors left as they are) --
  ``stats.stored_bytes`` of the compression context, whose ``stats.original_bytes`` counts the same
  storages ``SavedActivationBytes`` does (reported too, as a cross-check);
* peak memory: the highest running total of the allocator's events during one full step (forward,
  backward, optimizer) above what was held before it -- ``peft_slim.memory.peak_memory_bytes``;
* step time: median wall time of forward + backward + AdamW step over ``--steps`` steps after a warm-up
  step, the methods alternating step by step so that machine noise hits all alike.

Usage: ``python benchmarks/bench_compression.py`` (full: batch 4, sequence 1024, 30 layers) or ``--quick``;
``--threads 1`` pins PyTorch to one intra-op thread (results in ``compression_1thread.*``): on a shared
machine every parallel op otherwise waits for a busy core, which hits the many mid-sized ops of
compression harder than the large matmuls of the model.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import sys
from contextlib import nullcontext

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peft_slim  # noqa: E402
from benchmarks.bench_tokentune import LORA_TARGETS, RATIOS, results_table, smollm2_135m_shape  # noqa: E402
from benchmarks.report import write_report  # noqa: E402
from benchmarks.side_by_side import add_ratios, time_alternating  # noqa: E402
from peft_slim.memory import SavedActivationBytes, peak_memory_bytes  # noqa: E402

TARGETS = {"lora+8bit": ("saved", 0.3), "lora+4bit": ("saved", 0.17)}
STEP_TIME_TARGET = ("lora+8bit", 1.25)


def build_methods(layers: int, token_ratio: float, group_size: int):
    """name -> (model, the compression config wrapped around its forward or None)."""
    torch.manual_seed(0)
    base = LlamaForCausalLM(smollm2_135m_shape(layers))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    compression = peft_slim.ActivationCompressionConfig(bits=8, group_size=group_size)
    tokentune = peft_slim.TokenTuneConfig(
        task_type="CAUSAL_LM", token_ratio=token_ratio, seed=0, lora=lora, activation_compression=compression
    )
    lora_model = get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))
    methods = {"lora": (lora_model, None)}
    for bits in (8, 4, 2):
        methods[f"lora+{bits}bit"] = (
            lora_model,
            peft_slim.ActivationCompressionConfig(bits=bits, group_size=group_size),
        )
    methods[f"tokentune{token_ratio:g}+lora+8bit"] = (get_peft_model(base, tokentune), None)
    return methods


def forward(model, compression, batch):
    """The loss, and the compression stats of this forward (None when nothing was compressed)."""
    context = peft_slim.compress_activations(compression) if compression is not None else nullcontext()
    with context:
        loss = model(**batch).loss
    stats = getattr(model.base_model, "last_compression_stats", None)
    return loss, (context.stats if compression is not None else stats)


def training_step(model, compression, optimizer, batch):
    loss, _ = forward(model, compression, batch)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--token-ratio", type=float, default=0.2)
    parser.add_argument("--group-size", type=int, default=128)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="batch 2, sequence 256, 4 layers, 2 steps")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.layers, args.steps = 2, 256, 4, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    methods = build_methods(args.layers, args.token_ratio, args.group_size)
    vocab = methods["lora"][0].config.vocab_size
    input_ids = torch.randint(0, vocab, (args.batch, args.seq))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
    optimizers = {}
    for model, _ in methods.values():
        if id(model) not in optimizers:
            optimizers[id(model)] = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)

    results = {}
    for name, (model, compression) in methods.items():
        model.train()
        optimizer = optimizers[id(model)]
        with SavedActivationBytes(model.parameters()) as outer:  # sees nothing when compression is innermost
            loss, stats = forward(model, compression, batch)
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
        result = {"saved_activation_bytes": outer.bytes if stats is None else stats.stored_bytes}
        if stats is not None:
            result.update(original_bytes=stats.original_bytes, compressed_tensors=stats.compressed, kept=stats.kept)
        training_step(model, compression, optimizer, batch)  # warm-up, creates optimizer state
        step = lambda m=model, c=compression, o=optimizer: training_step(m, c, o, batch)  # noqa: E731
        result["peak_step_bytes"] = peak_memory_bytes(step)
        result["step_seconds"] = []
        results[name] = result
        print(name, {k: v for k, v in result.items() if k != "step_seconds"}, flush=True)

    steps = {
        name: functools.partial(training_step, model, compression, optimizers[id(model)], batch)
        for name, (model, compression) in methods.items()
    }
    for name, seconds in time_alternating(steps, args.steps, log=True).items():
        results[name]["step_seconds"] = seconds

    report = summarise(results, args)
    write(report, args)


def summarise(results: dict, args) -> dict:
    add_ratios(results, "lora", args.batch * args.seq, RATIOS)
    targets = {}
    for name, (_, bound) in TARGETS.items():
        targets[f"{name} saved bytes <= {bound}x"] = results[name]["saved_activation_ratio"] <= bound
    name, bound = STEP_TIME_TARGET
    targets[f"{name} step time <= {bound}x"] = results[name]["step_time_ratio"] <= bound
    setup = {
        "model": f"Llama, SmolLM2-135M shape, {args.layers} layers, random weights, fp32, sdpa",
        "batch": args.batch,
        "sequence": args.seq,
        "lora": f"r=16 on {','.join(LORA_TARGETS)}",
        "compression": f"all kinds, group size {args.group_size}, default min_numel",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU threads ({torch.get_num_threads()} used), "
        f"torch {torch.__version__}",
        "steps_timed": args.steps,
    }
    return {"setup": setup, "results": results, "targets": targets}


def write(report: dict, args) -> None:
    setup, results = report["setup"], report["results"]
    stem = "compression_quick" if args.quick else "compression"
    if args.threads is not None:
        stem += f"_{args.threads}thread"
    lines = [
        f"Setup: {setup['model']}; batch {args.batch} x sequence {args.seq}; LoRA {setup['lora']}; "
        f"compression: {setup['compression']}; {setup['machine']}; median of {args.steps} steps.",
        "",
        results_table(results, ratio_digits=3),
        "",
        "Targets (issue 3): " + "; ".join(f"{k}: {'met' if v else 'MISSED'}" for k, v in report["targets"].items()),
    ]
    write_report(args.out, stem, report, "\n".join(lines))


if __name__ == "__main__":
    main()
