"""What the base model's trainable tensors were before SlimFit trained them in place.

Saving writes only the tensors that changed, and telling which did must not cost a copy of the model:
a hash of each tensor's bytes, taken at wrapping time, settles it exactly. A full copy (on the CPU) is
kept only when asked for, so that unload() can give the base model back.
"""

from __future__ import annotations

import hashlib

import torch
from torch import nn


def tensor_digest(tensor: torch.Tensor) -> bytes:
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy(), digest_size=16).digest()


class BaseWeights:
    """Digests (and optionally CPU copies) of the parameters a standalone SlimFit model trains in place."""

    def __init__(self, params: list[nn.Parameter], keep_copies: bool):
        self._params = {id(p): p for p in params}
        self._digests = {id(p): tensor_digest(p) for p in params}
        self._copies = {id(p): p.detach().to("cpu", copy=True) for p in params} if keep_copies else None

    @property
    def kept(self) -> bool:
        return self._copies is not None

    def changed(self, param: nn.Parameter) -> bool:
        """Whether ``param`` differs from what it was at wrapping time (False for parameters not tracked)."""
        digest = self._digests.get(id(param))
        return digest is not None and tensor_digest(param) != digest

    def any_changed(self) -> bool:
        return any(self.changed(p) for p in self._params.values())

    @torch.no_grad()
    def restore(self) -> None:
        if self._copies is None:
            raise RuntimeError("BaseWeights.restore: no copies were kept.")
        for key, param in self._params.items():
            param.copy_(self._copies[key])
