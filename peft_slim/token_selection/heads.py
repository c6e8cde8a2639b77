"""Which positions a model's head reads, so that TokenTune keeps them selected."""

from __future__ import annotations

from torch import nn

# Which positions a model's head reads, by the transformers naming convention of its class.
_HEADS = {
    "causal_lm": ("ForCausalLM", "LMHeadModel"),
    "per_position": ("ForTokenClassification", "ForMaskedLM"),
    "classification": ("ForSequenceClassification", "ForImageClassification"),
}


def head_kind(model: nn.Module) -> str:
    """'causal_lm', 'per_position', 'classification' or 'none' (a bare encoder/decoder)."""
    name = type(model).__name__
    for kind, suffixes in _HEADS.items():
        if name.endswith(suffixes):
            return kind
    if "For" not in name and name.endswith("Model"):
        return "none"
    raise ValueError(
        f"TokenTune does not know which positions the head of {name} reads, so it cannot keep them selected. "
        "Supported heads: *ForCausalLM / *LMHeadModel, *ForSequenceClassification, *ForImageClassification, "
        "*ForTokenClassification, *ForMaskedLM, and bare *Model classes."
    )


def is_decoder(model: nn.Module) -> bool:
    """True for causal (decoder) attention: such models keep their last real token selected."""
    return any(getattr(module, "is_causal", False) is True for module in model.modules())
