"""The record of a standalone adapter's base model: which base tensors its file holds, and a digest of every other
base parameter as it was when the model was wrapped (saved in the weights file, checked at load)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from ..configuration import Check
from ..trainable import is_under, peft_wrapped_names

# The key under which a standalone adapter's file holds the record of its base model (a uint8 tensor of JSON).
RECORD_KEY = "peft_slim.base_weights"


@dataclasses.dataclass
class BaseWeightsRecord(Check):
    """What ``save_pretrained`` records of a standalone adapter's base model: ``saved``, the base parameters the file
    holds, and ``others``, the count, dtypes and joint blake2b digest of every other base parameter as it was when
    the model was wrapped."""

    expected: str = (
        "the record save_pretrained writes: {'saved': [parameter names], 'others': {'count': int, 'dtypes': "
        "[str], 'blake2b': str}}"
    )

    def coerce(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict) or set(value) != {"saved", "others"}:
            self.fail(value, where)
        saved, others = value["saved"], value["others"]
        if not isinstance(saved, (list, tuple)) or not all(isinstance(name, str) and name for name in saved):
            self.fail(value, where)
        if not isinstance(others, dict) or set(others) != {"count", "dtypes", "blake2b"}:
            self.fail(value, where)
        count, dtypes, digest = others["count"], others["dtypes"], others["blake2b"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0 or not isinstance(digest, str):
            self.fail(value, where)
        if not isinstance(dtypes, (list, tuple)) or not all(isinstance(d, str) for d in dtypes):
            self.fail(value, where)
        return {"saved": sorted(saved), "others": {"count": count, "dtypes": sorted(dtypes), "blake2b": digest}}


def record_tensor(record: dict) -> torch.Tensor:
    """``record`` (JSON-ready) as a uint8 tensor, to travel in the adapter file with the tensors it describes."""
    return torch.frombuffer(bytearray(json.dumps(record, sort_keys=True).encode()), dtype=torch.uint8).clone()


def record_from_tensor(tensor: torch.Tensor, where: str) -> dict:
    """The record ``record_tensor`` stored, checked by :class:`BaseWeightsRecord`."""
    try:
        value = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: the adapter file's {RECORD_KEY!r} is not a peft_slim record ({error}).") from None
    return BaseWeightsRecord().coerce(value, f"{where}: {RECORD_KEY}")


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
