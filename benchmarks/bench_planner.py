"""The memory planner against the allocator: estimated vs measured training-step memory, and plan's top pick.

For each architecture (a decoder, an encoder, a ViT; small random models) and each setting, ``estimate_memory``
(one training step traced on fake tensors, no weights) is compared with ``measure_memory`` (the same step run for
real on CPU): parameters, gradients and optimizer state (bytes of the tensors), activations (what the forward
leaves allocated for backward, from the profiler's allocation events) and the step's peak (the profiler's memory
timeline, ``peft_slim.memory.timeline_peak_bytes``, plus what is held before the step). The benchmarks' older
measurement, ``peak_memory_bytes``, books each operator's net allocation at its start and reads the backward
peak low on CPU; the timeline sees every allocation and free at its own time.

Then, per architecture, ``plan`` is asked for a budget halfway between plain LoRA's estimated peak and the leanest
grid setting's, and its top setting is run for real: its measured peak must be within the budget.

Run: ``python benchmarks/bench_planner.py --threads 1`` (writes benchmarks/results/planner.{md,json}).
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import time
import warnings

import torch
import transformers
from peft import LoraConfig

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import peft_slim  # noqa: E402
from benchmarks.report import markdown_table, write_report  # noqa: E402
from peft_slim.planner import estimate_memory, measure_memory, plan  # noqa: E402

COMPONENTS = ("parameters", "gradients", "optimizer_state", "activations", "peak")
PEAK_TOLERANCE, COMPONENT_TOLERANCE = 0.10, 0.15


def mib(n_bytes: int) -> str:
    return f"{n_bytes / 2**20:.2f} MiB"


def architectures() -> dict[str, dict]:
    text = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, intermediate_size=512, vocab_size=2000)
    return {
        "llama": dict(
            config=transformers.LlamaConfig(**text, num_key_value_heads=2, architectures=["LlamaForCausalLM"]),
            targets=["q_proj", "v_proj"],
            task_type="CAUSAL_LM",
            seq_len=128,
        ),
        "bert": dict(
            config=transformers.BertConfig(**text, num_labels=3, architectures=["BertForSequenceClassification"]),
            targets=["query", "value"],
            task_type="SEQ_CLS",
            seq_len=128,
        ),
        "vit": dict(
            config=transformers.ViTConfig(
                **{k: v for k, v in text.items() if k != "vocab_size"},
                image_size=64,
                patch_size=8,
                num_labels=3,
                architectures=["ViTForImageClassification"],
            ),
            targets=["q_proj", "v_proj"],
            task_type=None,
            seq_len=None,
        ),
    }


def settings(arch: dict) -> dict[str, dict]:
    def lora():
        return LoraConfig(r=8, lora_alpha=16, target_modules=arch["targets"], task_type=arch["task_type"])

    def tokentune(ratio, bits=None):
        compression = None if bits is None else {"bits": bits}
        return peft_slim.TokenTuneConfig(
            task_type=arch["task_type"], token_ratio=ratio, lora=lora(), activation_compression=compression
        )

    return {
        "full fine-tuning": dict(peft_config=None),
        "lora": dict(peft_config=lora()),
        "lora bf16": dict(peft_config=lora(), dtype="bfloat16"),
        "lora + checkpointing": dict(peft_config=lora(), gradient_checkpointing=True),
        "tokentune-0.3 + lora": dict(peft_config=tokentune(0.3)),
        "tokentune-0.3 + lora + 8bit": dict(peft_config=tokentune(0.3, 8)),
        "tokentune-0.1 + lora + 4bit": dict(peft_config=tokentune(0.1, 4)),
        "slimfit-0.8 (worst step)": dict(
            peft_config=peft_slim.SlimFitConfig(task_type=arch["task_type"], freeze_ratio=0.8)
        ),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore")
    rows, points, plans = [], [], []
    for arch_name, arch in architectures().items():
        for setting, options in settings(arch).items():
            kwargs = dict(batch_size=args.batch_size, seq_len=arch["seq_len"], **options)
            start = time.perf_counter()
            estimate = estimate_memory(arch["config"], **kwargs)
            seconds = time.perf_counter() - start
            measured = measure_memory(arch["config"], **kwargs)
            ratios = {k: getattr(estimate, k) / max(getattr(measured, k), 1) for k in COMPONENTS}
            errors = {
                k: abs(r - 1) if getattr(measured, k) else float(getattr(estimate, k) != 0) for k, r in ratios.items()
            }
            ok = errors["peak"] <= PEAK_TOLERANCE and all(errors[k] <= COMPONENT_TOLERANCE for k in COMPONENTS)
            points.append(
                dict(
                    architecture=arch_name,
                    setting=setting,
                    estimate=estimate.to_dict(),
                    measured=measured.to_dict(),
                    relative_error=errors,
                    estimate_seconds=seconds,
                    within_tolerance=ok,
                )
            )
            rows.append(
                [arch_name, setting]
                + [f"{mib(getattr(estimate, k))} / {mib(getattr(measured, k))}" for k in ("activations", "peak")]
                + [f"{100 * errors[k]:.1f}%" for k in COMPONENTS]
                + ["yes" if ok else "**no**"]
            )
            print(rows[-1], flush=True)
        peaks = [p["estimate"]["peak"] for p in points if p["architecture"] == arch_name]
        lora_peak = next(p for p in points if p["architecture"] == arch_name and p["setting"] == "lora")
        budget = (lora_peak["estimate"]["peak"] + min(peaks)) // 2  # below plain LoRA, above the leanest setting
        found = plan(
            arch["config"], budget, args.batch_size, arch["seq_len"], target_modules=arch["targets"], lora_r=8
        )
        if found:
            top = found[0]
            config = top.peft_config(arch["task_type"], arch["targets"])
            measured = measure_memory(
                arch["config"],
                config,
                args.batch_size,
                arch["seq_len"],
                gradient_checkpointing=top.gradient_checkpointing,
            )
            plans.append(
                dict(
                    architecture=arch_name,
                    budget=budget,
                    top=top.name,
                    estimated_peak=top.estimate.peak,
                    measured_peak=measured.peak,
                    fits=measured.peak <= budget,
                )
            )
        else:
            plans.append(dict(architecture=arch_name, budget=budget, top=None, fits=None))
        print(plans[-1], flush=True)
    header = ["architecture", "setting", "activations est / meas", "peak est / meas"]
    header += [f"error {k}" for k in COMPONENTS] + ["within 10% / 15%"]
    plan_rows = [
        [p["architecture"], mib(p["budget"]), p["top"] or "nothing fits"]
        + ([mib(p["estimated_peak"]), mib(p["measured_peak"]), "yes" if p["fits"] else "**no**"] if p["top"] else [])
        for p in plans
    ]
    cores = f"{os.cpu_count()} cores, shared"
    machine = f"{platform.machine()} CPU ({cores}), torch {torch.__version__}, {args.threads} thread(s)"
    markdown = "\n\n".join(
        [
            "# Memory planner: estimated vs measured (CPU)",
            f"Batch size {args.batch_size}; decoder and encoder at 128 tokens, ViT 64x64 pixels in 8x8 patches "
            f"(65 tokens); hidden 128, 2 layers. Machine: {machine}. Measured: `measure_memory` (the profiler's "
            "allocation events and memory timeline); estimated: `estimate_memory` (fake tensors, no weights).",
            markdown_table(header, rows),
            "## plan's top setting, run for real, for a budget halfway between plain LoRA's peak and the leanest "
            "setting's",
            markdown_table(
                ["architecture", "budget", "top setting", "estimated peak", "measured peak", "fits"], plan_rows
            ),
        ]
    )
    report = dict(machine=machine, batch_size=args.batch_size, points=points, plans=plans)
    write_report(args.out, "planner", report, markdown)
    return 0 if all(p["within_tolerance"] for p in points) and all(p["fits"] for p in plans) else 1


if __name__ == "__main__":
    sys.exit(main())
