"""The TokenTune tuner: PEFT's entry point for token-subset training of a LoRA adapter."""

from __future__ import annotations

from ..token_selection import TokenSelectionConfig
from ..tuner import MethodTuner
from .config import TokenTuneConfig


class TokenTuneModel(MethodTuner):
    """Backpropagate through a subset of tokens (Simoulin et al., EMNLP 2024) into a LoRA adapter."""

    def _token_selection(self, config: TokenTuneConfig) -> TokenSelectionConfig:
        return config.selection_config()
