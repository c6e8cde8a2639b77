"""Magnitude pruning of a flat tensor: keep the largest values and where they were, as a bitmask or int32 indices,
whichever is smaller."""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import torch

from .format import move
from .packing import pack_bits, unpack_bits


@dataclass(eq=False)
class Positions:
    """Where the kept values of a flat tensor of ``numel`` values go, as a packed bitmask or int32 indices."""

    data: torch.Tensor
    is_mask: bool
    numel: int

    @property
    def nbytes(self) -> int:
        return self.data.untyped_storage().nbytes()

    def to(self, device: torch.device, non_blocking: bool = False) -> Positions:
        return replace(self, data=move(self.data, device, non_blocking))


def prune(values: torch.Tensor, ratio: float) -> tuple[torch.Tensor, Positions]:
    """The ``ceil(ratio * n)`` values of largest magnitude (in their original order) and their positions."""
    numel = values.numel()
    keep = max(1, math.ceil(ratio * numel))
    index = values.abs().topk(keep, sorted=False).indices.sort().values
    if numel < 2**31 and keep * 4 < -(-numel // 8):  # int32 indices are smaller than the bitmask
        return values[index], Positions(index.to(torch.int32), False, numel)
    mask = torch.zeros(numel, dtype=torch.bool, device=values.device)
    mask[index] = True
    # (the kept values by sorted index, as values[mask] gives them, but of a size known without the data)
    return values[index], Positions(pack_bits(mask.view(torch.uint8), 1), True, numel)


def unprune(kept: torch.Tensor, positions: Positions) -> torch.Tensor:
    """A flat tensor of ``positions.numel`` zeros with ``kept`` written back in place."""
    out = kept.new_zeros(positions.numel)
    if positions.is_mask:
        out[unpack_bits(positions.data, 1, positions.numel).bool()] = kept
    else:
        out[positions.data.long()] = kept
    return out
