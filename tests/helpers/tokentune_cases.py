"""Shared helpers for the TokenTune semantics tests: configs per architecture and gradient collection."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from helpers.reference import reference_forward, selected_causal_lm_loss
from helpers.tiny_models import BUILDERS, CAUSAL_LM, LORA_TARGETS, FullFineTuned, build
from peft_slim import TokenTuneConfig, tokentune_
from peft_slim.token_selection.blocks import find_blocks

ARCHS = tuple(BUILDERS)
IMPLEMENTATIONS = ("sdpa", "eager")
# The PEFT task type each tiny model is wrapped with; ViT goes through the plain PeftModel.
TASK_TYPES = {arch: "CAUSAL_LM" for arch in CAUSAL_LM} | {"bert": "SEQ_CLS", "roberta": "SEQ_CLS", "vit": None}
_DEFAULT = object()


def lora_config(arch: str, task_type=_DEFAULT) -> LoraConfig:
    """A LoRA config with non-zero B, so the adapter changes the outputs and receives gradients."""
    task_type = TASK_TYPES[arch] if task_type is _DEFAULT else task_type
    extra = {"modules_to_save": ["classifier"]} if arch == "vit" else {}
    return LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False, task_type=task_type, **extra)


def tokentune_config(arch: str, lora: bool = True, task_type=_DEFAULT, **kwargs) -> TokenTuneConfig:
    task_type = TASK_TYPES[arch] if task_type is _DEFAULT else task_type
    if "num_tokens" not in kwargs:
        kwargs.setdefault("token_ratio", 0.4)
    kwargs.setdefault("seed", 0)
    if not lora:  # for peft_slim.tokentune_
        return TokenTuneConfig(**kwargs)
    if arch == "vit":
        kwargs.setdefault("modules_to_save", ["classifier"])
    nested = LoraConfig(r=4, target_modules=LORA_TARGETS[arch], init_lora_weights=False)
    return TokenTuneConfig(task_type=task_type, lora=nested, **kwargs)


def tokentune_model(arch: str, implementation: str = "sdpa", lora: bool = True, task_type=_DEFAULT, **kwargs):
    """TokenTune on a tiny model: a PeftModel with ``lora``, else full fine-tuning (``FullFineTuned``)."""
    base = build(arch, implementation)
    config = tokentune_config(arch, lora=lora, task_type=task_type, **kwargs)
    return get_peft_model(base, config) if lora else FullFineTuned(base, tokentune_(base, config))


def vanilla_lora_model(arch: str, implementation: str, tokentune_peft_model):
    """A plain PEFT LoRA model of the same architecture holding exactly the TokenTune model's weights."""
    base = build(arch, implementation, seed=1)  # different init: every weight must come from the state dict
    model = get_peft_model(base, lora_config(arch))
    model.load_state_dict(tokentune_peft_model.state_dict(), strict=True)
    return model


def build_decoder_classifier(arch: str, implementation: str = "sdpa", seed: int = 0) -> torch.nn.Module:
    """A tiny *ForSequenceClassification decoder (the head reads the last real token) with the weights of ``arch``."""
    from transformers import AutoModelForSequenceClassification

    config = build(arch, implementation).config
    config.num_labels = 3
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config, attn_implementation=implementation)


def grads_of_trainable(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    grads = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grads[name] = param.grad.detach().clone() if param.grad is not None else torch.zeros_like(param)
    return grads


def reference_loss_and_grads(model, arch: str, batch: dict, mask: torch.Tensor):
    """Loss and gradients of the equivalent definition (tests/helpers/reference.py) for ``mask``.

    Runs the PEFT model in eval mode (TokenTune inactive) under ``reference_forward``; restores the mode.
    """
    was_training = model.training
    model.zero_grad(set_to_none=True)
    model.eval()
    inner = model.base_model.model
    _, blocks = find_blocks(inner)
    try:
        with reference_forward(inner, blocks, mask):
            if arch in CAUSAL_LM:
                inputs = {key: value for key, value in batch.items() if key != "labels"}
                loss = selected_causal_lm_loss(model(**inputs).logits, batch["labels"], mask)
            else:
                loss = model(**batch).loss
        loss.backward()
    finally:
        model.train(was_training)
    grads = grads_of_trainable(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


def max_grad_error(actual: dict, expected: dict) -> tuple[float, float]:
    """(max abs difference, max abs expected value) over all trainable tensors."""
    assert actual.keys() == expected.keys()
    error = max((actual[name] - expected[name]).abs().max().item() for name in expected)
    scale = max(expected[name].abs().max().item() for name in expected)
    return error, scale


def assert_grads_match(actual: dict, expected: dict, rtol: float = 1e-5) -> None:
    error, scale = max_grad_error(actual, expected)
    assert scale > 0, "the reference gradient is identically zero: the test would prove nothing"
    assert error <= rtol * max(1.0, scale), f"max |grad - reference| = {error:.3e} (grad scale {scale:.3e})"


def training_step(model, batch: dict, token_mask: torch.Tensor | None = None):
    """One training forward + backward; returns (output, the mask used, gradients)."""
    model.train()
    model.zero_grad(set_to_none=True)
    extra = {} if token_mask is None else {"token_mask": token_mask}
    output = model(**batch, **extra)
    mask = model.base_model.last_token_mask.clone()
    output.loss.backward()
    grads = grads_of_trainable(model)
    model.zero_grad(set_to_none=True)
    return output, mask, grads


def train_on_one_batch(model, batch: dict, optimizer, steps: int) -> list[float]:
    """``steps`` plain-loop steps on ``batch``; returns their losses. Each training forward must have selected
    fewer tokens than the batch holds (TokenTune was active)."""
    model.train()
    losses = []
    for _ in range(steps):
        out = model(**batch)
        out.loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(out.loss.item())
        assert int(model.base_model.last_token_mask.sum()) < int(batch["attention_mask"].sum())
    return losses
