"""Which base-model parameters a method trains when it trains base weights (not LoRA), and which modules are PEFT's
own to train and save (``modules_to_save``, trainable tokens)."""

from __future__ import annotations

import re

from torch import nn

from .compat import AuxiliaryTrainingWrapper


def peft_wrapped_names(model: nn.Module, modules_to_save: list[str] | None = None) -> list[str]:
    """Names of the modules of ``model`` that PEFT wraps (``modules_to_save``, trainable tokens), and those a config's
    ``modules_to_save`` names that it has not wrapped yet."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, AuxiliaryTrainingWrapper) or _matches(name, list(modules_to_save or []))
    ]


def is_under(name: str, modules: list[str]) -> bool:
    """Whether parameter or module ``name`` is one of ``modules`` or inside one."""
    return any(name == module or name.startswith(module + ".") for module in modules)


def trainable_parameter_names(model: nn.Module, targets: list[str] | str | None, field: str) -> list[str]:
    """Names of the parameters under modules matching ``targets`` (names, suffix match as LoRA's; or one regex, full
    match; None: all), PEFT's wrappers left to PEFT; ``field`` names the config field in errors."""
    wrapped = peft_wrapped_names(model)
    selected = set()
    for module_name, module in model.named_modules():
        if targets is not None and not _matches(module_name, targets):
            continue
        for param_name, param in module.named_parameters(prefix=module_name, recurse=True):
            if not is_under(param_name, wrapped):
                selected.add(id(param))
    if targets is not None and not selected:
        raise ValueError(f"{field}={targets!r} matched no module of the model.")
    # A tied tensor (GPT-2's lm_head and wte) named once, by its canonical name, whichever module was named.
    return [name for name, param in model.named_parameters() if id(param) in selected]


def _matches(module_name: str, targets: list[str] | str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, module_name) is not None
    return any(module_name == t or module_name.endswith("." + t) for t in targets)
