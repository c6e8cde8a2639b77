"""``estimate_memory``: the memory of one training step, from the model's own computation on tensors without data.

The model is built on the meta device, the PEFT config applied for real (its tensors left on the meta device, or
made fake: ``on_meta``), then one training step runs after the optimizer state has been created. Hooks,
compression, token selection, checkpointing and SlimFit's freezing all run as in training, so a new architecture
or method needs no formula here.
"""

from __future__ import annotations

import contextlib
import copy
import warnings
from dataclasses import asdict, dataclass

import torch
from peft import PeftConfig

from ..quiet import warning_silenced
from ..slimfit import SlimFitConfig
from ..tokentune import TokenTuneConfig
from .fake import attention_as_on_cpu, fake_tensor_mode, one_sequence_per_row
from .setup import (
    gradient_bytes,
    make_optimizer,
    optimizer_state_bytes,
    resolve_workload,
    training_step,
    weight_bytes,
)
from .trace import LiveBytes, Remembered


@dataclass(frozen=True)
class MemoryEstimate:
    """Bytes of one training step (in steady state: the optimizer state exists).

    ``parameters``: every parameter and buffer of the model; ``gradients``: the ``.grad`` tensors after backward;
    ``optimizer_state``: after the optimizer step; ``activations``: what the forward leaves allocated for backward
    (what autograd saves, after compression; a checkpointed block's inputs; the loss); ``peak``: the highest total
    at any moment of the step, weights, optimizer state and transients included.
    """

    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    peak: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def estimate_memory(
    model,
    peft_config: PeftConfig | None,
    batch_size: int,
    seq_len: int | None,
    optimizer: str = "adamw",
    *,
    dtype: str = "float32",
    gradient_checkpointing: bool = False,
    task: str | None = None,
) -> MemoryEstimate:
    """Estimate the memory of training ``model`` with ``peft_config`` (None: full fine-tuning), without weights.

    ``model``: a ``torch.nn.Module`` (real or on the meta device: only shapes are read), a transformers config, a
    dict, or the path / hub id of a config. ``seq_len``: tokens per sequence (None for an image model, whose config
    gives the image size). ``optimizer``: "adamw" or "sgd". ``dtype``: the weights' dtype ("float32", "bfloat16",
    "float16"). ``task``: "causal_lm", "sequence_classification" or "image_classification" (default: from the
    model's class, the config's ``architectures`` or the PEFT ``task_type``). SlimFit is sized at its worst step:
    the largest units train. Sizes are those of CPU tensors; an accelerator's allocator rounds each block up a
    little. A deep model given as a config is traced at 1, 2 and 3 blocks and scaled to its depth where that is
    exact (see ``scaled_by_depth``); else at its full depth.
    """
    step = (peft_config, batch_size, seq_len, optimizer, dtype, task, gradient_checkpointing)
    workload = resolve_workload(model, *step[:-1])
    # SlimFit trains a share of the units, which does not grow by the same number per block: never scaled.
    if workload.module is None and not isinstance(peft_config, SlimFitConfig) and depth_scalable(workload.config):
        scaled = scaled_by_depth(workload.config, step)
        if scaled is not None:
            return scaled
    return traced(workload.module or workload.config, step)


SCALING_DEPTHS = (1, 2, 3)


def depth_scalable(config) -> bool:
    """Whether every block of the model the config builds is alike as far as the config says: deeper than the
    depths traced, no setting given per layer (a list as long as the stack: layer types, sliding windows), no
    sub-config (a model of several stacks)."""
    depth = getattr(config, "num_hidden_layers", None)
    if not isinstance(depth, int) or depth <= SCALING_DEPTHS[-1]:
        return False
    values = config.to_dict()
    per_layer = [v for v in values.values() if isinstance(v, (list, tuple)) and len(v) == depth]
    nested = [v for v in values.values() if isinstance(v, dict) and "model_type" in v]
    return not per_layer and not nested


