"""TokenTune's chunked LM-head loss against materialised logits (``chunked_loss=False``) and plain LoRA, on CPU.

The same model as ``bench_tokentune.py`` (SmolLM2-135M's shape, vocabulary 49,152, random weights, fp32; fewer
layers by default, so that the head's share shows), LoRA r=16 on every linear layer of the blocks, TokenTune
``token_ratio=0.2``; the three side by side in one process, measured as ``bench_tokentune.py`` measures
(``SavedActivationBytes``, ``peak_memory_bytes``, median step time with the methods alternating).

Usage: ``python benchmarks/bench_head_loss.py`` (batch 4 x 1024, 4 layers) or ``--quick`` (batch 2 x 256, 2 layers).
"""

from __future__ import annotations

import argparse
import copy
import os
import platform
import sys

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import peft_slim  # noqa: E402
from benchmarks.bench_tokentune import (  # noqa: E402
    LORA_TARGETS,
    measure_side_by_side,
    results_table,
    smollm2_135m_shape,
)
from benchmarks.report import write_report  # noqa: E402


def build_methods(layers: int, token_ratio: float) -> dict[str, torch.nn.Module]:
    torch.manual_seed(0)
    base = LlamaForCausalLM(smollm2_135m_shape(layers))
    lora = LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, task_type="CAUSAL_LM")
    methods = {"lora": get_peft_model(copy.deepcopy(base), copy.deepcopy(lora))}
    for chunked, label in ((False, " (materialised logits)"), (True, " (chunked loss, default)")):
        config = peft_slim.TokenTuneConfig(
            task_type="CAUSAL_LM", token_ratio=token_ratio, seed=0, lora=copy.deepcopy(lora), chunked_loss=chunked
        )
        methods[f"tokentune{token_ratio:g}+lora{label}"] = get_peft_model(copy.deepcopy(base), config)
    return methods


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--token-ratio", type=float, default=0.2)
    parser.add_argument("--threads", type=int, default=None, help="torch intra-op threads (default: torch's)")
    parser.add_argument("--quick", action="store_true", help="batch 2, sequence 256, 2 layers, 2 steps")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    if args.quick:
        args.batch, args.seq, args.layers, args.steps = 2, 256, 2, 2
    if args.threads is not None:
        torch.set_num_threads(args.threads)

    methods = build_methods(args.layers, args.token_ratio)
    vocab = methods["lora"].config.vocab_size
    torch.manual_seed(0)
    input_ids = torch.randint(0, vocab, (args.batch, args.seq))
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
    results = measure_side_by_side(methods, batch, args.steps)

    threads = torch.get_num_threads()
    setup = {
        "model": f"Llama, SmolLM2-135M shape, {args.layers} layers, vocabulary {vocab}, random weights, fp32, sdpa",
        "batch": args.batch,
        "sequence": args.seq,
        "lora": f"r=16 on {','.join(LORA_TARGETS)}",
        "machine": f"{platform.machine()}, {os.cpu_count()} CPU threads ({threads} used), torch {torch.__version__}",
        "steps_timed": args.steps,
    }
    line = (
        f"Setup: {setup['model']}; batch {args.batch} x sequence {args.seq}; LoRA {setup['lora']}; "
        f"{setup['machine']}; median of {args.steps} steps."
    )
    stem = "head_loss_quick" if args.quick else "head_loss"
    write_report(args.out, stem, {"setup": setup, "results": results}, f"{line}\n\n{results_table(results)}")


if __name__ == "__main__":
    main()
