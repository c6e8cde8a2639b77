"""Make peft_slim's methods PEFT types: a ``PeftType`` member added (``compat.add_enum_member``), then registered;
both idempotent."""

from __future__ import annotations

from peft.utils import register_peft_method
from peft.utils.peft_types import PeftType

from .compat import add_enum_member


def add_peft_type(name: str) -> PeftType:
    """Return ``PeftType[name]``, adding the member first if PEFT does not know it."""
    return add_enum_member(PeftType, name)


def register_method(name: str, config_cls: type, model_cls: type) -> PeftType:
    """Register ``config_cls``/``model_cls`` with PEFT under ``name`` (lower case), once."""
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    peft_type = add_peft_type(name.upper())
    if peft_type in PEFT_TYPE_TO_CONFIG_MAPPING or peft_type in PEFT_TYPE_TO_TUNER_MAPPING:
        return peft_type
    # LoRA's prefix ("lora_"), so that PEFT's missing-key reports and weight conversions see the parameters.
    register_peft_method(name=name, config_cls=config_cls, model_cls=model_cls, prefix=model_cls.prefix)
    return peft_type
