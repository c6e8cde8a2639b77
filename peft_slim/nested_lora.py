"""A LoraConfig nested in another method's config: the settings refused, the saved modules merged, the injection."""

from __future__ import annotations

import copy

from peft import LoraConfig, LoraModel, PeftConfig
from torch import nn

from .configuration import NameList

# LoraConfig settings whose effect comes from LoraModel machinery that a peft_slim tuner does not run (it stands on
# PEFT's BaseTuner and injects the LoRA layers through a LoraModel it then drops): refused rather than ignored.
REFUSED_LORA_FIELDS = {
    "alora_invocation_tokens": "aLoRA turns the adapter on from the invocation tokens onwards through LoraModel's "
    "forward hooks, which a peft_slim model does not run",
    "arrow_config": "Arrow routes between several LoRA adapters; a peft_slim model holds one adapter",
    "monteclora_config": "MonteCLoRA's loss term is computed by LoraModel._get_monteclora_loss (and its Trainer "
    "helper looks for LoraModel instances), which a peft_slim model does not have",
    "kasa_config": "KaSA's regularisation loss is computed by LoraModel._get_kasa_loss, which a peft_slim model does "
    "not have",
}
REFUSED_LORA_INITS = {
    "eva": "EVA needs peft.initialize_lora_eva_weights, which works on a LoRA PeftModel only",
}


def check_lora_fields(lora: LoraConfig, where: str) -> None:
    """Refuse the LoraConfig settings a stacked peft_slim adapter cannot honour (ValueError naming the field)."""
    for name, why in REFUSED_LORA_FIELDS.items():
        value = getattr(lora, name, None)
        if value is not None:
            raise ValueError(
                f"{where}.{name}={value!r} is not supported: {why}. Leave it None (or train a plain LoRA adapter)."
            )
    init = lora.init_lora_weights
    if isinstance(init, str) and init.lower() in REFUSED_LORA_INITS:
        raise ValueError(
            f"{where}.init_lora_weights={init!r} is not supported: {REFUSED_LORA_INITS[init.lower()]}. Use another "
            "initialisation (e.g. True, 'gaussian', 'pissa', 'olora', 'loftq', 'corda')."
        )


def merged_modules_to_save(modules_to_save: list[str] | None, lora: LoraConfig, where: str) -> list[str] | None:
    """The owner's ``modules_to_save`` followed by those only the nested LoRA names: both are trained and saved,
    as LoRA would train and save its own (a single string is one name, as for the owner's field)."""
    names = list(modules_to_save or [])
    nested = NameList()(lora.modules_to_save, f"{where}.modules_to_save") or []
    names += [name for name in nested if name not in names]
    return names or modules_to_save


def inject_lora(model: nn.Module, owner: PeftConfig, adapter_name: str, **kwargs) -> None:
    """Inject ``owner``'s nested ``lora`` adapter into ``model`` in place (``kwargs`` go to ``LoraModel``)."""
    lora = copy.deepcopy(owner.lora)
    lora.modules_to_save = owner.modules_to_save  # keeps LoRA off the heads PEFT wraps
    # A model that holds an adapter already has PEFT's `peft_config` dict, which a new LoraModel would adopt (and
    # write its LoraConfig into): it gets its own, and the model keeps the one it had.
    held = model.__dict__.pop("peft_config", None)
    try:
        LoraModel(model, lora, adapter_name, **kwargs)
    finally:
        if held is not None:
            model.peft_config = held
