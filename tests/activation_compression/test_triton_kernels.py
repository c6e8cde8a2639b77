"""The Triton compression kernels produce the torch path's codes, scales, minima and decoded values bit for bit.

``test_kernels_under_the_interpreter`` runs the interpreted tests of this file on CPU tensors under Triton's
interpreter (tests/helpers/triton_interpreter.py). The reference is ``quant._quantize_packed`` /
``quant.dequantize``, the path CUDA tensors took before the kernels (the CPU path stays the only one on CPU). The
``cuda`` tests check the compiled kernels on a GPU.
"""

from __future__ import annotations

import pytest
import torch
from helpers.triton_interpreter import HAS_TRITON, INTERPRETED, only_interpreted, run_file, runs_the_file
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peft_slim.compression import quant
from peft_slim.compression.quant import _quantize_packed, dequantize

interpreted = only_interpreted("test_kernels_under_the_interpreter")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@runs_the_file
def test_kernels_under_the_interpreter():
    run_file(__file__)


def test_the_cpu_path_never_uses_the_kernels():
    assert quant._fused_kernels(torch.device("cpu")) is None


# ------------------------------------------------------------------------------------------ the comparison


def assert_same(values: torch.Tensor, bits: int, group_size: int, kernels) -> None:
    expected = _quantize_packed(values, bits, group_size)
    got = kernels.quantize(values, bits, group_size)
    if expected is None:  # inf, NaN, or near the dtype's limit: kept as it is, by both
        assert got is None
        return
    assert got is not None
    for name in ("bits", "group_size", "numel", "rowwise"):
        assert getattr(got, name) == getattr(expected, name), name
    for name in ("codes", "scale", "low"):
        want, have = getattr(expected, name), getattr(got, name)
        assert have.dtype == want.dtype and have.shape == want.shape, name
        assert torch.equal(have, want), f"{name} differ at {(have != want).nonzero().flatten()[:8].tolist()}"
    for dtype in DTYPES:
        if not kernels.supported(dtype, bits, group_size):
            continue
        want = dequantize(expected, dtype)
        have = kernels.dequantize(expected, dtype)
        assert have.dtype == dtype and have.shape == want.shape
        assert torch.equal(have, want), f"decoded {dtype} differ at {(have != want).nonzero().flatten()[:8].tolist()}"


def _kernels():
    from peft_slim.compression import triton_kernels

    return triton_kernels


SPECIALS = {
    "zeros": 0.0,
    "one": 1.0,
    "negative zero": -0.0,
    "inf": float("inf"),
    "-inf": float("-inf"),
    "nan": float("nan"),
    "huge": 3.0e38,  # above half of fp32's (and, cast, beyond bf16/fp16's) largest
}


@st.composite
def cases(draw):
    bits = draw(st.sampled_from([8, 4, 2]))
    per_byte = 8 // bits
    group_size = draw(st.sampled_from([g for g in (1, 2, 3, 4, 5, 8, 12, 16, 24, 40, 64, 128) if g % per_byte == 0]))
    numel = draw(st.integers(1, 3 * group_size + 40))
    dtype = draw(st.sampled_from(DTYPES))
    seed = draw(st.integers(0, 2**16))
    generator = torch.Generator().manual_seed(seed)
    scale = 10.0 ** draw(st.integers(-6, 4))
    offset = draw(st.sampled_from([0.0, 1.0, -300.0, 1e4]))
    values = torch.randn(numel, generator=generator) * scale + offset
    if draw(st.booleans()):  # one-sided values, as after softmax or SiLU
        values = values.abs()
    if draw(st.booleans()):  # a constant stretch: constant groups code to 0
        start = draw(st.integers(0, numel - 1))
        values[start : start + group_size * 2] = draw(st.sampled_from([0.0, 1.0, -2.5]))
    special = draw(st.sampled_from([None, None, *SPECIALS]))
    if special is not None:
        values[draw(st.integers(0, numel - 1))] = SPECIALS[special]
    return values.to(dtype), bits, group_size


@interpreted
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(cases())
def test_kernels_match_the_torch_path(case):
    values, bits, group_size = case
    assert_same(values, bits, group_size, _kernels())


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_edge_values(dtype, bits):
    kernels = _kernels()
    group = 8
    info = torch.finfo(dtype)
    for values in (
        torch.zeros(20),
        torch.full((20,), -3.0),
        torch.tensor([0.0] * 8 + [1.0] * 8 + [-1.0, 1.0] * 4),
        torch.linspace(-1, 1, 37),
        torch.tensor([info.tiny, -info.tiny, 0.0, info.tiny * 3] * 4),
        torch.tensor([info.max / 4, -info.max / 4] + [1.0] * 14),  # large but representable
        torch.tensor([info.max / 2] + [1.0] * 15),  # at the limit: kept as it is
        torch.tensor([1.0] * 15 + [float("nan")]),
        torch.tensor([float("inf")] + [1.0] * 15),
    ):
        assert_same(values.to(dtype), bits, group, kernels)


@interpreted
def test_multiple_programs_and_a_partial_last_group():
    kernels = _kernels()
    values = torch.randn(5 * 2048 + 77, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)
    for bits, group in ((8, 128), (4, 256), (2, 8)):
        assert_same(values, bits, group, kernels)


# ------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="compiled kernels only")
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bits", [8, 4, 2])
def test_compiled_kernels_on_cuda(dtype, bits):
    """On CUDA, quantize() dispatches to the kernels, whose output equals the torch path run on the same tensor."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(bits)
    for numel, group in ((1, 8), (1000, 8), (4096 * 3 + 5, 128), (1 << 20, 128), (99_999, 1024)):
        values = (torch.randn(numel, generator=generator) * 3).to(dtype).cuda()
        assert kernels.applies(values, bits, group)
        assert_same(values, bits, group, kernels)
        fused = quant.quantize(values, bits, group)
        assert torch.equal(fused.codes, _quantize_packed(values, bits, group).codes)
        assert torch.equal(quant.dequantize(fused, dtype), kernels.dequantize(fused, dtype))
    # and the CPU path agrees where it takes the same (packed) route
    cpu = values.cpu()
    assert torch.equal(kernels.quantize(values, bits, 128).codes.cpu(), _quantize_packed(cpu, bits, 128).codes)


@interpreted
@pytest.mark.parametrize("dtype", DTYPES)
def test_ties_round_as_the_torch_path(dtype):
    """Coarse values put many of them exactly half-way between two codes, where one rounding more or less (a fused
    multiply-add, an exact division instead of torch's reciprocal) flips the code."""
    kernels = _kernels()
    generator = torch.Generator().manual_seed(1)
    values = (torch.randint(-40, 41, (1 << 15,), generator=generator) / 8 + 0.1).to(dtype)
    for bits, group in ((8, 8), (4, 8), (4, 24), (2, 16)):
        assert_same(values, bits, group, kernels)
