"""``python -m benchmarks.gpu``: every method on one GPU, peak memory and step time against LoRA (issue 16's table).

A Llama with Llama-3.2-1B's shape (``--shape 8b``: Llama-3.1-8B's) and random weights (built from a config, nothing
downloaded), bf16, batch 8 x 2048 tokens of random ids, LoRA r=16 on all seven linear projections, AdamW. Each method
is built afresh, trained ``--warmup`` steps, then ``--steps`` steps:

* peak: ``torch.cuda.max_memory_allocated()`` over the timed steps (weights, optimizer state and all), reset after
  the warm-up;
* step: the median wall time of a step (forward, backward, optimizer step, SlimFit's schedule), each step between
  two ``torch.cuda.synchronize()``.

Methods that cannot be built or run here (Liger-Kernel not installed, a method refusing the model, out of memory)
get a row saying why instead of numbers; the run goes on. Liger-Kernel (``apply_liger_kernel_to_llama``) patches
transformers' Llama classes for the whole process, so its rows run last.

Then the compression kernels on their own: achieved GB/s of quantise + pack and unpack + dequantise of a bf16
tensor (bytes read plus bytes written, per median call), beside the torch path's on the same tensor.

``--device cpu --tiny``: a smoke run (tiny shape, batch 2 x 32, one step, no warm-up; peak from
``peft_slim.memory.peak_memory_bytes``, which on CPU replays the allocator's events) that the test suite runs; its
numbers say nothing about a GPU. Results: ``benchmarks/results/gpu[_tiny].{json,md}``.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import os
import platform
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

import peft_slim
from peft_slim.compression import quant
from peft_slim.memory import peak_memory_bytes
from peft_slim.recipe import trainable
from peft_slim.slimfit import find_slimfit

from .report import markdown_table, size, write_report

LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
TOKEN_RATIO = 0.2
FREEZE_RATIO = 0.9
SHAPES = {
    "1b": dict(
        vocab_size=128256,
        hidden_size=2048,
        intermediate_size=8192,
        num_hidden_layers=16,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=64,
        tie_word_embeddings=True,
        rope_theta=500000.0,
    ),
    "8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        tie_word_embeddings=False,
        rope_theta=500000.0,
    ),
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        tie_word_embeddings=True,
    ),
}


@dataclass
class Built:
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    after_step: Callable[[], None] = lambda: None


@dataclass
class Method:
    name: str
    build: Callable[[LlamaConfig, torch.device], Built]
    liger: bool = False  # patches transformers for the rest of the process: run last


def base_model(config: LlamaConfig, device: torch.device, checkpointing: bool = False) -> torch.nn.Module:
    torch.manual_seed(0)
    with device:
        model = LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    return model


def lora_config() -> LoraConfig:
    return LoraConfig(r=16, lora_alpha=32, target_modules=LORA_TARGETS, lora_dropout=0.0, task_type="CAUSAL_LM")


def adamw(model: torch.nn.Module, every: bool = False) -> torch.optim.Optimizer:
    parameters = [p for p in model.parameters() if every or p.requires_grad]
    return torch.optim.AdamW(parameters, lr=1e-5, foreach=True)


def lora(checkpointing: bool = False, liger: bool = False):
    def build(config, device):
        base = base_model(config, device, checkpointing)
        if liger:
            _apply_liger(base)
        model = get_peft_model(base, lora_config())
        return Built(model, adamw(model))

    return build


def tokentune(checkpointing: bool = False, bits: int | None = None, chunked: bool = True, liger: bool = False):
    def build(config, device):
        base = base_model(config, device, checkpointing)
        if liger:
            _apply_liger(base)
        compression = peft_slim.ActivationCompressionConfig(bits=bits) if bits is not None else None
        tuner = peft_slim.TokenTuneConfig(
            task_type="CAUSAL_LM",
            token_ratio=TOKEN_RATIO,
            seed=0,
            lora=lora_config(),
            activation_compression=compression,
            chunked_loss=chunked,
        )
        model = get_peft_model(base, tuner)
        return Built(model, adamw(model))

    return build


def full_ft(config, device):
    model = base_model(config, device)
    model.requires_grad_(True)
    return Built(model, adamw(model))


def slimfit(stack: bool):
    """SlimFit 0.9 on the base weights, or (``stack``) SlimFit 0.9 + LoRA + TokenTune 0.2; default compression."""

    def build(config, device):
        extra = {}
        if stack:
            extra = dict(
                lora=lora_config(), token_selection=peft_slim.TokenSelectionConfig(token_ratio=TOKEN_RATIO, seed=0)
            )
        tuner = peft_slim.SlimFitConfig(freeze_ratio=FREEZE_RATIO, seed=0, task_type="CAUSAL_LM", **extra)
        model, _ = trainable(base_model(config, device), tuner)  # without LoRA: SlimFit's full fine-tuning transform
        schedule = find_slimfit(model)
        optimizer = adamw(model, every=True)  # AdamW skips parameters without a gradient (frozen this step)
        schedule.slimfit_attach(optimizer)
        return Built(model, optimizer, after_step=lambda: schedule.slimfit_step(optimizer))

    return build


def methods() -> list[Method]:
    tt = f"tokentune{TOKEN_RATIO:g}+lora"
    sf = f"slimfit{FREEZE_RATIO:g}"
    return [
        Method("lora", lora()),
        Method("lora+ckpt", lora(checkpointing=True)),
        Method(tt, tokentune()),
        Method(f"{tt} (materialised logits)", tokentune(chunked=False)),
        Method(f"{tt}+ckpt", tokentune(checkpointing=True)),
        Method(f"{tt}+8bit", tokentune(bits=8)),
        Method(f"{tt}+4bit", tokentune(bits=4)),
        Method(f"{tt}+8bit+ckpt", tokentune(checkpointing=True, bits=8)),
        Method(f"{sf}+{tt} (default compression)", slimfit(stack=True)),
        Method("full-ft", full_ft),
        Method(f"{sf} full-ft", slimfit(stack=False)),
        Method("lora+liger", lora(liger=True), liger=True),
        Method("lora+liger+ckpt", lora(checkpointing=True, liger=True), liger=True),
        Method(f"{tt}+liger", tokentune(liger=True), liger=True),
    ]


def _apply_liger(model: torch.nn.Module) -> None:
    from liger_kernel.transformers import apply_liger_kernel_to_llama

    apply_liger_kernel_to_llama(rope=True, rms_norm=True, swiglu=True, fused_linear_cross_entropy=True, model=model)


def liger_missing() -> str | None:
    if importlib.util.find_spec("liger_kernel") is None:
        return "Liger-Kernel is not installed (pip install liger-kernel)"
    if not torch.cuda.is_available():
        return "Liger-Kernel needs CUDA (Triton kernels)"
    return None


# ---------------------------------------------------------------------------------------------- measuring


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def training_step(built: Built, batch: dict) -> None:
    loss = built.model(**batch).loss
    loss.backward()
    built.optimizer.step()
    built.optimizer.zero_grad(set_to_none=True)
    built.after_step()


def measure(method: Method, config: LlamaConfig, device: torch.device, batch: dict, warmup: int, steps: int) -> dict:
    built = method.build(config, device)
    built.model.train()
    for _ in range(warmup):
        training_step(built, batch)
    seconds = []

    def timed_steps():
        for _ in range(steps):
            synchronize(device)
            start = time.perf_counter()
            training_step(built, batch)
            synchronize(device)
            seconds.append(time.perf_counter() - start)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        timed_steps()
        peak = torch.cuda.max_memory_allocated(device)
        how = "torch.cuda.max_memory_allocated"
    else:
        peak = peak_memory_bytes(timed_steps)
        how = "peft_slim.memory.peak_memory_bytes (CPU: above what was held before the steps)"
    built = None  # the model and its optimizer go before the next method is built
    return {"peak_bytes": peak, "peak_measured_by": how, "step_seconds": seconds, "median_step_seconds": None}


def release(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def run_methods(config, device, batch, warmup, steps, selected) -> dict:
    results = {}
    missing = liger_missing()
    ordered = sorted(methods(), key=lambda m: m.liger)  # Liger patches transformers for good: last
    for method in ordered:
        if selected and method.name not in selected:
            continue
        if method.liger and missing:
            results[method.name] = {"skipped": missing}
            continue
        try:
            result = measure(method, config, device, batch, warmup, steps)
            result["median_step_seconds"] = statistics.median(result["step_seconds"])
        except Exception as error:  # noqa: BLE001 - one failing method must not lose the others' rows
            oom = device.type == "cuda" and isinstance(error, torch.OutOfMemoryError)
            result = {"skipped": "out of memory" if oom else f"{type(error).__name__}: {error}"[:300]}
        release(device)
        results[method.name] = result
        print(f"{method.name}: {_summary(result)}", flush=True)
    base = results.get("lora", {})
    for result in results.values():
        if "skipped" in result or "skipped" in base or not base:
            continue
        result["peak_ratio"] = result["peak_bytes"] / base["peak_bytes"]
        result["step_ratio"] = result["median_step_seconds"] / base["median_step_seconds"]
    return results


def _summary(result: dict) -> str:
    if "skipped" in result:
        return f"skipped ({result['skipped']})"
    return f"peak {result['peak_bytes'] / 2**30:.2f} GiB, step {result['median_step_seconds']:.3f} s"


# ---------------------------------------------------------------------------------------------- the kernels


def kernel_bandwidth(device: torch.device, numel: int, repeats: int) -> dict:
    """GB/s of quantise (+ pack) and (unpack +) dequantise of a bf16 tensor: the dispatching path (Triton kernels on
    CUDA when Triton imports, torch's on CPU) beside the torch path (``_quantize_packed``)."""
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(numel, generator=generator).to(device=device, dtype=torch.bfloat16)
    group = 128
    rows = {}
    kernels = quant._fused_kernels(values.device)
    usable = kernels is not None and quant.kernels_usable(values.device, values.dtype)  # else quantize falls back
    for bits in (8, 4, 2):
        fused = usable and kernels.applies(values, bits, group)
        paths = {"kernels" if fused else "default path": lambda b=bits: quant.quantize(values, b, group)}
        paths["torch path"] = lambda b=bits: quant._quantize_packed(values, b, group)
        for path, encode in paths.items():
            packed = encode()
            moved = values.numel() * values.element_size() + packed.nbytes
            encode_s = _median_seconds(encode, device, repeats)
            decode_s = _median_seconds(lambda p=packed: quant.dequantize(p, torch.bfloat16), device, repeats)
            rows[f"{bits}-bit {path}"] = {
                "quantize_seconds": encode_s,
                "dequantize_seconds": decode_s,
                "bytes_moved": moved,
                "quantize_GBps": moved / encode_s / 1e9,
                "dequantize_GBps": moved / decode_s / 1e9,
            }
            del packed
    return {"numel": numel, "dtype": "bfloat16", "group_size": group, "rows": rows}


def _median_seconds(call: Callable[[], object], device: torch.device, repeats: int) -> float:
    call()  # compile / warm up
    seconds = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        call()
        synchronize(device)
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


# ---------------------------------------------------------------------------------------------- the report


def methods_table(results: dict) -> str:
    header = ["method", "peak", "vs LoRA", "step s", "vs LoRA"]
    rows = []
    for name, r in results.items():
        if "skipped" in r:
            rows.append([name, f"skipped: {r['skipped']}", "", "", ""])
            continue
        peak_ratio = f"{r['peak_ratio']:.2f}" if "peak_ratio" in r else ""
        step_ratio = f"{r['step_ratio']:.2f}" if "step_ratio" in r else ""
        rows.append([name, size(r["peak_bytes"]), peak_ratio, f"{r['median_step_seconds']:.3f}", step_ratio])
    return markdown_table(header, rows)


def kernels_table(kernels: dict) -> str:
    header = ["bits, path", "quantise GB/s", "dequantise GB/s", "quantise ms", "dequantise ms"]
    rows = [
        [name, f"{r['quantize_GBps']:.1f}", f"{r['dequantize_GBps']:.1f}"]
        + [f"{r['quantize_seconds'] * 1e3:.2f}", f"{r['dequantize_seconds'] * 1e3:.2f}"]
        for name, r in kernels["rows"].items()
    ]
    return markdown_table(header, rows)


def machine(device: torch.device) -> str:
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        memory = torch.cuda.get_device_properties(device).total_memory / 2**30
        return f"{name} ({memory:.0f} GiB), torch {torch.__version__}, CUDA {torch.version.cuda}"
    return f"CPU {platform.machine()}, {os.cpu_count()} threads, torch {torch.__version__}"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="cuda (the benchmark) or cpu (with --tiny: a smoke run)")
    parser.add_argument("--shape", choices=["1b", "8b"], default="1b")
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--seq", type=int, default=2048)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--methods", default="", help="comma-separated method names (default: all)")
    parser.add_argument("--kernel-numel", type=int, default=1 << 28, help="values in the kernels' bf16 tensor")
    parser.add_argument("--tiny", action="store_true", help="tiny shape, batch 2 x 32, 1 step, no warm-up")
    parser.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "results"))
    parser.add_argument("--dry-run", action="store_true", help="check the arguments, say what would run, run nothing")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    known = [method.name for method in methods()]
    selected = [name.strip() for name in args.methods.split(",") if name.strip()]
    if unknown := [name for name in selected if name not in known]:
        parser.error(f"--methods: no method named {', '.join(map(repr, unknown))}; the methods: {', '.join(known)}")
    if device.type == "cuda" and not torch.cuda.is_available() and not args.dry_run:
        parser.error("--device cuda, but torch sees no CUDA device; use --device cpu --tiny for a smoke run")
    if device.type != "cuda" and not args.tiny:
        parser.error("a CPU run of the full shapes would take hours: use --device cpu with --tiny")
    if args.dry_run:
        print(f"would run on {device}, shape {'tiny' if args.tiny else args.shape}: {', '.join(selected or known)}")
        return {}
    shape = "tiny" if args.tiny else args.shape
    if args.tiny:
        args.batch, args.seq, args.warmup, args.steps, args.kernel_numel = 2, 32, 0, 1, 1 << 12
    config = LlamaConfig(**SHAPES[shape], max_position_embeddings=max(args.seq, 2048), attn_implementation="sdpa")

    torch.manual_seed(0)
    input_ids = torch.randint(0, config.vocab_size, (args.batch, args.seq), device=device)
    batch = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids), "labels": input_ids}
    results = run_methods(config, device, batch, args.warmup, args.steps, selected)
    kernels = kernel_bandwidth(device, args.kernel_numel, repeats=1 if args.tiny else 10)

    setup = {
        "model": f"Llama, {'Llama-3.2-1B' if shape == '1b' else 'Llama-3.1-8B' if shape == '8b' else 'tiny'} shape, "
        "random weights, bf16, sdpa",
        "batch": args.batch,
        "sequence": args.seq,
        "lora": f"r=16 on {','.join(LORA_TARGETS)}; AdamW",
        "warmup_steps": args.warmup,
        "timed_steps": args.steps,
        "machine": machine(device),
    }
    report = {"setup": setup, "results": results, "kernels": kernels}
    line = (
        f"Setup: {setup['model']}; batch {args.batch} x {args.seq}; LoRA {setup['lora']}; peak over {args.steps} "
        f"steps after {args.warmup} warm-up, step = median; {setup['machine']}."
    )
    kernel_line = f"Compression of {kernels['numel']} bf16 values, group {kernels['group_size']}, median call:"
    markdown = f"{line}\n\n{methods_table(results)}\n\n{kernel_line}\n\n{kernels_table(kernels)}"
    write_report(args.out, "gpu_tiny" if args.tiny else f"gpu_{shape}", report, markdown)
    return report


if __name__ == "__main__":
    main()
