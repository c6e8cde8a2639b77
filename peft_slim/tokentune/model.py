"""The TokenTune tuner: PEFT's entry point for token-subset training."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from ..token_selection import TokenSelectionConfig
from ..trainable import trainable_parameter_names
from ..tuner import MethodTuner
from ..tuner.model import AdapterState, BaseWeightsSwitch
from .config import TokenTuneConfig

STANDALONE_FIX = (
    "To compare with or return to the base model, train a LoRA with TokenTune (TokenTuneConfig(lora=LoraConfig(...)): "
    "the base weights then never change), or load the base model again."
)


@dataclass(eq=False)
class TokenTuneState(AdapterState):
    """One TokenTune adapter's state: without LoRA, the base parameters it trains in place (and saves)."""

    saved_names: set[str] = field(default_factory=set)


class TokenTuneModel(MethodTuner):
    """Backpropagate through a subset of tokens (Simoulin et al., EMNLP 2024), into LoRA or base weights.

    The training forward is the shared token-selection component's (outside training the model is untouched); this
    class adds which weights train and what is saved.
    """

    prefix: str = "tokentune_"
    state_cls = TokenTuneState

    def _token_selection(self, config: TokenTuneConfig) -> TokenSelectionConfig:
        return config.selection_config()

    def _trainable_base_parameters(self, model: nn.Module, config: TokenTuneConfig) -> list[str]:
        return trainable_parameter_names(model, config.trainable_modules, "TokenTuneConfig.trainable_modules")

    def _setup(self, model: nn.Module, config: TokenTuneConfig) -> None:
        self._state.saved_names = set(self._trainable_base_parameters(model, config)) if config.lora is None else set()
        if config.lora is None:  # so that disable_adapter() reaches disable_adapter_layers (and its clear refusal)
            self.tokentune_base_weights = BaseWeightsSwitch(self.active_adapters[0])

    def disable_adapter_layers(self) -> None:
        """What PEFT's ``disable_adapter()`` calls: with LoRA, PEFT's own switch; without, refused (no originals)."""
        if self._config.lora is None:
            raise ValueError(
                "TokenTune: disable_adapter() cannot give the base model's outputs: without `lora` TokenTune trains "
                f"{len(self._state.saved_names)} base tensors in place (trainable_modules) and keeps no originals, so "
                f"there is no adapter to disable. {STANDALONE_FIX}"
            )
        super().disable_adapter_layers()

    def _unload_and_optionally_merge(self, merge: bool = True, **kwargs):
        if self._config.lora is None and not merge:
            raise ValueError(
                "TokenTune trained the base weights in place (no `lora`) and keeps no originals, so unload() cannot "
                f"return the base model. Use merge_and_unload() for the tuned model. {STANDALONE_FIX}"
            )
        return super()._unload_and_optionally_merge(merge=merge, **kwargs)

    def _saves_base_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        return name in self._state.saved_names  # standalone TokenTune trains these base tensors in place
