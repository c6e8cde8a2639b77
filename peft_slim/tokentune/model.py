"""The TokenTune tuner: PEFT's entry point for token-subset training."""

from __future__ import annotations

import torch
from torch import nn

from ..token_selection import TokenSelectionConfig
from ..trainable import trainable_parameter_names
from ..tuner import MethodTuner
from .config import TokenTuneConfig


class TokenTuneModel(MethodTuner):
    """Backpropagate through a subset of tokens (Simoulin et al., EMNLP 2024), into LoRA or base weights.

    Every block runs on all tokens without gradient tracking, then again on the selected tokens with
    it; unselected keys and values enter attention as constants. The loss covers selected positions
    only, and a causal LM's head runs only on them. Outside training (eval mode or no grad) the model
    is untouched. The forward path is the shared token-selection component; this class adds which
    weights train and what is saved.
    """

    prefix: str = "tokentune_"

    def _token_selection(self, config: TokenTuneConfig) -> TokenSelectionConfig:
        return config.selection_config()

    def _trainable_base_parameters(self, model: nn.Module, config: TokenTuneConfig) -> list[str]:
        return trainable_parameter_names(model, config.trainable_modules, "TokenTuneConfig.trainable_modules")

    def _setup(self, model: nn.Module, config: TokenTuneConfig) -> None:
        self._saved_names = set(self._trainable_base_parameters(model, config)) if config.lora is None else set()

    def _saves_base_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        return name in self._saved_names  # standalone TokenTune trains these base tensors in place
