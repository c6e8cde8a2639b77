"""Fused group quantisation on CUDA (Triton): each group read once into registers, quantised and packed in one pass
(the torch path reads a tensor five times); and back. The same codes bit for bit as the torch path (the same fp32
operations in the same order, no fused multiply-add but its ``addcmul``'s), for CUDA fp32/bf16/fp16 tensors with
whole bytes of codes per group and at most ``MAX_GROUP`` values; ``quant`` keeps the torch path otherwise.
"""

from __future__ import annotations

import os

import torch

from .format import Quantized

try:
    import triton
    import triton.language as tl
except ImportError:  # no Triton (a CPU-only or non-Linux PyTorch build): quant keeps the torch path
    triton = None

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
MAX_GROUP = 4096  # one group lives in one program's registers
_TILE = 2048  # values per program: several small groups at once


def applies(values: torch.Tensor, bits: int, group_size: int) -> bool:
    """Whether the kernels quantise ``values`` (1-D) at ``bits`` with ``group_size``: CUDA, a supported shape."""
    return values.device.type == "cuda" and supported(values.dtype, bits, group_size) and values.numel() > 0


def supported(dtype: torch.dtype, bits: int, group_size: int) -> bool:
    return dtype in FLOATS and bits in (8, 4, 2) and group_size * bits % 8 == 0 and group_size <= MAX_GROUP


