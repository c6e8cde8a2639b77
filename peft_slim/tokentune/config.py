"""Configuration of TokenTune: backpropagate through a subset of tokens."""

from __future__ import annotations

from typing import ClassVar

from ..configuration import ModuleNames, config_dataclass, setting
from ..token_selection import TokenSelectionConfig
from ..tuner import MethodConfig


@config_dataclass
class TokenTuneConfig(MethodConfig, TokenSelectionConfig):
    """Configuration for [`TokenTuneModel`].

    The forward pass sees every token; gradients flow only through a selected subset of positions, so
    activations are cached only for that subset. The selection fields (`token_ratio` or `num_tokens`,
    `selection`, `seed`) are those of [`TokenSelectionConfig`]. With `lora`, a LoRA adapter is trained;
    without it, the base model's own weights are (all of them, or those named by `trainable_modules`).
    """

    method: ClassVar[str] = "TOKENTUNE"

    trainable_modules: list[str] | str | None = setting(
        None,
        "Without `lora` only: module names (suffix match, like LoRA's target_modules) or one regex "
        "(full match) whose parameters train. None trains every parameter (full fine-tuning).",
        ModuleNames(),
    )

    def _check(self) -> None:
        super()._check()
        if self.lora is not None and self.trainable_modules is not None:
            raise ValueError(
                "TokenTuneConfig.trainable_modules applies only without `lora`; with LoRA, use "
                "`lora.target_modules` and `modules_to_save`."
            )
