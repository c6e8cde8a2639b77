"""Measuring training memory, from the tensors and allocations that actually happen: bytes autograd saves for
backward, and peak allocator use."""

from __future__ import annotations

import itertools
import json
import os
import tempfile
import warnings
from collections.abc import Callable, Iterable

import torch
from torch.autograd.graph import saved_tensors_hooks

from .compat import storage_key
from .quiet import native_stderr_without


class SavedActivationBytes(saved_tensors_hooks):
    """Count the bytes of distinct storages autograd saves for backward, parameters excluded:
    ``with SavedActivationBytes(model.parameters()) as saved: loss = ...``, then ``saved.bytes`` (not inside other
    saved-tensor hooks, e.g. compression: only the innermost act)."""

    def __init__(self, parameters: Iterable[torch.Tensor] = ()):
        self._parameter_storages = {storage_key(p) for p in parameters}
        self._seen: dict[int, int] = {}
        super().__init__(self._pack, lambda tensor: tensor)

    def _pack(self, tensor: torch.Tensor) -> torch.Tensor:
        key = storage_key(tensor)
        if key not in self._parameter_storages and not isinstance(tensor, torch.nn.Parameter):
            self._seen[key] = tensor.untyped_storage().nbytes()
        return tensor

    def __enter__(self) -> SavedActivationBytes:
        super().__enter__()
        return self

    @property
    def bytes(self) -> int:
        return sum(self._seen.values())


def peak_memory_bytes(step: Callable[[], object]) -> int:
    """Peak bytes held by PyTorch's allocator during ``step()``, above what was held before it: CUDA's
    ``max_memory_allocated``, or on CPU the profiler's allocations and frees replayed in order (an operator's
    temporaries freed before it returns are not seen)."""
    return _measure(step, peak=True)[0]


def held_memory_bytes(step: Callable[[], object]) -> tuple[int, object]:
    """Bytes allocated by ``step()`` and held when it returns (measured as ``peak_memory_bytes``), and its result."""
    return _measure(step, peak=False)


def _measure(step: Callable[[], object], peak: bool) -> tuple[int, object]:
    """``step()``'s peak or held bytes, and what it returned. On CPU each allocation is an operator's *self* usage,
    each free outside one a "[memory]" event, replayed in time order."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
        if peak:
            torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        result = step()
        torch.cuda.synchronize()
        return (torch.cuda.max_memory_allocated() if peak else torch.cuda.memory_allocated()) - before, result
    cpu = [torch.profiler.ProfilerActivity.CPU]
    with native_stderr_without(), torch.profiler.profile(activities=cpu, profile_memory=True) as prof:
        result = step()
    events = sorted(
        (e.time_range.start, e.cpu_memory_usage if e.name == "[memory]" else e.self_cpu_memory_usage)
        for e in prof.events()
    )
    changes = [change for _, change in events]
    return (max(itertools.accumulate(changes, initial=0)) if peak else sum(changes)), result


def timeline_peak_bytes(step: Callable[[], object]) -> int:
    """Peak bytes of tensors during ``step()`` above those held at its start, from the profiler's memory timeline
    (every allocation and free at its own time). On CPU it sees what ``peak_memory_bytes`` misses: that one books an
    operator's net allocation at its start, so a backward node's frees before its output count first."""
    activities = [torch.profiler.ProfilerActivity.CPU]
    device = "cpu"
    if torch.cuda.is_available():
        activities.append(torch.profiler.ProfilerActivity.CUDA)
        device = f"cuda:{torch.cuda.current_device()}"
    with (
        native_stderr_without(),  # the profiler's start/stop lines, not faults
        torch.profiler.profile(
            activities=activities, profile_memory=True, record_shapes=True, with_stack=True
        ) as prof,
    ):
        step()
    with tempfile.TemporaryDirectory() as folder:
        path = os.path.join(folder, "timeline.json")
        with warnings.catch_warnings():  # deprecated in torch 2.13 in favour of CUDA-only snapshots: no CPU successor
            warnings.simplefilter("ignore", FutureWarning)
            prof.export_memory_timeline(path, device=device)
        with open(path) as handle:
            _, sizes = json.load(handle)
    totals = [sum(sample) for sample in sizes]
    return max(totals) - totals[0] if totals else 0