def quantize(values: torch.Tensor, bits: int, group_size: int):
    """``quant._quantize_packed(values, bits, group_size)``, in one kernel (plus the same finiteness check)."""
    numel, groups = values.numel(), -(-values.numel() // group_size)
    codes = torch.empty(groups * group_size * bits // 8, dtype=torch.uint8, device=values.device)
    scale, low, high = (torch.empty(groups, dtype=torch.float32, device=values.device) for _ in range(3))
    _launch(_quantize_kernel, (values, codes, scale, low, high), numel, groups, group_size, bits, _INTERPRETED)
    # as the torch path: inf, NaN or a masking sentinel near the dtype's limit -> None (one host sync)
    if not torch.maximum(high.max(), -low.min()) < torch.finfo(values.dtype).max / 2:
        return None
    return Quantized(codes, scale, low, bits, group_size, numel)


def dequantize(quantized, dtype: torch.dtype) -> torch.Tensor:
    """``quant.dequantize(quantized, dtype)`` for a packed ``Quantized`` that ``supported`` accepts, in one kernel."""
    q, bf16 = quantized, dtype == torch.bfloat16
    out = torch.empty(q.numel, dtype=dtype, device=q.codes.device)
    tensors = (q.codes, q.scale, q.low, out.view(torch.int16) if bf16 else out)
    _launch(_dequantize_kernel, tensors, q.numel, q.scale.numel(), q.group_size, q.bits, bf16)
    return out


def _launch(kernel, tensors: tuple, numel: int, groups: int, group_size: int, bits: int, flag: bool) -> None:
    """Either kernel over ``groups`` groups, several small ones per program, each padded to a power of two."""
    block = 1 << (group_size - 1).bit_length()
    per_program = max(1, _TILE // block)
    grid = (-(-groups // per_program),)
    kernel[grid](*tensors, numel, groups, group_size, block, per_program, bits, flag, enable_fp_fusion=False)


def dequantizes(quantized, dtype: torch.dtype) -> bool:
    """Whether the kernels decode ``quantized`` into ``dtype``."""
    q = quantized
    cuda = q.codes.device.type == "cuda"
    return not q.rowwise and cuda and q.scale.dtype == torch.float32 and supported(dtype, q.bits, q.group_size)


# Triton's interpreter (``TRITON_INTERPRET=1`` when Triton is imported; the tests) runs the kernels on CPU tensors.
_INTERPRETED = os.environ.get("TRITON_INTERPRET", "0") == "1"

if triton is not None:  # the kernels, defined only where Triton imports

    @triton.jit
    def _divide(a, b, INTERPRETED: tl.constexpr):
        """IEEE fp32 division, as torch's: ``div_rn`` compiled (``/`` is approximate there), ``/`` interpreted
        (numpy's, exact; the interpreter's ``div_rn`` is not)."""
        if INTERPRETED:
            return a / b
        return tl.math.div_rn(a, b)

    @triton.jit
    def _quantize_kernel(
        x_ptr,
        codes_ptr,
        scale_ptr,
        low_ptr,
        high_ptr,
        numel,
        groups,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        BITS: tl.constexpr,
        INTERPRETED: tl.constexpr,
    ):
        PER_BYTE: tl.constexpr = 8 // BITS
        LEVELS: tl.constexpr = (1 << BITS) - 1
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        cols = tl.arange(0, BLOCK)
        row_ok = rows < groups
        col_ok = cols < GROUP
        index = rows[:, None].to(tl.int64) * GROUP + cols[None, :]
        index = tl.minimum(index, numel - 1)  # the last group is padded with its last value
        x = tl.load(x_ptr + index, mask=row_ok[:, None] & col_ok[None, :], other=0.0).to(tl.float32)
        low = tl.min(tl.where(col_ok[None, :], x, float("inf")), axis=1)
        high = tl.max(tl.where(col_ok[None, :], x, float("-inf")), axis=1)
        nan = tl.max((x != x).to(tl.int32), axis=1) > 0  # a reduction may skip NaN: flag it as the check needs
        high = tl.where(nan, float("inf"), high)
        span = tl.maximum(high - low, 1.1754943508222875e-38)  # clamp at fp32's tiny: a constant group codes to 0
        # torch's `levels / span` is `span.reciprocal() * levels`: two roundings
        inverse = _divide(tl.full((ROWS,), 1.0, tl.float32), span, INTERPRETED) * LEVELS
        bias = tl.fma(-low, inverse, 0.5)  # torch's addcmul rounds once
        work = x * inverse[:, None] + bias[:, None]  # two roundings (no fp fusion), as mul then add_
        codes = work.to(tl.int32) & 0xFF  # truncation, then the low byte, as torch's float -> uint8 cast
        # pack_bits: the codes of a byte as one little-endian integer, OR-ed with itself shifted by 8 - bits
        grouped = tl.reshape(codes.to(tl.int64), (ROWS, BLOCK // PER_BYTE, PER_BYTE))
        lanes = tl.arange(0, PER_BYTE).to(tl.int64)
        wide = tl.sum(grouped << (lanes * 8)[None, None, :], axis=2)
        packed = wide
        for i in tl.static_range(1, PER_BYTE):
            packed = packed | (wide >> (i * (8 - BITS)))
        byte_cols = tl.arange(0, BLOCK // PER_BYTE)
        out = rows[:, None].to(tl.int64) * (GROUP // PER_BYTE) + byte_cols[None, :]
        ok = row_ok[:, None] & (byte_cols < GROUP // PER_BYTE)[None, :]
        tl.store(codes_ptr + out, (packed & 0xFF).to(tl.uint8), mask=ok)
        tl.store(scale_ptr + rows, _divide(span, tl.full((ROWS,), LEVELS, tl.float32), INTERPRETED), mask=row_ok)
        tl.store(low_ptr + rows, low, mask=row_ok)
        tl.store(high_ptr + rows, high, mask=row_ok)

    @triton.jit
    def _dequantize_kernel(
        codes_ptr,
        scale_ptr,
        low_ptr,
        out_ptr,
        numel,
        groups,
        GROUP: tl.constexpr,
        BLOCK: tl.constexpr,
        ROWS: tl.constexpr,
        BITS: tl.constexpr,
        BF16_BITS: tl.constexpr,
    ):
        PER_BYTE: tl.constexpr = 8 // BITS
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        row_ok = rows < groups
        byte_cols = tl.arange(0, BLOCK // PER_BYTE)
        source = rows[:, None].to(tl.int64) * (GROUP // PER_BYTE) + byte_cols[None, :]
        byte_ok = row_ok[:, None] & (byte_cols < GROUP // PER_BYTE)[None, :]
        packed = tl.load(codes_ptr + source, mask=byte_ok, other=0).to(tl.int32)
        lanes = tl.arange(0, PER_BYTE)
        codes = (packed[:, :, None] >> (lanes * BITS)[None, None, :]) & ((1 << BITS) - 1)
        codes = tl.reshape(codes, (ROWS, BLOCK))
        scale = tl.load(scale_ptr + rows, mask=row_ok, other=0.0)
        low = tl.load(low_ptr + rows, mask=row_ok, other=0.0)
        values = codes.to(tl.float32) * scale[:, None] + low[:, None]  # fp32, rounded after each step
        cols = tl.arange(0, BLOCK)
        index = rows[:, None].to(tl.int64) * GROUP + cols[None, :]
        ok = row_ok[:, None] & (cols < GROUP)[None, :] & (index < numel)
        if BF16_BITS:  # bf16 written as its bits, rounded to nearest even by hand (the interpreter's cast is not)
            raw = values.to(tl.uint32, bitcast=True)
            raw = (raw + 0x7FFF + ((raw >> 16) & 1)) >> 16
            tl.store(out_ptr + index, raw.to(tl.int16), mask=ok)
        else:
            tl.store(out_ptr + index, values.to(out_ptr.dtype.element_ty), mask=ok)
