"""Packing, quantization, pruning and the stored form of one tensor: error bounds and bytes really stored."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import peft_slim.compression.quant as quant
from peft_slim.compression.packing import pack_bits, unpack_bits
from peft_slim.compression.prune import prune, unprune
from peft_slim.compression.quant import _rowwise_kernels, dequantize, quantize, row_aligned_group
from peft_slim.compression.tensor import compress

DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative error of rounding the dequantized fp32 value to the output dtype, plus fp32 ulps.
OUTPUT_ROUNDING = {torch.float32: 2**-20, torch.bfloat16: 2**-8, torch.float16: 2**-10}


def _stored(quantized) -> int:
    """Bytes of the distinct storages held (the row-wise layout keeps scales and minima inside its rows)."""
    storages = {
        t.untyped_storage().data_ptr(): t.untyped_storage() for t in (quantized.codes, quantized.scale, quantized.low)
    }
    return sum(storage.nbytes() for storage in storages.values())


@given(
    bits=st.sampled_from([1, 2, 4, 8]),
    count=st.integers(1, 300),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=40, deadline=None)
def test_pack_bits_round_trips_and_packs_densely(bits, count, seed):
    generator = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 2**bits, (count,), generator=generator, dtype=torch.uint8)
    packed = pack_bits(codes, bits)
    assert packed.dtype == torch.uint8
    assert packed.numel() == -(-count * bits // 8)
    assert torch.equal(unpack_bits(packed, bits, count), codes)


@given(
    bits=st.sampled_from([8, 4, 2]),
    group_size=st.sampled_from([8, 32, 128]),
    numel=st.integers(1, 2000),
    scale=st.floats(1e-3, 1e3),
    offset=st.floats(-10, 10),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=60, deadline=None)
def test_quantize_error_is_at_most_half_a_step_of_its_group(bits, group_size, numel, scale, offset, dtype, seed):
    generator = torch.Generator().manual_seed(seed)
    values = (torch.randn(numel, generator=generator) * scale + offset * scale).to(dtype)
    quantized = quantize(values, bits, group_size)
    restored = dequantize(quantized, dtype)
    assert restored.dtype == dtype and restored.shape == values.shape
    exact = values.double()
    error = (restored.double() - exact).abs()
    # Each value's group step is (max - min) / (2**bits - 1) over its group; the grid is within half of it.
    step = quantized.scale.double().repeat_interleave(quantized.group_size)[:numel]
    # (the output rounding is relative to the rounded value, which may be larger than the exact one)
    magnitude = torch.maximum(exact.abs(), restored.double().abs())
    bound = step / 2 * (1 + 1e-4) + magnitude * OUTPUT_ROUNDING[dtype] * 2 + 1e-30
    assert (error <= bound).all(), (error - bound).max()
    groups = -(-numel // quantized.group_size)
    assert _stored(quantized) == quantized.nbytes == -(-groups * quantized.group_size * bits // 8) + groups * 8


@pytest.mark.parametrize("bits", [8, 4, 2])
@pytest.mark.parametrize("dtype", DTYPES)
def test_stored_bytes_shrink_as_the_bits(bits, dtype):
    values = torch.randn(64 * 1024).to(dtype)
    quantized = quantize(values, bits, 128)
    original = values.untyped_storage().nbytes()
    stored = _stored(quantized)
    # codes at `bits` per value plus an fp32 scale and minimum per 128 values
    assert stored == values.numel() * bits // 8 + 2 * 4 * values.numel() // 128
    assert stored / original <= bits / (8 * values.element_size()) + 8 / (128 * values.element_size())


@pytest.mark.parametrize("dtype", DTYPES)
def test_constant_groups_are_exact_and_infinities_and_sentinels_are_refused(dtype):
    values = torch.full((256,), 3.25, dtype=dtype)
    assert torch.equal(dequantize(quantize(values, 2, 64), dtype), values)
    for sentinel in (float("-inf"), float("nan"), torch.finfo(dtype).min):  # e.g. an additive attention mask
        mask = torch.zeros(256, dtype=dtype)
        mask[10] = sentinel
        assert quantize(mask, 8, 64) is None
    assert quantize(torch.full((256,), torch.finfo(dtype).max / 4, dtype=dtype), 8, 64) is not None


@pytest.mark.parametrize("dtype", DTYPES)
def test_8bit_groups_of_every_range_get_their_own_full_grid(dtype):
    """Also through the CPU's fused row-wise kernel, whose epsilon would coarsen very narrow groups."""
    values = torch.randn(64, 128)
    values[::3] *= 1e-7  # narrow groups (exactly representable in every dtype up to the output rounding)
    values = values.to(dtype)
    quantized = quantize(values.view(-1), 8, 128)
    assert quantized.rowwise == (_rowwise_kernels() is not None)  # on the CPU, where the kernel is present
    restored = dequantize(quantized, dtype).view(64, 128).double()
    exact = values.double()
    span = exact.amax(dim=1, keepdim=True) - exact.amin(dim=1, keepdim=True)
    bound = span / 255 / 2 * (1 + 1e-4) + torch.maximum(exact.abs(), restored.abs()) * OUTPUT_ROUNDING[dtype] * 2
    assert ((restored - exact).abs() <= bound).all()
    bad = values.clone()
    bad[5, 7] = float("nan")
    assert quantize(bad.view(-1), 8, 128) is None


