"""Bytes alive at every moment of a traced training step: the allocator's view, replayed on fake tensors.

Every operator's output that brings a new storage adds its bytes; the storage's bytes go when the last tensor
using it dies (autograd's saved tensors, gradients and optimizer state keep theirs alive as long as they really
are). Like the CPU measurement (``peft_slim.memory.peak_memory_bytes``), buffers an operator allocates and frees
before returning are not seen.
"""

from __future__ import annotations

import weakref

import torch

from ..compat import storage_key
from .fake import TorchDispatchMode, tree_leaves


class LiveBytes(TorchDispatchMode):
    """``total``: bytes of the storages created inside the mode and still alive; ``peak``: the highest ``total``."""

    def __init__(self):
        super().__init__()
        self._live: dict[int, list[int]] = {}  # storage key -> [bytes, tensors using it]
        self.total = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = None
        for tensor in tree_leaves(out):
            if not isinstance(tensor, torch.Tensor):
                continue
            key = storage_key(tensor)
            if key not in self._live:
                # A view allocates nothing. Its storage is untracked when it views a tensor from before the trace (a
                # weight), or the fake copy of a real tensor (the token selection's index, drawn for real from the
                # real inputs and counted as such): fake tensor mode converts real arguments to fake ones.
                if func.is_view:
                    continue
                if inputs is None:  # storages the operator was given: an in-place result on one of them
                    leaves = tree_leaves((args, kwargs))
                    inputs = {storage_key(t) for t in leaves if isinstance(t, torch.Tensor)}
                if key in inputs:
                    continue  # an in-place change of a tensor from before the trace: nothing allocated or freed
            self._track(tensor, key)
        return out

    def _track(self, tensor: torch.Tensor, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [tensor.untyped_storage().nbytes(), 0]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]
            self.total -= entry[0]
