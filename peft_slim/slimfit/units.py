"""Scheduling units: the groups of parameters that SlimFit freezes or trains together."""

from __future__ import annotations

import re
import warnings
from collections.abc import Collection
from dataclasses import dataclass

from torch import nn
from transformers.integrations import is_fsdp_enabled

from ..compat import newly_initialized_parameters
from ..trainable import is_under, peft_wrapped_names, trainable_parameter_names
from .config import SlimFitConfig

LORA_MARK = ".lora_"  # lora_A, lora_B, lora_embedding_A/B, lora_magnitude_vector (DoRA)


@dataclass(eq=False)
class Unit:
    """One scheduling unit: parameters that are frozen, trained and scored as one."""

    name: str
    param_names: list[str]
    params: list[nn.Parameter]


def new_weights(model: nn.Module, config: SlimFitConfig) -> list[str]:
    """With `train_new_weights`: the parameters ``from_pretrained`` initialised rather than loaded."""
    if not config.train_new_weights:
        return []
    wrapped = peft_wrapped_names(model, config.modules_to_save)
    new = [name for name in newly_initialized_parameters(model) or [] if not is_under(name, wrapped)]
    if new and is_fsdp_enabled():  # with efficient loading the others get the weights by broadcast, all marked
        warnings.warn(
            f"SlimFit: under FSDP with CPU-RAM-efficient loading, transformers marks every weight as loaded on the "
            f"processes but the first, so they cannot tell which weights the checkpoint lacked ({new[:5]} here): "
            "every process schedules them like the others (train_new_weights has no effect). List them in "
            "`always_trainable` to train them at every step.",
            stacklevel=5,
        )
        return []
    return new


def find_units(model: nn.Module, config: SlimFitConfig, new: Collection[str] = (), lora: bool = True) -> list[Unit]:
    """The scheduled units of ``model``: its LoRA adapters (``lora``) or every parameter but biases, less what trains
    at every step (`always_trainable`, `modules_to_save`; for full fine-tuning norms and ``new``)."""
    wrapped = peft_wrapped_names(model, config.modules_to_save)
    always_names = set() if lora else set(new)
    if config.always_trainable is not None:
        always_names |= set(
            trainable_parameter_names(model, config.always_trainable, "SlimFitConfig.always_trainable")
        )
    if config.always_train_norms and not lora:
        always_names |= {
            f"{module_name}.{param_name}" if module_name else param_name
            for module_name, module in model.named_modules()
            if "norm" in type(module).__name__.lower()
            for param_name, _ in module.named_parameters(recurse=False)
        }
    candidates = []
    for name, param in model.named_parameters():
        if is_under(name, wrapped):
            continue  # PEFT trains and saves modules_to_save itself
        if lora and (LORA_MARK not in name or not param.requires_grad):
            continue  # a frozen base weight (or another adapter)
        trains_always = name in always_names or (not lora and (name == "bias" or name.endswith(".bias")))
        if not trains_always:
            candidates.append((name, param))
    units = _group(candidates, config, lora)
    if not units:
        raise ValueError(
            "SlimFit: no parameter left to schedule (every candidate is a bias, under `always_trainable` or "
            "`modules_to_save`"
            + (", or LoRA matched no module" if lora else "")
            + (", or missing from the checkpoint: train_new_weights" if new else "")
            + ")."
        )
    return units


def _group(candidates: list[tuple[str, nn.Parameter]], config: SlimFitConfig, lora: bool) -> list[Unit]:
    patterns = [re.compile(regex) for regex in config.units or []]
    used = [False] * len(patterns)
    groups: dict[tuple, Unit] = {}
    for name, param in candidates:
        for index, pattern in enumerate(patterns):
            if match := pattern.fullmatch(name):
                used[index] = True
                key = ("regex", index, match.groups())
                unit_name = f"{pattern.pattern}{list(match.groups()) if match.groups() else ''}"
                break
        else:
            unit_name = name.split(LORA_MARK)[0] if lora and config.lora_units == "pair" else name
            key = ("default", unit_name)
        unit = groups.setdefault(key, Unit(unit_name, [], []))
        unit.param_names.append(name)
        unit.params.append(param)
    unused = [pattern.pattern for pattern, hit in zip(patterns, used) if not hit]
    if unused:
        raise ValueError(f"SlimFitConfig.units: regex(es) {unused} matched no schedulable parameter.")
    return list(groups.values())
