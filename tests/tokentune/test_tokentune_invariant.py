"""TokenTune's run-time invariant (token_selection/invariant.py): a block's selected pass must give the full pass's
outputs at the selected tokens, in the forward and when recomputed in backward, else the step is refused before any
optimizer step, naming the block. Blocks that break it here are made by hand (a token mixer beside attention, a
recomputation that differs), so the tests do not depend on which architectures transformers ships."""

from __future__ import annotations

import inspect

import pytest
import torch
from helpers.tiny_models import make_batch
from helpers.tokentune_cases import assert_grads_match, reference_loss_and_grads, tokentune_model
from peft import LoraConfig, get_peft_model
from torch import nn

from peft_slim import TokenTuneConfig
from peft_slim.token_selection import invariant


class _Mixing(nn.Module):
    """The block's MLP plus a running mean over the sequence: a causal token mixer that is not attention."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        counts = torch.arange(1, x.shape[1] + 1, device=x.device, dtype=x.dtype)[None, :, None]
        return self.mlp(x) + x.cumsum(1) / counts


class _GradModeDependent(nn.Module):
    """The block's MLP, in float64 only while grad is on: the forward (no grad) and the recomputation (grad) differ."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        return self.mlp(x).double() if torch.is_grad_enabled() else self.mlp(x)


def _layers(model):
    return model.get_base_model().model.layers


def test_a_token_mixer_beside_attention_is_refused_before_any_step():
    model = tokentune_model("llama")
    layer = _layers(model)[1]
    layer.mlp = _Mixing(layer.mlp)
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.train()
    with pytest.raises(
        ValueError, match=r"(?s)cannot train LlamaDecoderLayer exactly.*without token selection.*differ"
    ):
        model(**make_batch("llama")).loss.backward()
        optimizer.step()
    assert all(p.grad is None for p in model.parameters())
    assert all(torch.equal(p, before[name]) for name, p in model.named_parameters())
    # Inference is unaffected.
    model.eval()
    with torch.no_grad():
        model(**make_batch("llama"))


def test_a_recomputation_that_differs_is_refused_in_backward():
    model = tokentune_model("llama")
    layer = _layers(model)[0]
    layer.mlp = _GradModeDependent(layer.mlp)
    model.train()
    output = model(**make_batch("llama"))  # the forward's check runs without grad: both passes agree
    with pytest.raises(ValueError, match=r"(?s)LlamaDecoderLayer exactly.*recomputed in backward.*torch.float64"):
        output.loss.backward()


def _count_calls(block: nn.Module) -> list[int]:
    calls = [0]
    inner = block.forward.forward

    def counting(*args, **kwargs):
        calls[0] += 1
        return inner(*args, **kwargs)

    counting.__signature__ = inspect.signature(inner)
    block.forward.inner = counting  # the forward TokenTune's wrapper calls (blocks.py `_BlockForward`)
    return calls


def test_checked_once_per_argument_layout():
    """Full pass + checked selected pass + recomputation at the first step; full pass + recomputation after; a new
    layout (a padding mask where there was none) is checked again; a new sequence length is not a new layout."""
    model = tokentune_model("llama")
    calls = _count_calls(_layers(model)[0])
    batch = make_batch("llama")
    without_mask = {"input_ids": batch["input_ids"], "labels": batch["labels"]}
    model.train()
    expected = []
    for step in (without_mask, without_mask, batch, batch, make_batch("llama", length=14)):
        calls[0] = 0
        model(**step).loss.backward()
        expected.append(calls[0])
    assert expected == [3, 2, 3, 2, 2]


def test_exact_models_pass_and_keep_their_gradients():
    """No false refusal, and the check changes nothing: gradients equal the reference's."""
    model = tokentune_model("llama")
    batch = make_batch("llama")
    model.train()
    model(**batch).loss.backward()
    mask = model.base_model.last_token_mask.clone()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    _, ref_grads = reference_loss_and_grads(model, "llama", batch, mask)
    assert_grads_match(grads, ref_grads)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_low_precision_is_within_tolerance(dtype):
    model = tokentune_model("llama").to(dtype)
    model.train()
    model(**make_batch("llama")).loss.backward()


def test_a_block_with_dropout_is_checked_in_eval_mode():
    """Dropout draws differ between any two runs: both passes run again in eval mode for the check, which passes for
    an exact block, and still refuses a token mixer."""
    from helpers.tiny_models import build

    config = TokenTuneConfig(lora=LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_dropout=0.1), seed=0)
    model = get_peft_model(build("llama"), config)
    model.train()
    with pytest.warns(UserWarning, match="draws random numbers"):
        model(**make_batch("llama")).loss.backward()
    assert all(m.training for m in model.modules())  # the check's eval mode is undone

    model = get_peft_model(build("llama"), config)
    layer = _layers(model)[0]
    layer.mlp = _Mixing(layer.mlp)
    model.train()
    with pytest.raises(ValueError, match="LlamaDecoderLayer exactly"):
        model(**make_batch("llama"))


def test_difference_measures_only_valid_slots():
    from peft_slim.token_selection.selection import TokenSelection

    mask = torch.tensor([[True, True, False], [True, False, False]])
    selection = TokenSelection.from_mask(mask)
    expected = torch.ones(2, 2, 4)
    actual = expected.clone()
    actual[1, 1] = 100.0  # row 1's second slot holds no selected position
    assert invariant.difference(expected, actual, selection) is None
    actual[0, 1] += 1e-3
    assert "differ" in invariant.difference(expected, actual, selection)
    assert "shape" in invariant.difference(expected, actual[:, :1], selection)
