"""``peft-slim plan``: which settings fit a memory budget, estimated without loading any weights."""

from __future__ import annotations

import argparse
import re

HELP = "Estimate training memory and list the settings that fit a budget (no weights are loaded)."
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'24GB', '24GiB', '500MB' or a number of bytes."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 24GB, 24GiB, 500MB or 1000000.")
    return int(float(match.group(1)) * _UNITS[unit])


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", required=True, help="A config.json file, a model folder, or a hub id.")
    parser.add_argument("--budget", type=parse_bytes, default=None, help="Memory budget, e.g. 24GB (default: none).")
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seq-len", type=int, default=None, help="Tokens per sequence (not for image models).")
    parser.add_argument("--lora-r", type=int, default=8)
    parser.add_argument("--optimizer", choices=("adamw", "sgd"), default="adamw")
    parser.add_argument(
        "--dtype", choices=("float32", "bfloat16"), default="float32", help="dtype of the weights (default float32)."
    )
    parser.add_argument("--min-token-ratio", type=float, default=0.1, help="Fewest tokens TokenTune may keep.")
    parser.add_argument(
        "--no-checkpointing", action="store_true", help="Do not try gradient checkpointing (faster planning)."
    )
    parser.add_argument("--task", choices=("causal_lm", "sequence_classification", "image_classification"))


def train_command(model: str, candidate, batch_size: int, seq_len: int | None, dtype: str) -> str:
    """The ``peft-slim train`` line for one planned setting."""
    parts = ["peft-slim train", f"--model {model}", f"--method {candidate.method}", f"--lora-r {candidate.lora_r}"]
    if candidate.token_ratio is not None:
        parts.append(f"--token-ratio {candidate.token_ratio:g}")
    if candidate.freeze_ratio is not None:
        parts.append(f"--freeze-ratio {candidate.freeze_ratio:g}")
    if candidate.compression_bits is not None:
        parts.append(f"--compression-bits {candidate.compression_bits}")
    if candidate.gradient_checkpointing:
        parts.append("--gradient-checkpointing")
    parts.append(f"--batch-size {batch_size}")
    if seq_len is not None:
        parts.append(f"--max-length {seq_len}")
    if dtype != "float32":
        parts.append(f"--dtype {dtype}")
    return " ".join(parts)


def _size(value: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


def run(args: argparse.Namespace) -> int:
    from ..planner import plan

    try:
        found = plan(
            args.model,
            args.budget,
            args.batch_size,
            args.seq_len,
            args.optimizer,
            dtype=args.dtype,
            lora_r=args.lora_r,
            min_token_ratio=args.min_token_ratio,
            task=args.task,
            checkpointing=not args.no_checkpointing,
            progress=True,
        )
    except ValueError as error:
        print(f"peft-slim plan: {error}")
        return 2
    columns = ("setting", "peak", "parameters", "gradients", "optimizer state", "activations")
    print(" | ".join(columns))
    for candidate in found:
        e = candidate.estimate
        cells = (e.peak, e.parameters, e.gradients, e.optimizer_state, e.activations)
        print(" | ".join([candidate.name, *map(_size, cells)]))
    if args.budget is not None:
        if not found:
            print(f"Nothing fits {_size(args.budget)}: lower --batch-size or --seq-len.")
            return 1
        print(train_command(args.model, found[0], args.batch_size, args.seq_len, args.dtype))
    return 0
