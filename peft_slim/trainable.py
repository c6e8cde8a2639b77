"""Which base-model parameters a method trains when it trains base weights (not LoRA), and which modules are PEFT's
own to train and save (``modules_to_save``, trainable tokens)."""

from __future__ import annotations

import re

from torch import nn

from .compat import AuxiliaryTrainingWrapper


def peft_wrapped_names(model: nn.Module, modules_to_save: list[str] | None = None) -> list[str]:
    """Names of the modules of ``model`` that PEFT wraps (``modules_to_save``, trainable tokens), in module order.
    With ``modules_to_save`` (a config's), also the modules it names that PEFT has not wrapped yet (it wraps them
    after the tuner is built)."""
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, AuxiliaryTrainingWrapper) or _matches(name, list(modules_to_save or []))
    ]


def is_under(name: str, modules: list[str]) -> bool:
    """Whether parameter or module ``name`` is one of ``modules`` or inside one."""
    return any(name == module or name.startswith(module + ".") for module in modules)


def trainable_parameter_names(model: nn.Module, targets: list[str] | str | None, field: str) -> list[str]:
    """Names of the parameters under modules matching ``targets`` (all parameters when None).

    ``targets`` is a list of module names (exact or dotted-suffix match, like LoRA's target_modules) or
    one regex matched against the full module name. Parameters under PEFT's own wrappers
    (``modules_to_save``) are left to PEFT. ``field`` names the config field in errors.
    """
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
    # A tied tensor (e.g. GPT-2's lm_head and wte) is one parameter: name it once, by its canonical name, so
    # that it is marked trainable and saved once whichever of its modules was named.
    return [name for name, param in model.named_parameters() if id(param) in selected]


def _matches(module_name: str, targets: list[str] | str) -> bool:
    if isinstance(targets, str):
        return re.fullmatch(targets, module_name) is not None
    return any(module_name == t or module_name.endswith("." + t) for t in targets)
