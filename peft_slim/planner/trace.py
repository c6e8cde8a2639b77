"""Bytes alive at every moment of a traced training step: the allocator's view, replayed on fake tensors.

Every operator's output that brings a new storage adds its bytes; the storage's bytes go when the last tensor
using it dies (autograd's saved tensors, gradients and optimizer state keep theirs alive as long as they really
are). Buffers an operator allocates and frees before returning are not seen, with one exception that is large:
a CPU elementwise operator whose tensors differ in dtype (PEFT adds a float32 LoRA output to a bfloat16 layer's)
first copies each input of another dtype to the common one (TensorIterator's ``promote_inputs_to_common_dtype``),
and an in-place one computes into a temporary of the common dtype; those copies live while it runs.
"""

from __future__ import annotations

import weakref

import torch

from ..compat import storage_key
from .fake import PRIM_DEVICE, TO_COPY, TorchDispatchMode, device_of_fake, tree_leaves, tree_map_only


class LiveBytes(TorchDispatchMode):
    """``total``: bytes of the storages created inside the mode and still alive; ``peak``: the highest ``total``."""

    def __init__(self, on_meta: bool = False):
        super().__init__()
        self.on_meta = on_meta
        # storage key -> [bytes, tensors using it, meta copies holding it, the entry it holds (a meta copy's)]
        self._live: dict[int, list] = {}
        self.total = 0
        self.peak = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is PRIM_DEVICE:  # a tensor's device, asked more often than any operator: nothing allocated
            device = device_of_fake(args[0])
            return func(*args) if device is None else device
        if self.on_meta:
            kwargs = kwargs or {}
            if func is TO_COPY and args[0].device.type != "meta" and kwargs.get("dtype") in (None, args[0].dtype):
                return self._moved(args[0], func(*args, **kwargs))
            args, kwargs = on_one_device(args, kwargs)
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
        if torch.Tag.pointwise in func.tags:
            self.peak = max(self.peak, self.total + promotion_bytes(func, args, kwargs))
        return out

    def _moved(self, real: torch.Tensor, moved: torch.Tensor) -> torch.Tensor:
        """A real tensor's copy on the meta device stands for it, as a fake tensor mode's moving a CPU tensor to its
        CPU is no copy: it keeps the real one's storage alive (if created inside the trace), allocating nothing."""
        held = self._live.get(storage_key(real))
        if held is not None:  # the copy and its views hold the real one's bytes
            held[2] += 1
            key = storage_key(moved)
            self._live[key] = [0, 0, 0, held]
            self._track(moved, key)
        return moved

    def _track(self, tensor: torch.Tensor, key: int) -> None:
        entry = self._live.get(key)
        if entry is None:
            entry = self._live[key] = [tensor.untyped_storage().nbytes(), 0, 0, None]
            self.total += entry[0]
            self.peak = max(self.peak, self.total)
        entry[1] += 1
        weakref.finalize(tensor, self._release, key)

    def _release(self, key: int) -> None:
        entry = self._live[key]
        entry[1] -= 1
        if entry[1] == 0:
            del self._live[key]  # the storage is gone (its bytes may still be held)
            self._drop(entry)

    def _drop(self, entry: list) -> None:
        if entry[1] == 0 and entry[2] == 0:
            self.total -= entry[0]
            if entry[3] is not None:  # a meta copy of a real tensor: its hold on the real one's bytes
                entry[3][2] -= 1
                self._drop(entry[3])


def on_one_device(args: tuple, kwargs: dict | None) -> tuple:
    """An operator's arguments with its real tensors on the meta device where it mixes them with meta ones."""
    leaves = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    meta = [t.device.type == "meta" for t in leaves]
    if all(meta) or not any(meta):
        return args, kwargs
    return tree_map_only(torch.Tensor, lambda t: t if t.device.type == "meta" else t.to("meta"), (args, kwargs))


def promotion_bytes(func, args: tuple, kwargs: dict | None) -> int:
    """Bytes of the temporaries a CPU elementwise operator makes while it runs when its floating-point tensors differ
    in dtype: a copy in the common dtype of each one of another dtype, and for an in-place operator on a tensor of
    another dtype, its result in the common dtype (then copied into it). The common dtype is that of the tensors with
    dimensions (a 0-dim one does not promote). Masks and indices (bool, integer) are read as they are."""
    tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.is_floating_point()]
    shaped = [t for t in tensors if t.dim() > 0] or tensors
    if len({t.dtype for t in shaped}) < 2:
        return 0
    common = shaped[0].dtype
    for tensor in shaped[1:]:
        common = torch.promote_types(common, tensor.dtype)
    copies = sum(t.numel() * common.itemsize for t in shaped if t.dtype != common)
    target = args[0] if func._schema.name.endswith("_") and args and isinstance(args[0], torch.Tensor) else None
    return copies + (target.numel() * common.itemsize if target is not None and target.dtype != common else 0)
