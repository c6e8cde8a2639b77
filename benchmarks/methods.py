"""The fine-tuning methods compared, each built the same way from a task's pretrained model and a seed.

All use AdamW (betas 0.9/0.999, weight decay 0.01) with the task's peak learning rate for adapters or for base
weights, and LoRA r=8, alpha 16, no dropout, on the task's LoRA target modules.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
from peft import LoraConfig, get_peft_model
from peft.optimizers import create_lorafa_optimizer
from torch.autograd.graph import save_on_cpu

import peft_slim
from peft_slim.compat import copy_loading_marks
from peft_slim.recipe import Recipe, trainable
from peft_slim.slimfit import find_slimfit

from .tasks import Task

LORA_R, LORA_ALPHA, WEIGHT_DECAY = 8, 16, 0.01
TOKEN_RATIOS = (0.1, 0.2, 0.3)
FREEZE_RATIOS = (0.8, 0.9, 0.95)
# SlimFit's defaults keep no AdamW state for frozen units (the published code keeps it for all: 2x the model in
# fp32): freed after one frozen step, it restarts from zero when the unit trains again.
RELEASE_NOTE = "SlimFit's default: a unit's AdamW state is freed once it is frozen (release_after_steps=1)"


@dataclass
class Setup:
    """A model ready to train: its optimizer, what wraps each training forward, what runs after each step."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    forward_context: Callable[[], AbstractContextManager] = nullcontext
    after_step: Callable[[], None] = lambda: None
    history: Callable[[], dict] | None = None  # SlimFit's freeze pattern


@dataclass
class Method:
    name: str
    build: Callable[[Task, int], Setup]
    note: str = ""
    needs_slimfit: bool = False


def lora_config(task: Task, with_modules_to_save: bool = True, also_save: list[str] | None = None) -> LoraConfig:
    """``also_save``: modules trained in full beside the task's ``modules_to_save``."""
    saved = [*(task.modules_to_save or [] if with_modules_to_save else []), *(also_save or [])]
    recipe = Recipe("lora", LORA_R, LORA_ALPHA, task.lora_targets)
    return recipe.to_peft_config(task_type=task.task_type, modules_to_save=saved or None)


def adamw(model: torch.nn.Module, lr: float, task: Task | None = None, every: bool = False) -> torch.optim.Optimizer:
    """AdamW on the trainable parameters (``every``: on all of them); with ``task``, the task's new head at
    ``task.lr_adapter`` and the rest at ``lr`` (methods that train base weights: the head gets the same learning
    rate as in the adapter methods)."""
    named = [(n, p) for n, p in model.named_parameters() if every or p.requires_grad]
    head = [p for n, p in named if task is not None and task.is_head(n)]
    groups = [{"params": [p for n, p in named if task is None or not task.is_head(n)], "lr": lr}]
    if head:
        groups.append({"params": head, "lr": task.lr_adapter})
    return torch.optim.AdamW(groups, lr=lr, weight_decay=WEIGHT_DECAY)


def full_ft(task: Task, seed: int) -> Setup:
    model = copy.deepcopy(task.base)
    model.requires_grad_(True)
    return Setup(model, adamw(model, task.lr_full, task))


def lora(
    task: Task, seed: int, checkpointing: bool = False, offload: bool = False, also_save: list[str] | None = None
) -> Setup:
    base = copy.deepcopy(task.base)
    if checkpointing:
        base.activation_checkpointing_enable()
    model = get_peft_model(base, lora_config(task, also_save=also_save))
    # On CPU the saved tensors already live in host memory: save_on_cpu then keeps them where they are.
    context = (lambda: save_on_cpu(pin_memory=torch.cuda.is_available())) if offload else nullcontext
    return Setup(model, adamw(model, task.lr_adapter), forward_context=context)


def lora_fa(task: Task, seed: int) -> Setup:
    model = get_peft_model(copy.deepcopy(task.base), lora_config(task))
    optimizer = create_lorafa_optimizer(model, LORA_R, LORA_ALPHA, task.lr_adapter, weight_decay=WEIGHT_DECAY)
    return Setup(model, optimizer)


