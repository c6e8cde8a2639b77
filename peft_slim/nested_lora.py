"""A LoraConfig nested in another method's config: the settings refused, the saved modules merged, the injection."""

from __future__ import annotations

import copy
import difflib

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


def check_target_names(model: nn.Module, target_modules: object) -> None:
    """Refuse a ``target_modules`` list with a name that matches no module while the others match: PEFT raises only
    when none does, and would train the others silently. A regex string or "all-linear" is PEFT's to check."""
    if target_modules is None or isinstance(target_modules, str):
        return
    names = [name for name, _ in model.named_modules() if name]
    unmatched = [t for t in target_modules if not any(n == t or n.endswith(f".{t}") for n in names)]
    if not unmatched or len(unmatched) == len(target_modules):  # none matching: PEFT's own error names them
        return
    leaves = sorted({name.rsplit(".", 1)[-1] for name in names})
    closest = {t: difflib.get_close_matches(t.rsplit(".", 1)[-1], leaves, n=3, cutoff=0.5) for t in unmatched}
    described = "; ".join(f"{t!r}: {', '.join(map(repr, c)) or 'none close'}" for t, c in closest.items())
    if len(closest) == 1:
        described = ", ".join(map(repr, *closest.values())) or "none close"
    raise ValueError(
        f"Correct or remove {', '.join(map(repr, unmatched))} in lora.target_modules (the closest module names: "
        f"{described}). No module of the model has that name, so only the other names would train."
    )


def inject_lora(model: nn.Module, owner: PeftConfig, adapter_name: str, **kwargs) -> None:
    """Inject ``owner``'s nested ``lora`` adapter into ``model`` in place (``kwargs`` go to ``LoraModel``), after
    refusing a misspelt ``target_modules`` name."""
    lora = copy.deepcopy(owner.lora)
    check_target_names(model, lora.target_modules)
    lora.modules_to_save = owner.modules_to_save  # keeps LoRA off the heads PEFT wraps
    # A model that holds an adapter already has PEFT's `peft_config` dict, which a new LoraModel would adopt (and
    # write its LoraConfig into): it gets its own, and the model keeps the one it had.
    held = model.__dict__.pop("peft_config", None)
    try:
        LoraModel(model, lora, adapter_name, **kwargs)
    finally:
        if held is not None:
            model.peft_config = held
