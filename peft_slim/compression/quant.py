"""Per-group quantization of a flat tensor into packed 8/4/2-bit codes, and back.

Asymmetric (min/max) groups: many saved activations are one-sided (softmax probabilities, SiLU outputs), where a
symmetric grid would waste half its codes. Rounding to nearest: the lowest error per value, which matters more than
stochastic rounding's unbiasedness at 8 and 4 bits. Scales and minima are fp32 (fp64 for fp64): a bf16 scale would
add as much error as 8-bit rounding. The same codes come from torch's fused row-wise kernel (8 bits on the CPU, one
pass over memory) and from the Triton kernels on CUDA (checked against this path first: ``kernels_usable``).
"""

from __future__ import annotations

import functools
import threading
import warnings

import torch

from ..compat import is_fake_tensor, outside_fake_mode, rowwise_byte_kernels, run_device_type
from . import triton_kernels
from .format import Quantized, row_stats
from .packing import pack_bits, unpack_bits


def quantize(values: torch.Tensor, bits: int, group_size: int, row: int | None = None) -> Quantized | None:
    """Quantize a 1-D floating tensor: every value within half a step of its group's grid. With ``row`` (the length
    of its rows), no group straddles two rows (tokens, heads: their scales can differ by orders of magnitude). None
    when a value is inf, NaN or within a factor 2 of the dtype's largest (an additive mask): keep the tensor."""
    if row is not None:
        group_size = row_aligned_group(row, group_size)
    if bits == 8 and _rowwise_applies(values, group_size):
        return _quantize_rowwise(values, group_size)
    fused = _fused_kernels(values.device)
    if fused is not None and fused.applies(values, bits, group_size) and _kernels_serve(values, values.dtype):
        return fused.quantize(values, bits, group_size)  # the same codes in one pass over memory
    return _quantize_packed(values, bits, group_size)


