"""A saved tensor written in place before backward uses it: plain autograd raises, and so does compression.

Saved-tensor hooks hide the saved tensors from autograd's version check; without a check of their own, a tensor
kept as it is (bits=None, below min_numel) would hand backward the modified values: silently wrong gradients.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from peft_slim import ActivationCompressionConfig, compress_activations
from peft_slim.training_context import TrainingContext

INPLACE = "modified by an inplace operation"
SETTINGS = {
    "bits=None": dict(bits=None, min_numel=0),
    "below min_numel": dict(bits=8, min_numel=10**6),
    "bits=8": dict(bits=8, min_numel=0, group_size=8),
}


class InplaceGate(nn.Module):
    """``nn.ReLU(inplace=True)`` on a gate that the product before it saved."""

    def __init__(self):
        super().__init__()
        self.gate, self.up, self.act = nn.Linear(8, 8), nn.Linear(8, 8), nn.ReLU(inplace=True)

    def forward(self, x):
        gate = self.gate(x)
        product = gate * self.up(x)  # saves gate
        self.act(gate)
        return (product + gate).pow(2).sum()


class InplaceProbabilities(nn.Module):
    """``softmax`` (which saves its output), then ``mul_`` on that output."""

    def __init__(self):
        super().__init__()
        self.score, self.value = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        probabilities = torch.softmax(self.score(x), dim=-1)
        probabilities.mul_(0.5)
        return (probabilities @ self.value(x).t()).pow(2).sum()  # saves them again


class InplaceUnsaved(nn.Module):
    """In-place writes on tensors no backward needs: exact under every setting."""

    def __init__(self):
        super().__init__()
        self.first, self.second = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        hidden = self.first(x)
        hidden.add_(1.0)  # Linear's backward does not need its output
        hidden = torch.relu(hidden)
        return self.second(hidden).pow(2).sum()


def _model(cls) -> nn.Module:
    torch.manual_seed(0)
    return cls()


def _grads(model: nn.Module) -> list[torch.Tensor]:
    return [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("cls", [InplaceGate, InplaceProbabilities])
def test_plain_autograd_raises(cls):
    with pytest.raises(RuntimeError, match=INPLACE):
        _model(cls)(torch.randn(4, 8)).backward()


@pytest.mark.parametrize("setting", SETTINGS)
@pytest.mark.parametrize("cls", [InplaceGate, InplaceProbabilities])
def test_compression_raises_as_autograd_does(cls, setting):
    model = _model(cls)
    with compress_activations(**SETTINGS[setting]) as context:
        loss = model(torch.randn(4, 8))
    assert (context.stats.compressed > 0) == (setting == "bits=8")
    with pytest.raises(RuntimeError, match=f"{INPLACE}.*peft_slim's activation compression"):
        loss.backward()


@pytest.mark.parametrize("cls", [InplaceGate, InplaceProbabilities])
def test_the_tuners_training_compression_raises_too(cls):
    model = _model(cls).train()
    TrainingContext(model, ActivationCompressionConfig(bits=None, min_numel=0))
    loss = model(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()


def test_a_tensor_saved_again_after_its_write_is_caught_after_it_died():
    """The compressed probabilities die with the forward; their second save (by the matmul) shows the write."""
    model = _model(InplaceProbabilities)
    with compress_activations(bits=8, min_numel=0, group_size=8):
        loss = model(torch.randn(4, 8))
    with pytest.raises(RuntimeError, match="compressed"):
        loss.backward()


@pytest.mark.parametrize("setting", SETTINGS)
def test_in_place_writes_that_no_backward_sees_still_train(setting):
    x = torch.randn(4, 8)
    model = _model(InplaceUnsaved)
    model(x).backward()
    reference = _grads(model)
    model.zero_grad(set_to_none=True)
    with compress_activations(**SETTINGS[setting]):
        loss = model(x)
    loss.backward()
    if setting == "bits=8":
        assert all(torch.allclose(g, r, rtol=0.1, atol=0.1) for g, r in zip(_grads(model), reference))
    else:
        assert all(torch.equal(g, r) for g, r in zip(_grads(model), reference))


@pytest.mark.cuda
@pytest.mark.parametrize("setting", [dict(bits=None, offload=True), dict(bits=8, offload=True), dict(bits=4)])
@pytest.mark.parametrize("cls", [InplaceGate, InplaceProbabilities])
def test_on_cuda_offloaded_or_not_compression_raises_too(cls, setting):
    model = _model(cls).cuda()
    with compress_activations(min_numel=0, group_size=8, **setting):
        loss = model(torch.randn(4, 8, device="cuda"))
    with pytest.raises(RuntimeError, match=INPLACE):
        loss.backward()
