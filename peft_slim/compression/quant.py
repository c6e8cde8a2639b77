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
import sys
from dataclasses import dataclass, replace

import torch


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


# Packing works on `8 // bits` codes at once, viewed as one little-endian integer of that many bytes: shifting
# it by multiples of 8 - bits gathers (or spreads) the codes in a handful of whole-tensor ops.
_WIDE = {4: torch.int16, 2: torch.int32, 1: torch.int64}
_SPREAD_MASK = {4: 0x0F0F, 2: 0x03030303, 1: 0x0101010101010101}


def pack_bits(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes below ``2**bits`` into bytes, the first code in the lowest bits (zero-padded)."""
    if bits == 8:
        return codes
    per_byte = 8 // bits
    pad = -codes.numel() % per_byte
    if pad:
        codes = torch.cat([codes, codes.new_zeros(pad)])
    if sys.byteorder != "little":
        return _pack_slow(codes.view(-1, per_byte), bits)
    wide = codes.view(_WIDE[bits])  # byte i of each integer holds code i
    packed = wide.clone()
    for i in range(1, per_byte):
        packed |= wide >> (i * (8 - bits))
    return packed.to(torch.uint8)  # the low byte


def unpack_bits(packed: torch.Tensor, bits: int, count: int) -> torch.Tensor:
    """The first ``count`` uint8 codes of ``pack_bits``' output."""
    if bits == 8:
        return packed[:count]
    if sys.byteorder != "little":
        shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)
        return ((packed.unsqueeze(1) >> shifts) & (2**bits - 1)).view(-1)[:count]
    byte = packed.to(_WIDE[bits])
    wide = byte.clone()
    for i in range(1, 8 // bits):
        wide |= byte << (i * (8 - bits))
    return (wide & _SPREAD_MASK[bits]).view(torch.uint8)[:count]  # byte i of each integer: code i


def _pack_slow(columns: torch.Tensor, bits: int) -> torch.Tensor:
    packed = columns[:, 0].clone()
    for i in range(1, columns.shape[1]):
        packed |= columns[:, i] << (bits * i)
    return packed


def move(tensor: torch.Tensor, device: torch.device, non_blocking: bool) -> torch.Tensor:
    """``tensor`` on ``device``; a copy to the CPU goes to pinned memory so that it can run asynchronously."""
    if tensor.device == torch.device(device):
        return tensor
    if torch.device(device).type == "cpu" and non_blocking:
        target = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        return target.copy_(tensor, non_blocking=True)
    return tensor.to(device, non_blocking=non_blocking)
