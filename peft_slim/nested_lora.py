"""A LoraConfig nested in another method's config: the settings refused, the saved modules merged, the config LoRA's
injection is given."""

from __future__ import annotations

import copy
import difflib

from peft import LoraConfig, PeftConfig
from torch import nn

from .configuration import check_names

# LoraConfig settings a peft_slim tuner cannot honour, refused rather than ignored.
REFUSED_LORA_FIELDS = {
    "arrow_config": "Arrow routes between several LoRA adapters active at once; a peft_slim model runs one at a time",
}
REFUSED_LORA_INITS = {
    "eva": "peft.initialize_lora_eva_weights rewrites LoRA settings (target_modules, rank_pattern) on the adapter's "
    "config, which for a peft_slim adapter live in its nested LoRA",
}


def check_lora_fields(lora: LoraConfig, where: str) -> None:
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
    """The owner's ``modules_to_save`` followed by those only the nested LoRA names (both train and save)."""
    names = list(modules_to_save or [])
    nested = check_names(f"{where}.modules_to_save", lora.modules_to_save, regex=False) or []
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


def injected_lora(model: nn.Module, owner: PeftConfig) -> LoraConfig:
    """What LoRA's injection is given for ``owner``'s nested ``lora``: a copy (the injection resolves
    ``target_modules`` in it; the saved config keeps what the user wrote) with the owner's ``modules_to_save``."""
    lora = copy.deepcopy(owner.lora)
    check_target_names(model, lora.target_modules)
    lora.modules_to_save = owner.modules_to_save
    return lora
