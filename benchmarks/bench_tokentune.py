"""TokenTune + LoRA against plain LoRA: saved activation bytes, peak memory, step time, tokens/s.

Both run side by side in one process on the same randomly initialised Llama model with
SmolLM2-135M's shape, the same LoRA modules and the same batch. How each number is measured:

* saved activation bytes: distinct storages autograd saves during the training forward
  (saved-tensor hooks, parameters excluded) -- ``peft_slim.memory.SavedActivationBytes``;
* peak memory: the highest running total of the allocator's events during one full step
  (forward, backward, optimizer), above what was held before it -- ``peft_slim.memory.peak_memory_bytes``;
* step time: median wall time of forward + backward + AdamW step over ``--steps`` steps after a
  warm-up step, the two methods alternating step by step so machine noise hits both alike.

Usage: ``python benchmarks/bench_tokentune.py`` (full: batch 4, sequence 1024, 30 layers) or
``--quick`` for a small smoke run.
"""

from __future__ import annotations

import argparse
import copy
import functools
import os
import platform
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peft_slim  # noqa: E402
from benchmarks.report import markdown_table, mib, write_report  # noqa: E402
from benchmarks.side_by_side import add_ratios, time_alternating  # noqa: E402
from peft_slim.memory import SavedActivationBytes, peak_memory_bytes  # noqa: E402

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# Byte counts reported as ratios to LoRA (also by bench_compression.py).
RATIOS = {"saved_activation_bytes": "saved_activation_ratio", "peak_step_bytes": "peak_ratio"}


def smollm2_135m_shape(layers: int) -> LlamaConfig:
    return LlamaConfig(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
    )


def build_methods(config: LlamaConfig, token_ratio: float) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    tokentune = peft_slim.TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=token_ratio, seed=0, lora=lora)
    return {
        "lora": get_peft_model(copy.deepcopy(base), copy.deepcopy(lora)),
        f"tokentune{token_ratio:g}+lora": get_peft_model(base, tokentune),
    }


def training_step(model, optimizer, batch):
    loss = model(**batch).loss
    loss.backward()
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def measure_side_by_side(methods: dict[str, torch.nn.Module], batch: dict, steps: int) -> dict:
    """Per method: saved activations of one training forward, the peak of one step (after a warm-up step that
    creates the AdamW state), and ``steps`` step times with the methods alternating; ratios to "lora"."""
    optimizers = {
        name: torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
        for name, model in methods.items()
    }
    results = {}
    for name, model in methods.items():
        model.train()
        with SavedActivationBytes(list(model.parameters())) as saved:
            loss = model(**batch).loss
        loss.backward()
        model.zero_grad(set_to_none=True)
        del loss
        training_step(model, optimizers[name], batch)  # warm-up, creates optimizer state
        peak = peak_memory_bytes(lambda m=model, o=optimizers[name]: training_step(m, o, batch))
        results[name] = {"saved_activation_bytes": saved.bytes, "peak_step_bytes": peak, "step_seconds": []}
    timed = {name: functools.partial(training_step, model, optimizers[name], batch) for name, model in methods.items()}
    for name, seconds in time_alternating(timed, steps).items():
        results[name]["step_seconds"] = seconds
    add_ratios(results, "lora", batch["input_ids"].numel(), RATIOS)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--token-ratio", type=float, default=0.2)
    parser.add_argument("--quick", action="store_true", help="batch 2, sequence 256, 4 layers, 2 steps")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.layers, args.steps = 2, 256, 4, 2

    torch.manual_seed(0)
    config = smollm2_135m_shape(args.layers)
    methods = build_methods(config, args.token_ratio)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
    results = measure_side_by_side(methods, batch, args.steps)

    setup = {
        "model": f"Llama, SmolLM2-135M shape, {args.layers} layers, random weights, fp32, sdpa",
        "batch": args.batch,
        "sequence": args.seq,
        "lora": f"r=16 on {','.join(LORA_TARGETS)}",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU threads, torch {torch.__version__}",
        "steps_timed": args.steps,
    }
    report = {"setup": setup, "results": results}
    setup_line = (
        f"Setup: {setup['model']}; batch {args.batch} x sequence {args.seq}; LoRA {setup['lora']}; "
        f"{setup['machine']}; median of {args.steps} steps."
    )
    table = results_table(results)
    write_report(args.out, "tokentune_quick" if args.quick else "tokentune", report, f"{setup_line}\n\n{table}")


def results_table(results: dict, ratio_digits: int = 2) -> str:
    """One row per method: saved activations, peak step memory and step time, each also as a ratio to LoRA."""
    header = ["method", "saved activations", "vs LoRA", "peak step memory", "vs LoRA", "step time", "vs LoRA"]
    rows = [
        [name, mib(r["saved_activation_bytes"]), f"{r['saved_activation_ratio']:.{ratio_digits}f}x"]
        + [mib(r["peak_step_bytes"]), f"{r['peak_ratio']:.2f}x"]
        + [f"{r['median_step_seconds']:.2f} s", f"{r['step_time_ratio']:.2f}x", f"{r['tokens_per_second']:.0f}"]
        for name, r in results.items()
    ]
    return markdown_table(header + ["tokens/s"], rows)


if __name__ == "__main__":
    main()