def scaled_by_depth(config, step: tuple) -> MemoryEstimate | None:
    """The estimate of the full depth from traces of the same model 1, 2 and 3 blocks deep, or None where that is not
    exact. Parameters, gradients, optimizer state and activations are sums over the blocks: each must grow by the
    same bytes per block. The peak: every moment of a step of identical blocks holds what a moment of one block's
    forward, backward or update holds plus, per other block, either its saved activations or its gradients, so no
    moment grows by more than the larger of the two per block. When the peak grows by just that from 2 to 3 blocks,
    its moment at 3 blocks is one that grows so, and it stays the highest at any depth."""
    points = []
    for depth in SCALING_DEPTHS:
        shallow = copy.deepcopy(config)
        shallow.num_hidden_layers = depth
        points.append(traced(shallow, step).to_dict())
    growth = {name: points[2][name] - points[1][name] for name in points[0]}
    if any(points[1][name] - points[0][name] != growth[name] for name in growth if name != "peak"):
        return None  # the blocks do not add alike (SlimFit's share of units, a layer pattern)
    held = growth["parameters"] + growth["optimizer_state"]
    if growth["peak"] - held != max(growth["activations"], growth["gradients"]):
        return None  # the highest moment at 3 blocks may not be the highest deeper
    extra = config.num_hidden_layers - SCALING_DEPTHS[-1]
    return MemoryEstimate(**{name: points[-1][name] + extra * growth[name] for name in growth})


def traced(model, step: tuple) -> MemoryEstimate:
    """One training step of ``model`` traced on meta tensors (fake ones where ``on_meta`` says no), at its own
    depth."""
    peft_config, batch_size, seq_len, optimizer, dtype, task, gradient_checkpointing = step
    workload, trained, inputs = training_step(
        model, peft_config, batch_size, seq_len, optimizer, dtype, task, gradient_checkpointing, "meta"
    )
    meta = on_meta(workload.task, peft_config)
    with contextlib.nullcontext() if meta else fake_tensor_mode():
        if not meta:
            _make_fake(trained)
        optimizer = make_optimizer(trained, workload.optimizer)
        held = weight_bytes(trained)
        with Remembered() if meta else contextlib.nullcontext():  # not below the trace's mode: each call once
            _create_optimizer_state(trained, optimizer)
        live = LiveBytes(on_meta=meta)
        silenced = warning_silenced(Warning, "SlimFit: an optimizer stepped twice")
        with live, one_sequence_per_row(), attention_as_on_cpu(), silenced:
            loss = trained(**inputs).loss
            activations = live.total
            loss.backward()
            del loss
            gradients = gradient_bytes(trained)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        state = optimizer_state_bytes(optimizer)
    return MemoryEstimate(held, gradients, state, activations, held + state + live.peak)


def on_meta(task: str, peft_config: PeftConfig | None) -> bool:
    """Whether the step is traced on meta tensors (about 3x fewer CPU seconds per operator than fake ones), where
    that gives the fake tensors' bytes exactly: everywhere the planner's recorded estimates were checked, except
    TokenTune with activation compression on a sequence classifier (a selection index outlives the forward there
    on meta tensors, 1 KiB in the tests' case), which stays on fake tensors."""
    compressed = getattr(peft_config, "activation_compression", None) is not None
    return not (isinstance(peft_config, TokenTuneConfig) and compressed and task == "sequence_classification")


def _create_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
    """What a real run's first step leaves: the optimizer state of the parameters that train (SlimFit: its worst
    step's units). Created by stepping on zero gradients: the state's size does not depend on its values."""
    for param in model.parameters():
        if param.requires_grad:
            param.grad = torch.zeros_like(param)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _make_fake(model: torch.nn.Module) -> None:
    """Replace every meta parameter and buffer by a fake CPU tensor of the same shape (shared ones stay shared)."""
    made: dict[int, torch.Tensor] = {}
    for module in model.modules():
        for name, tensor in [*module.named_parameters(recurse=False), *module.named_buffers(recurse=False)]:
            fake = made.get(id(tensor))
            if fake is None:
                fake = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device="cpu")
                if isinstance(tensor, torch.nn.Parameter):
                    fake = torch.nn.Parameter(fake, requires_grad=tensor.requires_grad)
                made[id(tensor)] = fake
            setattr(module, name, fake)
