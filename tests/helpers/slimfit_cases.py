"""Shared helpers of the SlimFit tests: tiny models wrapped with SlimFit, and one training step."""

from __future__ import annotations

import torch
from peft import LoraConfig, get_peft_model

from helpers.tiny_models import LORA_TARGETS, FullFineTuned, build, make_batch
from peft_slim import SlimFitConfig, slimfit_

TASK = {"bert": "SEQ_CLS", "vit": None, "gpt2": "CAUSAL_LM", "llama": "CAUSAL_LM"}
# The paper's rule: count units, no catch-up, norms and new weights scheduled like every other weight.
PAPER = {"freeze_by": "count", "catch_up": "none", "always_train_norms": False, "train_new_weights": False}


def slimfit_model(arch: str, lora: bool = False, seed: int = 0, base_seed: int | None = None, **fields):
    """SlimFit on a tiny model: a PeftModel with ``lora``, else full fine-tuning (``FullFineTuned``)."""
    fields.setdefault("activation_compression", None)
    for name, value in PAPER.items():  # the shared cases test the paper's rule; test_slimfit_defaults.py the rest
        fields.setdefault(name, value)
    base = build(arch, seed=seed if base_seed is None else base_seed)
    if not lora:
        return FullFineTuned(base, slimfit_(base, SlimFitConfig(seed=seed, **fields)))
    fields.setdefault("task_type", TASK[arch])
    fields["lora"] = LoraConfig(r=4, lora_alpha=8, target_modules=set(LORA_TARGETS[arch]))
    return get_peft_model(base, SlimFitConfig(seed=seed, **fields))


def loss_of(model, batch: dict) -> torch.Tensor:
    output = model(**batch)
    if getattr(output, "loss", None) is not None:
        return output.loss
    return output[0].float().pow(2).mean()  # a headless model: any scalar of its output


def train(
    model, arch: str, steps: int, optimizer=None, lr: float = 1e-2, weight_decay: float = 0.1, set_to_none: bool = True
):
    """``steps`` plain-loop steps (by default AdamW with weight decay); returns the optimizer."""
    model.train()
    if optimizer is None:
        trainable = [p for p in model.parameters() if p.requires_grad]
        optimizer = torch.optim.AdamW(trainable, lr=lr, weight_decay=weight_decay)
    model.slimfit_attach(optimizer)  # (again for an attached one: nothing)
    for step in range(steps):
        torch.manual_seed(step)  # dropout: the same masks in every run of the same steps
        loss_of(model, make_batch(arch, seed=step)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=set_to_none)
        model.slimfit_step()
    return optimizer


def step_hook_counts(optimizer=None) -> tuple[int, int]:
    """How many optimizer step pre-hooks and post-hooks are registered now: process-wide (torch's private dicts that
    ``register_optimizer_step_pre_hook`` / ``..._post_hook`` fill), or ``optimizer``'s own."""
    if optimizer is None:
        import torch.optim.optimizer as module

        return len(module._global_optimizer_pre_hooks), len(module._global_optimizer_post_hooks)
    return len(optimizer._optimizer_step_pre_hooks), len(optimizer._optimizer_step_post_hooks)
