"""The check before the Triton kernels first serve a (device, dtype): a kernel that fails, or differs from the torch
path, gives one warning and the torch path for the rest of the process; kernels that agree are used.

The kernels only serve CUDA tensors; the interpreted tests (run by ``test_guard_under_the_interpreter`` in a
subprocess with ``TRITON_INTERPRET=1``, as ``test_triton_kernels.py`` does) make them serve CPU tensors, and simulate
the failures at the kernel launch: a launch that raises (as a compile error would), one that changes a code.
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from helpers.triton_interpreter import HAS_TRITON, INTERPRETED, only_interpreted, run_file, runs_the_file
from peft import LoraConfig, get_peft_model

from peft_slim import compress_activations
from peft_slim.compression import quant
from peft_slim.planner.fake import fake_tensor_mode

interpreted = only_interpreted("test_guard_under_the_interpreter")
CPU = torch.device("cpu")
WARNING = "Triton compression kernels"


@runs_the_file
def test_guard_under_the_interpreter():
    run_file(__file__)


@pytest.fixture
def verdicts(monkeypatch):
    """A fresh, empty cache of verdicts, restored afterwards."""
    fresh: dict = {}
    monkeypatch.setattr(quant, "kernel_verdicts", fresh)
    return fresh


def test_cpu_tensors_never_reach_the_check(verdicts):
    values = torch.randn(1000).bfloat16()
    quant.dequantize(quant.quantize(values, 4, 128), torch.bfloat16)
    assert verdicts == {}


def test_fake_tensors_never_run_the_check(verdicts, monkeypatch):
    """A memory estimate (fake tensors) follows the verdict if there is one, else the kernels, as before the check."""
    monkeypatch.setattr(quant, "kernels_usable", lambda *a: pytest.fail("the check ran on a fake tensor"))
    with fake_tensor_mode():
        fake = torch.empty(4096, dtype=torch.bfloat16)
    assert quant._kernels_serve(fake, torch.bfloat16)
    assert verdicts == {}
    verdicts[(CPU, torch.bfloat16)] = False
    assert not quant._kernels_serve(fake, torch.bfloat16)


# ------------------------------------------------------------------------------------------ interpreted


class Launcher:
    """Stands in for a kernel: counts its launches and launches it, or raises, or (``changed``: the index of an output
    argument) flips one bit of what it wrote there."""

    def __init__(self, kernel, mode: str, changed: int | None):
        self.kernel, self.mode, self.changed, self.launches = kernel, mode, changed, 0

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launches += 1
            if self.mode == "raise":
                raise RuntimeError("PassManager::run failed (simulated)")
            self.kernel[grid](*args, **kwargs)
            if self.changed is not None:
                args[self.changed].view(torch.uint8)[6] ^= 1

        return launch


@pytest.fixture
def kernels_on_cpu(verdicts, monkeypatch):
    """The kernels serve CPU tensors as they serve CUDA ones (8 bits too: no row-wise path); returns
    ``install(mode)``, which puts counting launchers in place and returns them."""
    from peft_slim.compression import triton_kernels as kernels

    monkeypatch.setattr(quant, "_rowwise_applies", lambda *a: False)
    monkeypatch.setattr(quant, "_fused_kernels", lambda device: kernels)
    monkeypatch.setattr(kernels, "applies", lambda v, b, g: kernels.supported(v.dtype, b, g) and v.numel() > 0)
    decodes = lambda q, d: not q.rowwise and kernels.supported(d, q.bits, q.group_size)  # noqa: E731
    monkeypatch.setattr(kernels, "dequantizes", decodes)

    def install(mode: str) -> list[Launcher]:
        """``mode``: "agree", "raise", "codes" (the quantize kernel changes a code), "decoded" (the dequantize
        kernel a value)."""
        launchers = [
            Launcher(kernels._quantize_kernel, mode, 1 if mode == "codes" else None),
            Launcher(kernels._dequantize_kernel, mode, 3 if mode == "decoded" else None),
        ]
        monkeypatch.setattr(kernels, "_quantize_kernel", launchers[0])
        monkeypatch.setattr(kernels, "_dequantize_kernel", launchers[1])
        return launchers

    return install


def launches(launchers: list[Launcher]) -> int:
    return sum(launcher.launches for launcher in launchers)


@contextlib.contextmanager
def recorded():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield caught


def ours(caught) -> list[str]:
    return [str(w.message) for w in caught if WARNING in str(w.message)]


def assert_torch_path(values: torch.Tensor, bits: int, group: int) -> None:
    """quant's dispatch gives the torch path's codes, scales, minima and decoded values, bit for bit."""
    got, want = quant.quantize(values, bits, group), quant._quantize_packed(values, bits, group)
    for name in ("codes", "scale", "low"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    decoded, expected = quant.dequantize(want, values.dtype), quant._dequantize_packed(want, values.dtype)
    assert torch.equal(decoded.view(torch.int16), expected.view(torch.int16))


@interpreted
@pytest.mark.parametrize(
    "mode, what",
    [
        ("raise", "RuntimeError: PassManager::run failed (simulated)"),
        ("codes", "8-bit codes differ at 1 of 4224 positions"),
        ("decoded", "8-bit decoded values differ at 1 of 4173 positions"),
    ],
)
def test_a_failing_kernel_warns_once_and_the_torch_path_serves(mode, what, kernels_on_cpu):
    import triton

    launchers = kernels_on_cpu(mode)
    values = torch.randn(5000, generator=torch.Generator().manual_seed(0)).bfloat16()
    with recorded() as caught:
        assert_torch_path(values, 4, 128)  # the first use: the check, then the torch path
        checked = launches(launchers)
        assert checked >= 1
        for bits in (8, 4, 2):
            assert_torch_path(values, bits, 128)
        assert launches(launchers) == checked  # the kernels are not launched again
        (message,) = ours(caught)
        quant.quantize(values.half(), 4, 128)  # another dtype: its own check, its own warning
    assert f"Triton {triton.__version__}" in message and "cpu, torch.bfloat16" in message and what in message
    assert len(ours(caught)) == 2 and "cpu, torch.float16" in ours(caught)[1]
    assert quant.kernel_verdicts == {(CPU, torch.bfloat16): False, (CPU, torch.float16): False}


@interpreted
def test_kernels_that_agree_are_used(kernels_on_cpu):
    launchers = kernels_on_cpu("agree")
    values = torch.randn(5000, generator=torch.Generator().manual_seed(0)).bfloat16()
    with recorded() as caught:
        packed = quant.quantize(values, 4, 128)
        checked = launches(launchers)
        quant.dequantize(packed, torch.bfloat16)
        quant.quantize(values, 8, 128)
    assert launches(launchers) == checked + 2 and launchers[1].launches >= 1
    assert ours(caught) == [] and quant.kernel_verdicts == {(CPU, torch.bfloat16): True}


def _gradients() -> torch.Tensor:
    """One training step of a tiny Llama with LoRA, its activations compressed at 4 bits: the adapters' gradients."""
    model = build("llama")
    model = get_peft_model(model, LoraConfig(r=4, target_modules=LORA_TARGETS["llama"], init_lora_weights=False))
    with compress_activations(bits=4, group_size=32, min_numel=0) as context:
        loss = model(**make_batch("llama")).loss
    loss.backward()
    assert context.stats.compressed > 0
    return torch.cat([p.grad.flatten() for p in model.parameters() if p.requires_grad])


@interpreted
@pytest.mark.parametrize("mode", ["raise", "codes", "decoded", "agree"])
def test_a_training_step_has_the_torch_paths_gradients(mode, kernels_on_cpu, monkeypatch):
    with monkeypatch.context() as torch_path:
        torch_path.setattr(quant, "_fused_kernels", lambda device: None)
        reference = _gradients()
    launchers = kernels_on_cpu(mode)
    with recorded() as caught:
        gradients = _gradients()
    assert torch.equal(gradients, reference)
    if mode == "agree":  # every compressed tensor went through the kernels: far more launches than the check's 7
        assert ours(caught) == [] and launches(launchers) > 20
    else:
        assert len(ours(caught)) == 1 and launches(launchers) == (2 if mode == "decoded" else 1)


# ------------------------------------------------------------------------------------------ on a GPU


@pytest.mark.cuda
@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="compiled kernels only")
def test_the_compiled_kernels_pass_their_check(verdicts):
    with recorded() as caught:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            assert quant.kernels_usable(torch.device("cuda", torch.cuda.current_device()), dtype)
    assert ours(caught) == []
