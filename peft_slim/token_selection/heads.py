"""Which positions a model's head reads, so that token selection keeps them selected; heads it cannot serve exactly.

A head reading an unselected position gets a constant there: a silently wrong gradient (zero, or ~40% off for a
pooling head). So a head is accepted only where transformers' own rules say exactly which positions it reads, every
other one is refused at ``get_peft_model``. The tables below are the single source of truth: the refusal logic reads
them, and so does the test that keeps the README's "Supported and refused" list equal to them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

# Heads that read every position on its own (scored on selected positions only), by class-name suffix.
CAUSAL_LM_SUFFIXES = ("ForCausalLM", "LMHeadModel")  # selected position i scored on token i+1
PER_POSITION_SUFFIXES = ("ForTokenClassification", "ForMaskedLM")  # selected position i on its own label
# Heads that read a few positions of the sequence to classify it: accepted only when listed below.
CLASSIFICATION_SUFFIXES = tuple(f"For{inputs}Classification" for inputs in ("Sequence", "Image", "Audio", "Video"))

LAST_NON_PAD = "last_non_pad"
FIRST_POSITION = "first_position"

# Decoder classifiers that read the last non-pad token: transformers' shared implementation (every subclass of
# `transformers.modeling_layers.GenericForSequenceClassification` that keeps its `forward`: Llama, Qwen2/3,
# Mistral, Mixtral, Gemma, Phi-3, OLMo, ...), and the classes that implement the same rule in their own forward.
GENERIC_SEQUENCE_CLASSIFIER = "GenericForSequenceClassification"
LAST_NON_PAD_HEADS = (
    GENERIC_SEQUENCE_CLASSIFIER,
    "BioGptForSequenceClassification",
    "CTRLForSequenceClassification",
    "GPT2ForSequenceClassification",
    "GPTBigCodeForSequenceClassification",
    "GPTNeoXForSequenceClassification",
    "ModernBertDecoderForSequenceClassification",
    "OPTForSequenceClassification",
)

# Encoder classifiers that read position 0 ([CLS]). A value names the config field that chooses the pooling and
# the one value for which the head reads position 0 only (any other value pools several positions: refused).
FIRST_POSITION_HEADS: dict[str, tuple[str, Any] | None] = {
    "AlbertForSequenceClassification": None,
    "BertForSequenceClassification": None,
    "CamembertForSequenceClassification": None,
    "DebertaV2ForSequenceClassification": None,
    "Data2VecTextForSequenceClassification": None,
    "DistilBertForSequenceClassification": None,
    "ElectraForSequenceClassification": None,
    "ErnieForSequenceClassification": None,
    "EsmForSequenceClassification": None,
    "LayoutLMForSequenceClassification": None,
    "MobileBertForSequenceClassification": None,
    "ModernBertForSequenceClassification": ("classifier_pooling", "cls"),
    "RobertaForSequenceClassification": None,
    "RobertaPreLayerNormForSequenceClassification": None,
    "RoCBertForSequenceClassification": None,
    "UltrabertForSequenceClassification": ("classifier_pooling", "cls"),
    "XLMRobertaForSequenceClassification": None,
    "XLMRobertaXLForSequenceClassification": None,
    "BeitForImageClassification": ("use_mean_pooling", False),
    "Data2VecVisionForImageClassification": ("use_mean_pooling", False),
    "DeiTForImageClassification": None,
    "ViTForImageClassification": None,
    "ViTMSNForImageClassification": None,
}

# Classifiers whose main input is audio: their heads pool over frames (refused with that reason).
AUDIO_INPUTS = ("input_values", "input_features")


@dataclass(frozen=True)
class Head:
    """The head of a model: its kind and, for a classifier, which positions it reads."""

    kind: str  # "causal_lm", "per_position", "classification" or "none" (a bare encoder/decoder)
    rule: str | None = None  # for "classification": LAST_NON_PAD or FIRST_POSITION

    def read_positions(
        self, config: Any, input_ids: Any, batch: int, length: int, device: torch.device
    ) -> torch.Tensor | None:
        """Bool [batch, length]: the positions this head reads in a forward with ``input_ids``; None if per position.

        ``config`` is the model's config as the forward sees it (its ``pad_token_id`` now, which may have been set
        after wrapping); ``input_ids`` the forward's ``input_ids`` (None for ``inputs_embeds``, or for images).
        """
        if self.kind != "classification":
            return None
        reads = torch.zeros(batch, length, dtype=torch.bool, device=device)
        if self.rule == FIRST_POSITION:
            reads[:, 0] = True
            return reads
        # transformers' rule (GenericForSequenceClassification.forward and the classes that copy it).
        pad_token_id = _pad_token_id(config)
        if pad_token_id is None or not isinstance(input_ids, torch.Tensor):
            reads[:, -1] = True
            return reads
        if tuple(input_ids.shape) != (batch, length):
            raise ValueError(
                f"TokenTune: input_ids has shape {tuple(input_ids.shape)}, the sequence [batch, seq] = "
                f"{(batch, length)}; the position the classification head reads cannot be found."
            )
        non_pad = (input_ids.to(device) != pad_token_id).to(torch.int32)
        indices = torch.arange(length, device=device, dtype=torch.int32)
        reads[torch.arange(batch, device=device), (indices * non_pad).argmax(-1)] = True
        return reads


def _defining_head(cls: type, names) -> type | None:
    """The class of ``cls``'s MRO named in ``names`` whose ``forward`` ``cls`` uses unchanged (a subclass overriding
    ``forward`` may read other positions), else None."""
    for klass in cls.__mro__:
        if klass.__name__ in names:
            return klass if cls.forward is klass.forward else None
    return None


def _supported_classifiers() -> str:
    last = ", ".join(sorted(LAST_NON_PAD_HEADS[1:]))
    first = ", ".join(sorted(FIRST_POSITION_HEADS))
    return (
        "Supported classification heads: reading the last non-pad token, transformers' "
        f"{GENERIC_SEQUENCE_CLASSIFIER} subclasses (Llama, Qwen2, Qwen3, Mistral, Gemma, Phi-3, ...) and {last}; "
        f"reading position 0, {first} (the README's 'Supported and refused' lists them)."
    )


def head_of(model: nn.Module) -> Head:
    """The head of ``model`` (a transformers model), or a ValueError naming it when its read positions are unknown."""
    cls = type(model)
    name = cls.__name__
    kind = _kind(cls)
    if kind in ("causal_lm", "per_position"):
        return Head(kind)
    if kind is None:
        if "For" not in name and name.endswith("Model"):
            return Head("none")
        raise ValueError(
            f"TokenTune does not know which positions the head of {name} reads, so it cannot keep them selected. "
            f"Supported heads: *{', *'.join(CAUSAL_LM_SUFFIXES + PER_POSITION_SUFFIXES)}, bare *Model classes, "
            "and the classification heads listed in the README ('Supported and refused')."
        )
    if _defining_head(cls, LAST_NON_PAD_HEADS):
        return Head("classification", LAST_NON_PAD)
    klass = _defining_head(cls, FIRST_POSITION_HEADS)
    if klass is not None:
        condition = FIRST_POSITION_HEADS[klass.__name__]
        if condition is not None:
            field, value = condition
            given = getattr(model.config, field, None)
            if given != value or type(given) is not type(value):
                raise ValueError(
                    f"TokenTune cannot train {name} with config.{field}={given!r}: that head pools several "
                    f"positions, and token selection would leave most of them constant (a wrong gradient). "
                    f"Set {field}={value!r} (the head then reads position 0, which stays selected)."
                )
        return Head("classification", FIRST_POSITION)
    if getattr(cls, "main_input_name", None) in AUDIO_INPUTS:
        reason = (
            f"{name} is an audio classifier: its head pools the hidden states of all frames, so no subset of "
            "positions carries its gradient exactly. Train it without token selection (e.g. plain LoRA)."
        )
    else:
        reason = (
            f"TokenTune does not know exactly which positions the head of {name} reads (it may pool several), "
            "so it cannot keep them selected."
        )
    raise ValueError(f"{reason} {_supported_classifiers()}")


def _kind(cls: type) -> str | None:
    """The head kind of the nearest class of ``cls``'s MRO named by transformers' convention (subclasses included)."""
    for klass in cls.__mro__:
        name = klass.__name__
        if name.endswith(CAUSAL_LM_SUFFIXES):
            return "causal_lm"
        if name.endswith(PER_POSITION_SUFFIXES):
            return "per_position"
        if name.endswith(CLASSIFICATION_SUFFIXES) or name == GENERIC_SEQUENCE_CLASSIFIER:
            return "classification"
    return None


def _pad_token_id(config: Any) -> int | None:
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    return getattr(text_config, "pad_token_id", None)


def is_decoder(model: nn.Module) -> bool:
    """True for causal (decoder) attention: such models keep their last real token selected."""
    return any(getattr(module, "is_causal", False) is True for module in model.modules())
