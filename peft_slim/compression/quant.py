"""Per-group quantization of a flat tensor into packed 8/4/2-bit codes, and back.

Asymmetric (min/max) rather than symmetric (absmax) groups: many saved activations are one-sided
(softmax probabilities, SiLU outputs, log-probabilities), and a symmetric grid would spend half of its
codes on values that never occur; one extra fp32 per group buys a full bit there. Rounding is to
nearest (deterministic, the lowest error per value; unbiasedness over steps, which stochastic rounding
would buy, matters less than error within a step at 8 and 4 bits). Codes narrower than a byte are
packed 2 or 4 per byte, so the stored bytes really shrink. Scales and minima are fp32 (fp64 for fp64
input): a bf16 scale would add as much error as 8-bit rounding itself.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

from .packing import pack_bits, unpack_bits


@dataclass(eq=False)
class Quantized:
    """A flat tensor of ``numel`` values as packed codes plus one scale and one minimum per group."""

    codes: torch.Tensor  # uint8; 8 // bits codes per byte
    scale: torch.Tensor  # [groups]
    low: torch.Tensor  # [groups]
    bits: int
    group_size: int
    numel: int

    @property
    def nbytes(self) -> int:
        return sum(t.untyped_storage().nbytes() for t in (self.codes, self.scale, self.low))

    @property
    def device(self) -> torch.device:
        return self.codes.device

    def to(self, device: torch.device, non_blocking: bool = False) -> Quantized:
        codes, scale, low = (move(t, device, non_blocking) for t in (self.codes, self.scale, self.low))
        return replace(self, codes=codes, scale=scale, low=low)


def quantize(values: torch.Tensor, bits: int, group_size: int, row: int | None = None) -> Quantized | None:
    """Quantize a 1-D floating tensor: every value ends up within half a step of its group's grid.

    With ``row`` (the length of the rows ``values`` is made of), groups are resized so that none straddles
    two rows: rows (tokens, heads) can differ in scale by orders of magnitude, and a group spanning two
    would quantize the smaller one coarsely. None when a value is infinite, NaN or within a factor 2 of the
    dtype's largest (e.g. an additive attention mask, or a fully masked row's statistics): no grid
    represents it together with ordinary values, and the tensor is better kept as it is.
    """
    if row is not None:
        group_size = row_aligned_group(row, group_size)
    numel = values.numel()
    groups = -(-numel // group_size)
    if numel % group_size:  # pad the last group with a value it already holds: its range is unchanged
        values = torch.cat([values, values[-1:].expand(groups * group_size - numel)])
    grouped = values.view(groups, group_size)
    stat_dtype = torch.float64 if values.dtype == torch.float64 else torch.float32
    # (amin and amax are each several times faster than aminmax over the last dimension on CPU)
    low = grouped.amin(dim=1, keepdim=True).to(stat_dtype)
    high = grouped.amax(dim=1, keepdim=True).to(stat_dtype)
    # inf/NaN, or a masking sentinel near the dtype's limit (transformers writes finfo.min for -inf): any grid
    # spanning it would erase the ordinary values of its group. (One host sync on an accelerator.)
    if not torch.maximum(high.max(), -low.min()) < torch.finfo(values.dtype).max / 2:
        return None
    span = high - low
    span.clamp_(min=torch.finfo(stat_dtype).tiny)  # a constant group codes to 0
    levels = 2**bits - 1
    inverse = levels / span
    # round((x - low) / scale) as x * inverse + (0.5 - low * inverse), truncated by the uint8 cast. The
    # cancellation costs a few ulps of |x| * inverse, i.e. nothing above fp32's own resolution.
    bias = torch.addcmul(low.new_full((1, 1), 0.5), low, inverse, value=-1)
    codes = torch.empty(-(-groups * group_size * bits // 8), dtype=torch.uint8, device=values.device)
    scratch = None
    for start, stop in _chunks(groups, group_size):
        scratch = _scratch(scratch, stop - start, group_size, stat_dtype, values.device)
        work = torch.mul(grouped[start:stop], inverse[start:stop], out=scratch[: stop - start])
        work.add_(bias[start:stop])  # in [0, levels + 0.5] up to float error
        packed = pack_bits(work.view(-1).to(torch.uint8), bits)
        codes[start * group_size * bits // 8 :][: packed.numel()].copy_(packed)
    return Quantized(codes, (span / levels).view(-1), low.view(-1), bits, group_size, numel)


def dequantize(quantized: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D tensor of ``quantized.numel`` values in ``dtype``."""
    q = quantized
    groups = q.scale.numel()
    out = torch.empty(groups, q.group_size, dtype=dtype, device=q.codes.device)
    scratch = None
    for start, stop in _chunks(groups, q.group_size):
        first, end = start * q.group_size * q.bits // 8, -(-stop * q.group_size * q.bits // 8)
        codes = unpack_bits(q.codes[first:end], q.bits, (stop - start) * q.group_size).view(-1, q.group_size)
        target = out[start:stop]
        if dtype != q.scale.dtype:  # compute in fp32, round once into the output dtype
            scratch = _scratch(scratch, stop - start, q.group_size, q.scale.dtype, out.device)
            target = scratch[: stop - start]
        target.copy_(codes).mul_(q.scale[start:stop, None]).add_(q.low[start:stop, None])
        if dtype != q.scale.dtype:
            out[start:stop].copy_(target)
    return out.view(-1)[: q.numel]


# Work in chunks of about this many values: the fp32 temporaries stay bounded (16 MB, not the size of the
# tensor: off an accelerator's peak, and no fresh pages to fault in on a CPU), with few ops per tensor.
CHUNK = 1 << 22


def _chunks(groups: int, group_size: int):
    """(first group, end group) of each chunk; chunk boundaries fall on whole bytes of packed codes."""
    step = max(8, CHUNK // group_size // 8 * 8)
    return [(start, min(start + step, groups)) for start in range(0, groups, step)]


def _scratch(scratch, rows: int, group_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    if scratch is None or scratch.shape[0] < rows:
        scratch = torch.empty(rows, group_size, dtype=dtype, device=device)
    return scratch


@functools.cache
def row_aligned_group(row: int, group_size: int) -> int:
    """The group size nearest below ``group_size`` that tiles rows of length ``row`` (whole rows if shorter)."""
    if row <= group_size:
        return row * (group_size // row)
    for size in range(group_size, group_size // 2, -1):
        if row % size == 0:
            return size
    return group_size  # no divisor within a factor of 2: keep the size, a few groups straddle rows


def move(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """``tensor`` on ``device``; a copy to the CPU goes to pinned memory so that it can run asynchronously."""
    if tensor.device == torch.device(device):
        return tensor
    if torch.device(device).type == "cpu" and non_blocking:
        target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return target.copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=non_blocking)