def test_groups_follow_rows_so_a_large_row_does_not_coarsen_a_small_one():
    assert row_aligned_group(576, 128) == 96  # 6 groups per row of 576, none straddling two rows
    assert row_aligned_group(1536, 128) == 128
    assert row_aligned_group(32, 128) == 128  # four whole rows
    rows = torch.randn(8, 96)
    rows[0] *= 1000  # e.g. an attention-sink token
    restored = dequantize(quantize(rows.view(-1), 4, 128, row=96), torch.float32).view(8, 96)
    small_error = (restored[1:] - rows[1:]).abs().max()
    assert small_error <= (rows[1:].max() - rows[1:].min()) / 15  # set by the small rows' own range


# (bits, row-wise layout, dtype, row length): the row-wise kernel takes fp32/bf16/fp16 groups of a multiple of 4
_CHUNKED = [(8, True, dtype, None) for dtype in DTYPES] + [
    (bits, False, dtype, row) for bits in (8, 4, 2) for dtype in (*DTYPES, torch.float64) for row in (None, 27)
]


@pytest.mark.parametrize("bits, rowwise, dtype, row", _CHUNKED, ids=str)
def test_a_tensor_spanning_several_chunks_is_coded_as_in_one(monkeypatch, bits, rowwise, dtype, row):
    """Every loop over chunks of groups (quantize, the row-wise bf16 prepack, dequantize in both layouts) must
    read and write each chunk's own groups. Real chunks hold 4M values; a smaller chunk size makes a small
    tensor span four of them (the last partial, with a partial last group) and must change no bit. Rows of 27
    values give groups of 27, which end mid-byte at 4 and 2 bits: chunks must still end on whole bytes."""
    if rowwise and _rowwise_kernels() is None:
        pytest.skip("this torch build has no row-wise 8-bit kernel")
    if not rowwise:
        monkeypatch.setattr(quant, "_rowwise_applies", lambda *args: False)
    group_size, groups = row or 32, 29
    generator = torch.Generator().manual_seed(0)
    values = torch.randn(groups, group_size, generator=generator, dtype=torch.float64)
    # each group its own range, from 1e-5 (narrow: the row-wise path redoes these groups the packed way) to 10
    values *= 10.0 ** (torch.arange(groups, dtype=torch.float64) % 7 - 5)[:, None]
    values = values.view(-1)[:-5].to(dtype)
    whole = quantize(values, bits, 32, row=row)  # one chunk
    assert whole.group_size == group_size
    restored = dequantize(whole, dtype)
    monkeypatch.setattr(quant, "CHUNK", 9 * group_size)  # 8 groups a chunk (9 would split a byte at 27 values)
    assert len(quant._chunks(groups, group_size)) == 4
    chunked = quantize(values, bits, 32, row=row)
    assert chunked.rowwise == whole.rowwise == rowwise
    for name in ("codes", "scale", "low"):
        assert torch.equal(getattr(chunked, name), getattr(whole, name)), name
    assert torch.equal(dequantize(chunked, dtype), restored)
    # and that one chunk is right: within half a step, plus the output dtype's rounding (subnormals included)
    step = whole.scale.double().repeat_interleave(group_size)[: values.numel()]
    rounding = values.double().abs() * 2**-7 + torch.finfo(dtype).tiny * torch.finfo(dtype).eps
    assert ((restored.double() - values.double()).abs() <= step * 0.51 + rounding).all()


