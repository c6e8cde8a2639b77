"""Configuration of TokenTune: backpropagate through a subset of tokens."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ..configuration import check_names
from ..token_selection import TokenSelectionConfig
from ..token_selection.config import check_selection
from ..tuner import MethodConfig


@dataclass
class TokenTuneConfig(MethodConfig, TokenSelectionConfig):
    """Configuration for [`TokenTuneModel`].

    The forward pass sees every token; gradients flow only through a selected subset of positions, so
    activations are cached only for that subset. The selection fields (`token_ratio` or `num_tokens`, `prompt_ratio`,
    `selection`, `seed`) are those of [`TokenSelectionConfig`]. Through PEFT the LoRA adapter `lora` is trained;
    with `peft_slim.tokentune_` (no `lora`), the model's own weights (all, or those named by `trainable_modules`).
    """

    method: ClassVar[str] = "TOKENTUNE"

    trainable_modules: list[str] | str | None = field(
        default=None,
        metadata={
            "help": "Full fine-tuning (peft_slim.tokentune_, no `lora`) only: module names (suffix match, like LoRA's "
            "target_modules) or one regex (full match) whose parameters train. None trains every parameter."
        },
    )

    def __post_init__(self):
        MethodConfig.__post_init__(self)
        check_selection(self)
        self.trainable_modules = check_names("TokenTuneConfig.trainable_modules", self.trainable_modules)
        if self.lora is not None and self.trainable_modules is not None:
            raise ValueError(
                "TokenTuneConfig.trainable_modules applies only without `lora`; with LoRA, use "
                "`lora.target_modules` and `modules_to_save`."
            )