def tokentune(task: Task, seed: int, token_ratio: float) -> Setup:
    recipe = Recipe("tokentune", LORA_R, LORA_ALPHA, task.lora_targets, token_ratio=token_ratio)
    config = recipe.to_peft_config(seed, task.task_type, modules_to_save=task.modules_to_save)
    model = get_peft_model(copy.deepcopy(task.base), config)
    return Setup(model, adamw(model, task.lr_adapter))


def slimfit(task: Task, seed: int, freeze_ratio: float, compression: bool, stack: bool = False, **fields) -> Setup:
    """SlimFit on the base weights, or (``stack``) SlimFit + TokenTune 0.2 + LoRA; compression: its default;
    ``fields``: other SlimFitConfig fields (the ablations of ``benchmarks.ablate_slimfit``)."""
    lora = dict(lora_r=LORA_R, lora_alpha=LORA_ALPHA, lora_target_modules=task.lora_targets, token_ratio=0.2)
    recipe = Recipe(
        "slimfit",
        **(lora if stack else {"lora_r": 0}),
        freeze_ratio=freeze_ratio,
        catch_up=fields.pop("catch_up", None),
        compression_bits=None if compression else "none",
    )
    # The task's new head: PEFT's modules_to_save with LoRA; trained at every step in full fine-tuning.
    head = {"modules_to_save": task.modules_to_save} if stack else {"always_trainable": task.modules_to_save}
    config = recipe.to_peft_config(seed, task.task_type, **head, **fields)
    base = copy.deepcopy(task.base)
    # A deep copy drops transformers' loading marks, and without them train_new_weights finds no new weights.
    copy_loading_marks(task.base, base)
    model, _ = trainable(base, config)  # full fine-tuning: the plain model with SlimFit's transform
    schedule = find_slimfit(model)
    # Every parameter goes to AdamW: SlimFit decides per step which get gradients; AdamW skips (and keeps no
    # state for) parameters whose gradient is None.
    optimizer = adamw(model, task.lr_adapter, every=True) if stack else adamw(model, task.lr_full, task, every=True)
    schedule.slimfit_attach(optimizer)
    return Setup(
        model, optimizer, after_step=lambda: schedule.slimfit_step(optimizer), history=schedule.slimfit_history
    )


def all_methods() -> dict[str, Method]:
    methods = [
        Method("full-ft", full_ft),
        Method("lora", lora),
        Method("lora+ckpt", lambda t, s: lora(t, s, checkpointing=True), "transformers' activation checkpointing"),
        Method(
            "lora+offload",
            lambda t, s: lora(t, s, offload=True),
            "torch.autograd.graph.save_on_cpu: the saved activations are held in host memory (on a CPU run it "
            "moves nothing, so it shows only the hooks' cost)",
        ),
        Method("lora-fa", lora_fa, "peft.optimizers.create_lorafa_optimizer (frozen A)"),
    ]
    for ratio in TOKEN_RATIOS:
        methods.append(Method(f"tokentune-{ratio:g}+lora", lambda t, s, r=ratio: tokentune(t, s, r)))
    for ratio in FREEZE_RATIOS:
        for compression in (True, False):
            name = f"slimfit-{ratio:g}" + ("+comp" if compression else "")
            build = lambda t, s, r=ratio, c=compression: slimfit(t, s, r, c)  # noqa: E731
            methods.append(Method(name, build, RELEASE_NOTE, needs_slimfit=True))
    methods.append(
        Method(
            "slimfit-0.9+tokentune-0.2+lora+comp",
            lambda t, s: slimfit(t, s, 0.9, compression=True, stack=True),
            "the full stack",
            needs_slimfit=True,
        )
    )
    return {method.name: method for method in methods}


def slimfit_available() -> bool:
    return hasattr(peft_slim, "SlimFitConfig")
