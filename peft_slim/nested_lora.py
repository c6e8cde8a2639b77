"""A LoraConfig nested in another method's config: serialised by hand, and exported as a plain LoRA config."""

from __future__ import annotations

import copy
from typing import Any

from peft import LoraConfig, LoraModel, PeftConfig
from torch import nn


def lora_to_dict(lora: LoraConfig) -> dict[str, Any]:
    """A JSON-ready dict of a nested LoraConfig (PEFT only converts top-level sets)."""
    return {key: sorted(value) if isinstance(value, set) else value for key, value in lora.to_dict().items()}


def lora_export_config(lora: LoraConfig | None, owner: PeftConfig) -> LoraConfig:
    """The plain LoraConfig that vanilla PEFT would save for ``owner``'s nested ``lora`` adapter."""
    if lora is None:
        raise ValueError(f"{type(owner).__name__}.lora is None: this adapter trains base weights, not LoRA.")
    config = LoraConfig.from_peft_type(**lora_to_dict(lora))
    config.base_model_name_or_path = owner.base_model_name_or_path
    config.revision = owner.revision
    config.task_type = owner.task_type
    config.inference_mode = True
    extra = list(getattr(owner, "modules_to_save", None) or [])
    if extra:
        config.modules_to_save = sorted(set(config.modules_to_save or []) | set(extra))
    return config


def inject_lora(model: nn.Module, owner: PeftConfig, adapter_name: str, **kwargs) -> None:
    """Inject ``owner``'s nested ``lora`` adapter into ``model`` in place (``kwargs`` go to ``LoraModel``)."""
    lora = copy.deepcopy(owner.lora)
    lora.modules_to_save = owner.modules_to_save  # keeps LoRA off the heads PEFT wraps
    LoraModel(model, lora, adapter_name, **kwargs)
