"""The quantized format that the torch path (``quant``) and the Triton kernels (``triton_kernels``) both produce
and read: :class:`Quantized`, the row-wise layout's statistics, and moving its tensors between devices."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from ..compat import storage_key


@dataclass(eq=False)
class Quantized:
    """A flat tensor of ``numel`` values as 8/4/2-bit codes plus one scale and minimum per group: packed codes beside
    ``scale`` and ``low``, or (``rowwise``) torch's fused row-wise layout, ``[groups, group_size + 8]`` bytes, each
    row a group's codes then its fp32 scale and minimum (``scale`` and ``low`` views into it)."""

    codes: torch.Tensor  # uint8
    scale: torch.Tensor  # [groups]
    low: torch.Tensor  # [groups]
    bits: int
    group_size: int
    numel: int
    rowwise: bool = False

    @property
    def nbytes(self) -> int:
        storages = {storage_key(t): t.untyped_storage() for t in (self.codes, self.scale, self.low)}
        return sum(storage.nbytes() for storage in storages.values())

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device, non_blocking: bool = False) -> Quantized:
        if self.rowwise:
            codes = move(self.codes, device, non_blocking)
            scale, low = row_stats(codes, self.group_size)
        else:
            codes, scale, low = (move(t, device, non_blocking) for t in (self.codes, self.scale, self.low))
        return replace(self, codes=codes, scale=scale, low=low)


def row_stats(rows: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Views of the fp32 scale and minimum that end each row of the row-wise layout."""
    stats = rows[:, group_size:].view(torch.float32)
    return stats[:, 0], stats[:, 1]


def move(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """``tensor`` on ``device``; a copy to the CPU goes to pinned memory so that it can run asynchronously."""
    if tensor.device == torch.device(device):
        return tensor
    if torch.device(device).type == "cpu" and non_blocking:
        target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return target.copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=non_blocking)
