"""Configuration of TokenTune: backpropagate through a subset of tokens."""

from __future__ import annotations

import numbers
from dataclasses import dataclass, field
from typing import Any

from peft import LoraConfig, PeftConfig
from peft.utils.peft_types import PeftType

from ..compression import ActivationCompressionConfig
from ..nested_lora import lora_export_config, lora_to_dict
from ..registry import add_peft_type

SELECTION_STRATEGIES = ("random", "supervised")
DEFAULT_TOKEN_RATIO = 0.3

add_peft_type("TOKENTUNE")


@dataclass
class TokenTuneConfig(PeftConfig):
    """Configuration for [`TokenTuneModel`].

    The forward pass sees every token; gradients flow only through a selected subset of positions, so
    activations are cached only for that subset. Give exactly one of `token_ratio` or `num_tokens`
    (neither means `token_ratio=0.3`, the paper's Llama setting). With `lora`, a LoRA adapter is trained;
    without it, the base model's own weights are (all of them, or those named by `trainable_modules`).
    """

    token_ratio: float | None = field(
        default=None,
        metadata={"help": "Fraction in (0, 1] of each sequence's real tokens that receive gradients."},
    )
    num_tokens: int | None = field(
        default=None,
        metadata={"help": "Absolute number (>= 1) of tokens per sequence that receive gradients."},
    )
    selection: str = field(
        default="random",
        metadata={
            "help": "'random': uniform per sequence, redrawn every forward (the paper). 'supervised': draw first "
            "among positions that carry a loss label, then among the rest. Head positions ([CLS], BOS and the "
            "last real token) are always selected; padding never is."
        },
    )
    seed: int | None = field(
        default=None, metadata={"help": "Seed of the selection generator, for reproducible selections."}
    )
    lora: LoraConfig | dict | None = field(
        default=None,
        metadata={"help": "A peft.LoraConfig: train this LoRA adapter. None: train the base model's weights."},
    )
    trainable_modules: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Without `lora` only: module names (suffix match, like LoRA's target_modules) or one regex "
            "(full match) whose parameters train. None trains every parameter (full fine-tuning)."
        },
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Extra modules (e.g. a new classification head) trained and saved in full, as in LoRA."},
    )
    activation_compression: ActivationCompressionConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft_slim.ActivationCompressionConfig (or its dict): compress the activations saved for "
            "backward inside every training forward. None: no compression."
        },
    )

    def __post_init__(self):
        super().__post_init__()
        self.peft_type = PeftType.TOKENTUNE
        if self.token_ratio is not None and self.num_tokens is not None:
            raise ValueError("TokenTuneConfig: give exactly one of `token_ratio` or `num_tokens`, not both.")
        if self.token_ratio is None and self.num_tokens is None:
            self.token_ratio = DEFAULT_TOKEN_RATIO
        if self.token_ratio is not None:
            if isinstance(self.token_ratio, bool) or not isinstance(self.token_ratio, numbers.Real):
                raise ValueError(f"TokenTuneConfig.token_ratio must be a float in (0, 1], got {self.token_ratio!r}.")
            if not 0.0 < float(self.token_ratio) <= 1.0:
                raise ValueError(f"TokenTuneConfig.token_ratio must be in (0, 1], got {self.token_ratio!r}.")
            self.token_ratio = float(self.token_ratio)
        if self.num_tokens is not None:
            if isinstance(self.num_tokens, bool) or not isinstance(self.num_tokens, numbers.Integral):
                raise ValueError(f"TokenTuneConfig.num_tokens must be an int >= 1, got {self.num_tokens!r}.")
            if self.num_tokens < 1:
                raise ValueError(f"TokenTuneConfig.num_tokens must be an int >= 1, got {self.num_tokens!r}.")
            self.num_tokens = int(self.num_tokens)
        if self.selection not in SELECTION_STRATEGIES:
            raise ValueError(
                f"TokenTuneConfig.selection must be one of {SELECTION_STRATEGIES}, got {self.selection!r}."
            )
        if self.seed is not None and (isinstance(self.seed, bool) or not isinstance(self.seed, numbers.Integral)):
            raise ValueError(f"TokenTuneConfig.seed must be an int or None, got {self.seed!r}.")
        if isinstance(self.lora, dict):
            self.lora = LoraConfig.from_peft_type(**self.lora)
        if self.lora is not None and not isinstance(self.lora, LoraConfig):
            raise ValueError(
                f"TokenTuneConfig.lora must be a peft.LoraConfig or None, got {type(self.lora).__name__}."
            )
        if self.lora is not None and self.trainable_modules is not None:
            raise ValueError(
                "TokenTuneConfig.trainable_modules applies only without `lora`; with LoRA, use "
                "`lora.target_modules` and `modules_to_save`."
            )
        if isinstance(self.trainable_modules, (set, tuple)):
            self.trainable_modules = sorted(self.trainable_modules)
        if self.modules_to_save is not None:
            self.modules_to_save = list(self.modules_to_save)
        if isinstance(self.activation_compression, dict):
            self.activation_compression = ActivationCompressionConfig.from_dict(self.activation_compression)
        if self.activation_compression is not None and not isinstance(
            self.activation_compression, ActivationCompressionConfig
        ):
            raise ValueError(
                "TokenTuneConfig.activation_compression must be a peft_slim.ActivationCompressionConfig, a dict or "
                f"None, got {type(self.activation_compression).__name__}."
            )

    def to_dict(self) -> dict[str, Any]:
        config = super().to_dict()
        config["lora"] = None if self.lora is None else lora_to_dict(self.lora)
        compression = self.activation_compression
        config["activation_compression"] = None if compression is None else compression.to_dict()
        return config

    def lora_export_config(self) -> LoraConfig:
        """The plain LoraConfig equivalent of this adapter, as vanilla PEFT would save it."""
        return lora_export_config(self.lora, self)
