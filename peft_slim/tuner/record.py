"""The record of a standalone adapter's base model: which base tensors its file holds, and a digest of every other
base parameter as it was when the model was wrapped (saved in the weights file, checked at load)."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..trainable import is_under, peft_wrapped_names

# The key under which a standalone adapter's file holds the record of its base model (a uint8 tensor of JSON).
RECORD_KEY = "peft_slim.base_weights"


def record_tensor(record: dict) -> torch.Tensor:
    """``record`` (JSON-ready) as a uint8 tensor, to travel in the adapter file with the tensors it describes."""
    return torch.frombuffer(bytearray(json.dumps(record, sort_keys=True).encode()), dtype=torch.uint8).clone()


def record_from_tensor(tensor: torch.Tensor, where: str) -> dict:
    """The record ``record_tensor`` stored: ``saved``, the base parameters the file holds, and ``others``, the count,
    dtypes and joint blake2b digest of every other base parameter as it was when the model was wrapped."""
    try:
        value = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: the adapter file's {RECORD_KEY!r} is not a peft_slim record ({error}).") from None
    others = value.get("others") if isinstance(value, dict) else None
    if not (  # each test reads only what the ones before it guarantee
        isinstance(value, dict)
        and set(value) == {"saved", "others"}
        and isinstance(value["saved"], (list, tuple))
        and all(isinstance(name, str) and name for name in value["saved"])
        and isinstance(others, dict)
        and set(others) == {"count", "dtypes", "blake2b"}
        and isinstance(others["count"], int)
        and not isinstance(others["count"], bool)
        and others["count"] >= 0
        and isinstance(others["blake2b"], str)
        and isinstance(others["dtypes"], (list, tuple))
        and all(isinstance(dtype, str) for dtype in others["dtypes"])
    ):
        raise ValueError(
            f"{where}: {RECORD_KEY} must be the record save_pretrained writes: {{'saved': [parameter names], "
            f"'others': {{'count': int, 'dtypes': [str], 'blake2b': str}}}}, got {value!r}."
        )
    saved, count, dtypes, digest = value["saved"], others["count"], others["dtypes"], others["blake2b"]
    return {"saved": sorted(saved), "others": {"count": count, "dtypes": sorted(dtypes), "blake2b": digest}}


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """blake2b (16 bytes) of a tensor's bytes; of its dtype and shape alone for a tensor without data (the meta
    device, e.g. a model built for a memory estimate: it is never saved)."""
    if tensor.device.type == "meta":
        return hashlib.blake2b(f"meta {tensor.dtype} {list(tensor.shape)}".encode(), digest_size=16).digest()
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy(), digest_size=16).digest()


def identity(entries: Iterable[tuple[str, str, tuple, bytes]]) -> dict[str, Any]:
    """One record of many tensors given as ``(name, dtype, shape, digest)``: count, dtypes and a joint blake2b."""
    joint = hashlib.blake2b(digest_size=16)
    count, dtypes = 0, set()
    for name, dtype, shape, digest in sorted(entries):
        joint.update(f"{name}\0{dtype}\0{list(shape)}\0".encode() + digest)
        count += 1
        dtypes.add(dtype)
    return {"count": count, "dtypes": sorted(dtypes), "blake2b": joint.hexdigest()}


def base_parameter_names(model: nn.Module) -> list[str]:
    """The base model's parameters that an adapter may rely on: all but those under PEFT's wrappers (whose trained
    copies PEFT saves itself) and LoRA's own."""
    wrapped = peft_wrapped_names(model)
    return [name for name, _ in model.named_parameters() if ".lora_" not in name and not is_under(name, wrapped)]
