"""Full fine-tuning with TokenTune: ``peft_slim.tokentune_(model, TokenTuneConfig(...))`` trains the model's own
weights (all, or ``trainable_modules``) through the selected tokens; the model stays a plain model."""

from __future__ import annotations

from torch import nn

from ..token_selection import TokenSelectionConfig
from ..trainable import trainable_parameter_names
from ..tuner.transform import MethodTransform
from .config import TokenTuneConfig


class TokenTuneTransform(MethodTransform):
    """What ``tokentune_`` attached to a model: the token selection; ``remove()`` takes it off."""

    config_cls = TokenTuneConfig
    transform_name = "tokentune_"

    def _token_selection(self, config: TokenTuneConfig) -> TokenSelectionConfig:
        return config.selection_config()

    def _trainable_base_parameters(self, model: nn.Module, config: TokenTuneConfig) -> list[str]:
        return trainable_parameter_names(model, config.trainable_modules, "TokenTuneConfig.trainable_modules")


def tokentune_(model: nn.Module, config: TokenTuneConfig) -> TokenTuneTransform:
    """Fine-tune ``model``'s own weights with TokenTune (``config`` without ``lora``): gradients flow through the
    selected tokens. Train in any loop or Trainer (``TokenTuneCallback`` for exact resumes); returns the handle."""
    return TokenTuneTransform(model, config)