def dequantize(quantized: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The 1-D tensor of ``quantized.numel`` values in ``dtype``."""
    q = quantized
    if q.rowwise and dtype == torch.float32:
        return _rowwise_kernels()[1](q.codes).view(-1)[: q.numel]
    fused = _fused_kernels(q.codes.device)
    if fused is not None and fused.dequantizes(q, dtype) and _kernels_serve(q.codes, dtype):
        return fused.dequantize(q, dtype)
    return _dequantize_packed(q, dtype)


def _dequantize_packed(q: Quantized, dtype: torch.dtype) -> torch.Tensor:
    """The torch path: unpack, scale and shift a chunk at a time in the scales' dtype (row-wise: torch's kernel)."""
    groups = q.scale.numel()
    out = torch.empty(groups, q.group_size, dtype=dtype, device=q.codes.device)
    scratch = None
    for start, stop in _chunks(groups, q.group_size, q.codes):
        if q.rowwise:  # an fp32 chunk at a time, rounded once
            out[start:stop].copy_(_rowwise_kernels()[1](q.codes[start:stop]))
            continue
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


def _quantize_packed(values: torch.Tensor, bits: int, group_size: int) -> Quantized | None:
    """Any width, dtype and device, in whole-chunk ops: min, max, scale and shift, round, pack."""
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
    if not _representable(high.max(), low.min(), values):
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
    for start, stop in _chunks(groups, group_size, values):
        scratch = _scratch(scratch, stop - start, group_size, stat_dtype, values.device)
        work = torch.mul(grouped[start:stop], inverse[start:stop], out=scratch[: stop - start])
        work.add_(bias[start:stop])  # in [0, levels + 0.5] up to float error
        target = codes[start * group_size * bits // 8 :]
        if bits == 8:  # the cast truncates straight into the codes: no uint8 temporary
            target[: work.numel()].view_as(work).copy_(work)
        else:
            packed = pack_bits(work.view(-1).to(torch.uint8), bits)
            target[: packed.numel()].copy_(packed)
    return Quantized(codes, (span / levels).view(-1), low.view(-1), bits, group_size, numel)


# torch's fused row-wise 8-bit kernel (FBGEMM's on x86) rounds (x - min) * 255 / (range + 1e-8).
_ROWWISE_EPSILON = 1e-8
# Below this range the epsilon would make a group's step over 1e-4 coarser than range / 255: such groups are
# redone the packed way.
_ROWWISE_MIN_RANGE = 1e-4


def _rowwise_applies(values: torch.Tensor, group_size: int) -> bool:
    return (
        run_device_type(values) == "cpu"
        and values.dtype in (torch.float32, torch.float16, torch.bfloat16)
        and group_size % 4 == 0  # keeps each row's fp32 statistics aligned
        and values.numel() >= group_size
        and _rowwise_kernels() is not None
    )


def _quantize_rowwise(values: torch.Tensor, group_size: int) -> Quantized | None:
    """8 bits on the CPU in two passes over memory (a reduction, torch's fused kernel), not the packed path's five."""
    # The kernel's own min/max can miss a NaN: one reduction checks every value first.
    low, high = torch.aminmax(values)
    if not _representable(high.float(), low.float(), values):
        return None
    rows = _prepack(values, group_size)
    scale, low = row_stats(rows, group_size)
    steps = scale.clone()  # (the views are strided: read them once)
    # (a fake tensor, in a memory estimate, has no values: redoing narrow groups would change values, not sizes)
    narrow = None if is_fake_tensor(values) else ((steps > 0) & (steps < _ROWWISE_MIN_RANGE / 255)).nonzero().view(-1)
    scale.copy_(steps.add_(_ROWWISE_EPSILON / 255))  # the kernel's step, (range + epsilon) / 255: decode with it
    if narrow is not None and narrow.numel():
        redone = _quantize_packed(torch.cat(_groups(values, group_size, narrow)).view(-1), 8, group_size)
        rows[narrow, :group_size] = redone.codes.view(-1, group_size)
        scale[narrow], low[narrow] = redone.scale, redone.low
    return Quantized(rows, scale, low, 8, group_size, values.numel(), rowwise=True)


def _representable(high: torch.Tensor, low: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the extremes ``high`` and ``low`` are finite and away from the dtype's limit (a fake tensor: yes)."""
    return is_fake_tensor(high) or bool(torch.maximum(high, -low) < torch.finfo(values.dtype).max / 2)


def _groups(values: torch.Tensor, group_size: int, index: torch.Tensor | None = None) -> list[torch.Tensor]:
    """``values`` as ``[groups, group_size]`` blocks (only those in ``index``): whole groups (a view), then the last
    one padded with a value it holds."""
    full = values.numel() // group_size
    blocks = [values[: full * group_size].view(full, group_size)]
    if index is not None:
        blocks = [blocks[0][index[index < full]]]
    if values.numel() % group_size and (index is None or index[-1] == full):
        tail = values[full * group_size :]
        blocks.append(torch.cat([tail, tail[-1:].expand(group_size - tail.numel())]).view(1, group_size))
    return blocks


def _prepack(values: torch.Tensor, group_size: int) -> torch.Tensor:
    prepack = _rowwise_kernels()[0]
    if is_fake_tensor(values):  # (torch's fake kernel for it sizes the storage 4x: same layout, the true bytes)

        def prepack(block: torch.Tensor) -> torch.Tensor:  # a group's codes, then its fp32 scale and minimum
            return torch.empty(block.shape[0], group_size + 8, dtype=torch.uint8, device=block.device)

    rows = []
    for block in _groups(values, group_size):
        if block.dtype != torch.bfloat16:
            rows.append(prepack(block))
        else:  # the kernel takes fp32 and fp16: bf16 goes through fp32 a chunk at a time
            chunks = _chunks(block.shape[0], group_size, block)
            rows += [prepack(block[a:b].float()) for a, b in chunks]
            if chunks[-1][1] < block.shape[0]:  # a fake tensor: the other chunks' rows, sized alike
                rows.append(prepack(block[chunks[-1][1] :]))
    return torch.cat(rows) if len(rows) > 1 else rows[0]


def _fused_kernels(device: torch.device):
    """The Triton kernels (``triton_kernels``) for a CUDA tensor when Triton imports; else None (the torch path)."""
    return triton_kernels if device.type == "cuda" and triton_kernels.triton is not None else None


# kernels_usable's verdict per (device, dtype), for the process; tests clear it.
kernel_verdicts: dict[tuple[torch.device, torch.dtype], bool] = {}
_verdict_lock = threading.Lock()
CHECK_GROUP = 128  # the config's default group size


def kernels_usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the Triton kernels serve ``dtype`` tensors on ``device``: checked bit for bit against the torch path
    once, eagerly (a kernel failing or rounding otherwise inside backward would crash or train on wrong values);
    any failure gives one warning and the torch path for the rest of the process."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:  # as a tensor's device names it
        device = torch.device("cuda", torch.cuda.current_device())
    key = (device, dtype)
    with _verdict_lock:
        if key not in kernel_verdicts:
            triton = triton_kernels.triton
            problem = "Triton does not import" if triton is None else _kernel_difference(triton_kernels, *key)
            if problem is not None:
                version = getattr(triton, "__version__", "unknown")
                warnings.warn(
                    f"peft_slim: the Triton compression kernels (Triton {version}) failed their check on {key[0]}, "
                    f"{dtype}: {problem}. Activation compression there uses the torch path for the rest of the "
                    "process (the same codes, more memory traffic).",
                    RuntimeWarning,
                    stacklevel=2,
                )
            kernel_verdicts[key] = problem is None
        return kernel_verdicts[key]


def _kernels_serve(tensor: torch.Tensor, dtype: torch.dtype) -> bool:
    """``kernels_usable``; a fake tensor (memory estimate, ``torch.compile`` tracing) cannot run the check: the verdict
    if there is one, else the kernels."""
    if is_fake_tensor(tensor) or torch.compiler.is_compiling():
        return kernel_verdicts.get((tensor.device, dtype), True)
    return kernels_usable(tensor.device, dtype)


def _kernel_difference(kernels, device: torch.device, dtype: torch.dtype) -> str | None:
    """What differs bit for bit between the kernels and the torch path on a small tensor (both ways, every width), or
    the exception raised; None if nothing."""
    try:
        with outside_fake_mode(), torch.no_grad():
            values = _check_values().to(dtype)
            values = values.masked_fill_(values == 0, 1.0).to(device)  # (none in fp32; fp16 may flush tiny ones)
            for bits in (8, 4, 2):
                want, have = _quantize_packed(values, bits, CHECK_GROUP), kernels.quantize(values, bits, CHECK_GROUP)
                if have is None:
                    return f"{bits}-bit quantize returned None for finite values"
                for name in ("codes", "scale", "low"):
                    if difference := _bits_differ(f"{bits}-bit {name}", getattr(want, name), getattr(have, name)):
                        return difference
                decoded = (_dequantize_packed(want, dtype), kernels.dequantize(want, dtype))
                if difference := _bits_differ(f"{bits}-bit decoded values", *decoded):
                    return difference
            values[len(values) // 2] = float("nan")
            if kernels.quantize(values, 8, CHECK_GROUP) is not None:
                return "a tensor holding a NaN was quantized instead of kept as it is"
    except Exception as error:  # noqa: BLE001 - any failure (compile, launch, ...) means the torch path
        return f"{type(error).__name__}: {error}"[:500]
    return None


def _check_values() -> torch.Tensor:
    """4173 values in 33 groups of 128 (the last partial): groups of scales 1e-4 to 1e3, then coarse values, many
    exactly half-way between two codes, where one rounding more or less flips a code. No zeros: the bit-for-bit
    comparison sees a zero's sign, which a group's minimum may take from either of 0.0 and -0.0."""
    generator = torch.Generator().manual_seed(0)
    scales = (10.0 ** torch.arange(-4, 4)).repeat_interleave(256)
    smooth = torch.randn(2048, generator=generator) * scales + 0.5 * scales
    coarse = torch.randint(-40, 41, (2048 + 77,), generator=generator) / 8 + 0.1
    return torch.cat([smooth, coarse])


def _bits_differ(name: str, want: torch.Tensor, have: torch.Tensor) -> str | None:
    if have.dtype != want.dtype or have.shape != want.shape:
        return f"{name}: {have.dtype} {list(have.shape)} instead of {want.dtype} {list(want.shape)}"
    as_bits = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[want.element_size()]
    differ = int((have.view(as_bits) != want.view(as_bits)).sum())
    return f"{name} differ at {differ} of {want.numel()} positions" if differ else None


@functools.cache
def _rowwise_kernels():
    """torch's fused row-wise 8-bit (prepack, unpack) ops if present and coding as expected (checked on real tensors);
    else None."""
    with outside_fake_mode():
        try:
            kernels = rowwise_byte_kernels()
            if kernels is None:
                return None
            prepack, unpack = kernels
            values = torch.linspace(-1.5, 2.0, 16).view(2, 8) ** 3
            rows = prepack(values)
            scale, low = row_stats(rows, 8)
            span = values.amax(dim=1) - values.amin(dim=1)
            codes = torch.round((values - low[:, None]) * (255 / (span[:, None] + _ROWWISE_EPSILON)))
            ok = (
                rows.shape == (2, 16)
                and torch.equal(low, values.amin(dim=1))
                and torch.allclose(scale, span / 255)
                and torch.equal(rows[:, :8].float(), codes)
                and torch.allclose(unpack(rows), codes * scale[:, None] + low[:, None], rtol=1e-6, atol=1e-6)
            )
        except Exception:  # noqa: BLE001 - missing or changed kernels: the packed path does the same job
            return None
    return (prepack, unpack) if ok else None


# Values per chunk: fp32 temporaries bounded at 16 MB (off an accelerator's peak, no fresh pages on a CPU).
CHUNK = 1 << 22


def _chunks(groups: int, group_size: int, tensor: torch.Tensor | None = None):
    """(first group, end group) of each chunk, on whole bytes of packed codes; for a fake ``tensor`` the first only
    (the others allocate the same temporaries)."""
    step = max(8, CHUNK // group_size // 8 * 8)
    chunks = [(start, min(start + step, groups)) for start in range(0, groups, step)]
    return chunks[:1] if tensor is not None and is_fake_tensor(tensor) else chunks


def _scratch(scratch, rows: int, group_size: int, dtype: torch.dtype, device) -> torch.Tensor:
    if scratch is None or scratch.shape[0] < rows:
        scratch = torch.empty(rows, group_size, dtype=dtype, device=device)
    return scratch


@functools.cache
def row_aligned_group(row: int, group_size: int) -> int:
    """The group size nearest below ``group_size`` that tiles rows of length ``row`` (whole rows if shorter)."""
    if row <= group_size:
        return row * (group_size // row)
    # (no divisor within a factor of 2: keep the size, a few groups straddle rows)
    return next((size for size in range(group_size, group_size // 2, -1) if row % size == 0), group_size)
