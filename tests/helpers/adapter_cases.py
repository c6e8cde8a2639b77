"""The three methods the adapter and LoRA-artifact tests train LoRA with on the tiny Llama, and the logits they
compare."""

from __future__ import annotations

import torch
from peft import LoraConfig

from helpers.tiny_models import make_batch
from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig

LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"])
METHODS = ["tokentune_lora", "slimfit_lora", "full_stack"]


def method_config(name: str, seed: int = 0, **lora):
    """The config of ``name`` (one of METHODS) seeded with ``seed``; ``lora`` changes or adds LoRA fields."""
    lora_config = LoraConfig(**{**LORA, **lora})
    if name == "tokentune_lora":
        return TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, seed=seed, lora=lora_config)
    if name == "slimfit_lora":
        return SlimFitConfig(task_type="CAUSAL_LM", freeze_ratio=0.5, seed=seed, lora=lora_config)
    return SlimFitConfig(  # the full stack
        task_type="CAUSAL_LM",
        freeze_ratio=0.5,
        seed=seed,
        lora=lora_config,
        token_selection=TokenSelectionConfig(token_ratio=0.5, seed=seed),
        activation_compression=ActivationCompressionConfig(bits=4, min_numel=0),
    )


def eval_inputs() -> dict:
    """The tiny Llama's batch of seed 9, without its labels."""
    return {k: v for k, v in make_batch("llama", seed=9).items() if k != "labels"}


def eval_logits(model) -> torch.Tensor:
    """``model``'s logits on ``eval_inputs()``, in eval mode."""
    model.eval()
    with torch.no_grad():
        return model(**eval_inputs()).logits
