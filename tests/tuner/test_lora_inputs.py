"""LoRA keeps its input at the base model's width: the same gradients as PEFT, without the fp32 copy saved."""

from __future__ import annotations

import copy

import pytest
import torch
from helpers.tiny_models import decoder_config
from peft import LoraConfig, get_peft_model
from transformers import LlamaForCausalLM

import peft_slim
from peft_slim import lora_inputs
from peft_slim.lora_inputs import keep_lora_inputs_narrow
from peft_slim.memory import SavedActivationBytes

IN, OUT, R, N = 48, 40, 4, 30


class _Block(torch.nn.Module):
    def __init__(self, dtype):
        super().__init__()
        self.proj = torch.nn.Linear(IN, OUT, dtype=dtype)


def _layer(dtype: torch.dtype, dropout: float = 0.0, narrow: bool = True):
    torch.manual_seed(0)
    model = get_peft_model(
        _Block(dtype), LoraConfig(r=R, target_modules=["proj"], lora_dropout=dropout, init_lora_weights=False)
    )
    assert model.base_model.model.proj.lora_A["default"].weight.dtype == torch.float32  # PEFT's fp32 adapters
    if narrow:
        assert keep_lora_inputs_narrow(model) == 1
    return model.base_model.model.proj


def _saved_and_grads(layer, x: torch.Tensor, seed: int = 0):
    x = x.detach().requires_grad_(True)
    torch.manual_seed(seed)
    with SavedActivationBytes(layer.parameters()) as saved:
        out = layer(x)
    out.float().square().sum().backward()
    grads = {n: p.grad.clone() for n, p in layer.named_parameters() if p.requires_grad}
    grads["x"] = x.grad.clone()
    layer.zero_grad(set_to_none=True)
    return saved.bytes, out.detach(), grads


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_fp32_copy_is_not_saved(dtype):
    x = torch.randn(N, IN).to(dtype)
    plain_bytes, plain_out, plain_grads = _saved_and_grads(_layer(dtype, narrow=False), x)
    bytes_, out, grads = _saved_and_grads(_layer(dtype), x)
    # PEFT saves the fp32 cast of x (4 bytes a value) and lora_A's fp32 output; here x itself (2 bytes a value)
    assert plain_bytes == N * IN * 4 + N * R * 4
    assert bytes_ == N * IN * 2 + N * R * 4
    assert torch.equal(out, plain_out)
    assert grads.keys() == plain_grads.keys()
    for name in grads:  # the same products in the same order: bit for bit
        assert grads[name].dtype == plain_grads[name].dtype and torch.equal(grads[name], plain_grads[name]), name


def test_dropout_autocast_and_fp32_keep_peft_behaviour():
    x = torch.randn(N, IN).to(torch.bfloat16)
    plain = _saved_and_grads(_layer(torch.bfloat16, dropout=0.5, narrow=False), x, seed=3)
    kept = _saved_and_grads(_layer(torch.bfloat16, dropout=0.5), x, seed=3)
    assert kept[0] == plain[0] and torch.equal(kept[1], plain[1])  # dropout sees the fp32 cast, as in PEFT
    with torch.autocast("cpu", dtype=torch.bfloat16):
        plain = _saved_and_grads(_layer(torch.float32, narrow=False), x.float())
        kept = _saved_and_grads(_layer(torch.float32), x.float())
    assert kept[0] == plain[0] and torch.equal(kept[1], plain[1])
    plain = _saved_and_grads(_layer(torch.float32, narrow=False), x.float())
    kept = _saved_and_grads(_layer(torch.float32), x.float())
    assert kept[0] == plain[0] and all(torch.equal(kept[2][n], plain[2][n]) for n in plain[2])


def _llama_bf16():
    config = decoder_config(hidden_size=64, intermediate_size=128, vocab_size=100)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, dtype=torch.bfloat16, attn_implementation="sdpa")


def _draw(module, args) -> None:
    torch.rand(1)


def test_tuners_install_it_with_exact_gradients(monkeypatch):
    """TokenTune + LoRA on a bf16 Llama: bit-identical gradients, fewer saved bytes than with PEFT's cast."""
    base = _llama_bf16()
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = peft_slim.TokenTuneConfig(
        task_type="CAUSAL_LM", token_ratio=0.5, seed=0, lora=LoraConfig(r=8, target_modules=targets)
    )
    ids = torch.randint(1, 100, (2, 16))
    results = []
    for narrow in (True, False):
        if not narrow:
            monkeypatch.setattr("peft_slim.tuner.model.keep_lora_inputs_narrow", lambda model: 0)
        torch.manual_seed(1)  # the same LoRA A
        model = get_peft_model(copy.deepcopy(base), copy.deepcopy(config))
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_B" in name:
                    param.copy_(torch.linspace(-0.1, 0.1, param.numel()).view_as(param))
        model.train()
        # A draw in every block keeps TokenTune's selected pass (and the LoRA inputs it saves) in the forward, where
        # the saved bytes are counted; TokenTune's one-forward step saves them only in its backward recomputation.
        for layer in model.base_model.model.model.layers:
            layer.self_attn.register_forward_pre_hook(_draw)
        with SavedActivationBytes(model.parameters()) as saved, pytest.warns(UserWarning, match="random numbers"):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        results.append((saved.bytes, loss.detach(), grads))
    (narrow_bytes, narrow_loss, narrow_grads), (plain_bytes, plain_loss, plain_grads) = results
    assert torch.equal(narrow_loss, plain_loss)
    assert all(torch.equal(narrow_grads[n], plain_grads[n]) for n in plain_grads)
    assert narrow_bytes < plain_bytes


def test_the_module_documents_its_conditions():
    assert "dropout" in lora_inputs.__doc__ and "autocast" in lora_inputs.__doc__
