"""TokenTune + LoRA on a base model loaded in 4-bit through bitsandbytes (QLoRA), on CPU.

Skipped where bitsandbytes is not installed or cannot load a 4-bit model on this CPU.

bitsandbytes' CPU backend repacks a Linear4bit's weights for inference the first time it runs in eval
mode on an input that does not require grad, and its repacked kernel has no autograd: later training
forwards then silently drop the gradient through the base layer. The reference below therefore keeps
the Linear4bit modules in training mode (the ordinary dequantize-and-matmul path, the same one the
TokenTune training forward uses), while TokenTune itself is switched off by eval mode.
"""

from __future__ import annotations

import math

import pytest
import torch
from helpers.reference import reference_forward, selected_causal_lm_loss
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from helpers.tokentune_cases import train_on_one_batch
from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training
from transformers import AutoModelForCausalLM, BitsAndBytesConfig

from peft_slim import TokenTuneConfig

bnb = pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def saved_llama(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-llama")
    build("llama", seed=0).save_pretrained(path)
    return path


def load_4bit(path):
    config = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    try:
        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=config, device_map="cpu", attn_implementation="sdpa"
        )
    except Exception as error:  # bitsandbytes without a usable CPU backend
        pytest.skip(
            f"bitsandbytes {bnb.__version__} cannot load a 4-bit model on CPU: {type(error).__name__}: {error}"
        )
    layer = model.model.layers[0]
    assert isinstance(layer.self_attn.q_proj, bnb.nn.Linear4bit), type(layer.self_attn.q_proj)
    assert layer.self_attn.q_proj.weight.dtype == torch.uint8  # really stored in 4 bits
    return model


def qlora_tokentune(path, gradient_checkpointing):
    """``gradient_checkpointing``: None (off) or use_reentrant, as in the usual QLoRA recipe."""
    model = prepare_model_for_kbit_training(
        load_4bit(path),
        use_gradient_checkpointing=gradient_checkpointing is not None,
        gradient_checkpointing_kwargs=None
        if gradient_checkpointing is None
        else {"use_reentrant": gradient_checkpointing},
    )
    config = TokenTuneConfig(
        task_type="CAUSAL_LM",
        token_ratio=0.5,
        seed=0,
        # init_lora_weights=False: B starts non-zero, so every LoRA tensor gets a gradient at once.
        lora=LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS["llama"], init_lora_weights=False),
    )
    return get_peft_model(model, config)


def fixed_mask(batch, seed=0):
    generator = torch.Generator().manual_seed(seed)
    real = batch["attention_mask"].bool()
    mask = (torch.rand(real.shape, generator=generator) < 0.4) & real
    mask[:, -1] = True
    return mask


@pytest.mark.parametrize("gradient_checkpointing", [None, False, True], ids=["plain", "checkpoint", "reentrant"])
def test_qlora_tokentune_gradient_matches_reference(saved_llama, gradient_checkpointing):
    model = qlora_tokentune(saved_llama, gradient_checkpointing)
    batch = make_batch("llama", batch=3, length=10, seed=1)
    mask = fixed_mask(batch)
    lora = {n: p for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)

    model.train()
    out = model(**batch, token_mask=mask)
    assert torch.equal(model.base_model.last_token_mask, mask)
    out.loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in lora.items()}
    for name, grad in grads.items():
        assert torch.isfinite(grad).all(), name
        assert grad.abs().sum() > 0, name

    # The equivalent definition (methods.md) on the same 4-bit weights: TokenTune off (eval mode),
    # bitsandbytes on its training path (see the module docstring).
    model.zero_grad(set_to_none=True)
    model.eval()
    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.train()
    inner = model.base_model.model
    with reference_forward(inner, inner.model.layers, mask):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    reference = selected_causal_lm_loss(logits, batch["labels"], mask)
    reference.backward()
    torch.testing.assert_close(out.loss.detach(), reference.detach(), rtol=1e-4, atol=1e-5)
    for name, param in lora.items():
        torch.testing.assert_close(grads[name], param.grad, rtol=1e-3, atol=1e-6, msg=name)


def test_qlora_tokentune_training_loop_keeps_4bit_base(saved_llama):
    model = qlora_tokentune(saved_llama, gradient_checkpointing=None)
    batch = make_batch("llama", batch=3, length=10, seed=2)
    quantized = {n: b.detach().clone() for n, b in model.named_parameters() if b.dtype == torch.uint8}
    assert quantized
    lora_before = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    losses = train_on_one_batch(model, batch, optimizer, steps=4)
    assert all(math.isfinite(x) for x in losses)
    for name, value in model.named_parameters():
        if name in quantized:
            assert torch.equal(value, quantized[name]), name
    for name, param in model.named_parameters():
        if name in lora_before:
            assert not torch.equal(param, lora_before[name]), name


def test_qlora_slimfit_trains_lora_pairs_over_a_4bit_base(saved_llama):
    """SlimFit over QLoRA: the units are LoRA pairs, frozen ones do not move, the 4-bit base stays packed."""
    from peft_slim import SlimFitConfig, TokenTuneConfig

    model = prepare_model_for_kbit_training(load_4bit(saved_llama), use_gradient_checkpointing=False)
    config = SlimFitConfig(
        task_type="CAUSAL_LM",
        freeze_ratio=0.5,
        lora=LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS["llama"]),
        token_selection=TokenTuneConfig(token_ratio=0.5, seed=0),
    )
    model = get_peft_model(model, config)
    tuner = model.base_model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model.slimfit_attach(optimizer)
    model.train()
    for step in range(3):
        loss = model(**make_batch("llama", seed=step)).loss
        assert math.isfinite(loss.item())
        loss.backward()
        trained = list(tuner.scheduler.trained)
        before = [[p.detach().clone() for p in unit.params] for unit in tuner._state.units]
        optimizer.step()
        optimizer.zero_grad()
        for unit, t, old in zip(tuner._state.units, trained, before):
            assert all(torch.equal(o, p) for o, p in zip(old, unit.params)) != t, unit.name
        model.slimfit_step()
    assert tuner.model.model.layers[0].self_attn.q_proj.base_layer.weight.dtype == torch.uint8
