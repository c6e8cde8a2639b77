"""How long ``estimate_memory`` takes on a 70B Llama, and that it allocates no weights.

The config has Llama-3-70B's shapes (written out below: no hub access needed). For each setting: the estimate, the
process's CPU time and the wall time of the call (on a shared machine, other jobs' load stretches the wall time,
not the CPU time), and the process's maximum resident memory so far (``resource.getrusage``; Python, torch and
transformers themselves take several hundred MiB of it), against the bf16 weights' size the estimate reports.

Run: ``python benchmarks/bench_planner_70b.py --threads 2`` (writes benchmarks/results/planner_70b.{md,json}).
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
import warnings

import torch
from peft import LoraConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import peft_slim  # noqa: E402
from benchmarks.report import markdown_table, write_report  # noqa: E402

LLAMA_70B = dict(
    model_type="llama",
    architectures=["LlamaForCausalLM"],
    hidden_size=8192,
    intermediate_size=28672,
    num_attention_heads=64,
    num_hidden_layers=80,
    num_key_value_heads=8,
    vocab_size=128256,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=500000.0,
    tie_word_embeddings=False,
)


def settings() -> dict:
    def lora():
        return LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM")

    return {
        "lora r16 all-linear": dict(peft_config=lora()),
        "lora + checkpointing": dict(peft_config=lora(), gradient_checkpointing=True),
        "tokentune-0.2 + lora + 8bit": dict(
            peft_config=peft_slim.TokenTuneConfig(
                task_type="CAUSAL_LM", token_ratio=0.2, lora=lora(), activation_compression={"bits": 8}
            )
        ),
    }


def gib(n_bytes: int) -> str:
    return f"{n_bytes / 2**30:.1f} GiB"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows, results = [], []
    for name, options in settings().items():
        cpu, wall = time.process_time(), time.perf_counter()
        estimate = peft_slim.estimate_memory(
            dict(LLAMA_70B), batch_size=args.batch_size, seq_len=args.seq_len, dtype="bfloat16", **options
        )
        found = {"cpu": time.process_time() - cpu, "wall": time.perf_counter() - wall}
        real_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: KiB
        results.append(
            dict(
                setting=name,
                estimate=estimate.to_dict(),
                cpu_seconds=found["cpu"],
                wall_seconds=found["wall"],
                max_resident_bytes=real_peak,
            )
        )
        rows.append(
            [name, gib(estimate.parameters), gib(estimate.activations), gib(estimate.peak)]
            + [f"{found['cpu']:.1f} s", f"{found['wall']:.1f} s", f"{real_peak / 2**20:.0f} MiB"]
        )
        print(rows[-1], flush=True)
    header = ["setting", "parameters", "activations", "peak", "CPU time", "wall time", "max resident memory"]
    markdown = "\n\n".join(
        [
            "# Memory planner on a 70B Llama (estimate only, no weights)",
            f"Batch {args.batch_size} x {args.seq_len} tokens, bf16 weights, AdamW; {args.threads} threads on a "
            f"shared {os.cpu_count()}-core machine (wall time includes other jobs' load).",
            markdown_table(header, rows),
        ]
    )
    write_report(args.out, "planner_70b", dict(threads=args.threads, results=results), markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())
