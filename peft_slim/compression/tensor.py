"""One saved activation in its stored form: flattened in its own memory order (so restoring gives the same strides
without a reordering copy; slices are copied first), then pruned, quantized, offloaded; restored in reverse."""

from __future__ import annotations

import torch

from ..compat import storage_key
from .format import Quantized, move
from .prune import Positions, prune, unprune
from .quant import dequantize, quantize


class CompressedTensor:
    """What autograd keeps instead of a saved activation; ``decompress()`` rebuilds it."""

    __slots__ = ("shape", "dtype", "device", "order", "values", "positions", "__weakref__")

    def __init__(self, shape, dtype, device, order, values, positions):
        self.shape: torch.Size = shape
        self.dtype: torch.dtype = dtype
        self.device: torch.device = device
        self.order: list[int] = order  # the permutation that made the tensor contiguous (identity: a copy did)
        self.values: torch.Tensor | Quantized = values  # kept values, flat, in memory order
        self.positions: Positions | None = positions  # where the kept values go, if pruned

    @property
    def nbytes(self) -> int:
        """Bytes actually stored: the storages of every tensor held."""
        values = self.values
        stored = values.nbytes if isinstance(values, Quantized) else values.untyped_storage().nbytes()
        return stored + (self.positions.nbytes if self.positions is not None else 0)

    def decompress(self) -> torch.Tensor:
        values, positions = self.values, self.positions
        if values.device != self.device:  # offloaded: bring the (small) stored form back first
            values = values.to(self.device, non_blocking=True)
            positions = positions.to(self.device, non_blocking=True) if positions is not None else None
        flat = dequantize(values, self.dtype) if isinstance(values, Quantized) else values
        if positions is not None:
            flat = unprune(flat, positions)
        permuted = flat.view([self.shape[d] for d in self.order])
        return permuted.permute(sorted(range(len(self.order)), key=self.order.__getitem__))


def compress(
    tensor: torch.Tensor, bits: int | None, group_size: int, prune_ratio: float | None, offload: bool
) -> CompressedTensor | None:
    """Compress a floating-point ``tensor`` (under ``torch.no_grad()``, detached); None if it cannot be quantized."""
    order = sorted(range(tensor.dim()), key=lambda d: (-tensor.stride(d), -tensor.size(d)))  # the memory order
    flat = tensor.permute(order)
    if not flat.is_contiguous():  # no permutation makes it contiguous: copied, in its own order
        order, flat = list(range(tensor.dim())), tensor.contiguous()
    flat = flat.view(-1)
    positions = None
    if prune_ratio is not None and prune_ratio < 1.0:
        flat, positions = prune(flat, prune_ratio)
    row = None
    if positions is None:  # rows: the innermost dimension in memory (of more than one element)
        row = next((tensor.shape[d] for d in reversed(order) if tensor.shape[d] > 1), None)
    values = quantize(flat, bits, group_size, row) if bits is not None else flat
    if values is None:
        return None
    if offload and tensor.device.type != "cpu":
        non_blocking = tensor.device.type == "cuda"  # into pinned memory, overlapping the next kernels
        values = move(values, "cpu", non_blocking) if bits is None else values.to("cpu", non_blocking)
        positions = positions.to("cpu", non_blocking) if positions is not None else None
    elif isinstance(values, torch.Tensor) and storage_key(values) == storage_key(tensor):
        values = values.clone()  # never keep the original's storage alive
    return CompressedTensor(tensor.shape, tensor.dtype, tensor.device, order, values, positions)