@given(
    ratio=st.sampled_from([0.01, 0.1, 0.5, 1.0]),
    numel=st.integers(1, 3000),
    seed=st.integers(0, 2**16),
)
@settings(max_examples=30, deadline=None)
def test_prune_keeps_exactly_the_largest_magnitudes(ratio, numel, seed):
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(numel, generator=generator)
    kept, positions = prune(values, ratio)
    restored = unprune(kept, positions)
    nonzero = restored != 0
    assert int(nonzero.sum()) == kept.numel() == max(1, math.ceil(ratio * numel))
    assert torch.equal(restored[nonzero], values[nonzero])  # kept values are exact
    if kept.numel() < numel:
        assert values[~nonzero].abs().max() <= values[nonzero].abs().min()


@pytest.mark.parametrize("ratio", [0.01, 0.1])
def test_pruned_positions_use_the_smaller_of_bitmask_and_indices(ratio):
    values = torch.randn(100_000)
    kept, positions = prune(values, ratio)
    assert positions.is_mask == (ratio == 0.1)
    assert positions.nbytes == min(100_000 // 8, kept.numel() * 4)
    packed = compress(values.view(100, 1000), 8, 128, ratio, offload=False)
    assert packed.nbytes < 0.2 * values.untyped_storage().nbytes()


@pytest.mark.parametrize("dtype", DTYPES)
def test_compressed_tensor_restores_dtype_shape_and_strides(dtype):
    base = torch.randn(4, 6, 10, 16).to(dtype)
    for tensor in (base, base.transpose(1, 2), base.permute(0, 2, 3, 1), base[:, :, 2:7]):
        packed = compress(tensor, 8, 32, None, offload=True)  # offload is a no-op on CPU
        restored = packed.decompress()
        assert restored.dtype == dtype and restored.shape == tensor.shape and restored.device == tensor.device
        if tensor.is_contiguous() or tensor.permute(*_memory_order(tensor)).is_contiguous():
            assert restored.stride() == tensor.stride()
        step = (tensor.float().max() - tensor.float().min()) / 255
        assert (restored.float() - tensor.float()).abs().max() <= step / 2 + tensor.float().abs().max() * 2**-7
        assert packed.nbytes < tensor.numel() * tensor.element_size()


def test_compressed_tensor_does_not_keep_the_original_alive():
    tensor = torch.randn(64, 64)
    for bits, ratio in ((4, None), (None, 0.5), (None, None)):
        packed = compress(tensor, bits, 32, ratio, False)
        storages = [packed.values.codes if hasattr(packed.values, "codes") else packed.values]
        assert all(s.untyped_storage().data_ptr() != tensor.untyped_storage().data_ptr() for s in storages)


def _memory_order(tensor):
    return sorted(range(tensor.dim()), key=lambda d: -tensor.stride(d))


@pytest.mark.cuda
def test_offload_keeps_the_stored_form_on_the_cpu_and_restores_on_cuda():
    tensor = torch.randn(256, 256, device="cuda")
    packed = compress(tensor, 4, 64, None, offload=True)
    assert packed.values.codes.device.type == "cpu" and packed.values.codes.is_pinned()
    restored = packed.decompress()
    assert restored.device == tensor.device
    assert (restored - tensor).abs().max() <= (tensor.max() - tensor.min()) / 15
