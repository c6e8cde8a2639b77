"""Measuring training memory: bytes autograd saves for backward, and peak allocator use.

Used by tests and benchmarks. Nothing here is estimated from shapes: both numbers come from the
tensors and allocations that actually happen.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks


class SavedActivationBytes(saved_tensors_hooks):
    """Count the bytes of distinct storages autograd saves for backward, parameters excluded.

    Use around a forward pass: ``with SavedActivationBytes(model.parameters()) as saved: loss = ...``,
    then read ``saved.bytes``. A storage saved several times (or by several views) counts once.
    Saved-tensor hooks nest and only the innermost pair is active, so do not combine this with
    another saved-tensor hook (e.g. activation compression); measure that with ``peak_memory_bytes``.
    """

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._parameter_storages = {p.untyped_storage().data_ptr() for p in parameters}
        self._seen: dict[int, int] = {}
        super().__init__(self._pack, self._unpack)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer not in self._parameter_storages and not isinstance(tensor, torch.nn.Parameter):
            self._seen[pointer] = storage.nbytes()
        return tensor

    def __enter__(self) -> SavedActivationBytes:
        super().__enter__()
        return self

    @staticmethod
    def _unpack(tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


def peak_memory_bytes(step: Callable[[], object]) -> int:
    """Peak bytes held by PyTorch's allocator during ``step()``, above what was held before it.

    On CUDA this is ``torch.cuda.max_memory_allocated``; on CPU the profiler's allocation and free events
    are replayed in order and the highest running total is taken (an operator's temporary buffers that it
    frees before returning are not seen).
    """
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_allocated() - before
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    # Each allocation is reported by the operator that made it (its *self* usage, children excluded) and
    # each free outside an operator as a "[memory]" event; replay both in time order.
    changes = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    running = peak = 0
    for _, change in changes:
        running += change
        peak = max(peak, running)
    return peak
