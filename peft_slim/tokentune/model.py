"""The TokenTune tuner: PEFT's entry point for token-subset training."""

from __future__ import annotations

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from ..compression import CompressionStats
from ..nested_lora import inject_lora
from ..trainable import trainable_parameter_names
from .config import TokenTuneConfig
from .forward import TokenTuneForward, check_attention_implementation
from .heads import head_kind
from .selection import selection_generator


class TokenTuneModel(BaseTuner):
    """Backpropagate through a subset of tokens (Simoulin et al., EMNLP 2024), optionally into LoRA.

    Every block runs on all tokens without gradient tracking, then again on the selected tokens with
    it; unselected keys and values enter attention as constants. The loss covers selected positions
    only, and a causal LM's head runs only on them. Outside training (eval mode or no grad) the model
    is untouched. The forward path lives in [`TokenTuneForward`]; this class adds LoRA, trainability
    and saving.
    """

    prefix: str = "tokentune_"
    tuner_layer_cls = LoraLayer
    target_module_mapping: dict = {}

    def _pre_injection_hook(self, model: nn.Module, config: TokenTuneConfig, adapter_name: str) -> None:
        self._forward_path: TokenTuneForward | None = None

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if len(self.peft_config) > 1:
            raise ValueError("TokenTune supports a single adapter per model.")
        config: TokenTuneConfig = self.peft_config[adapter_name]
        check_attention_implementation(model)
        head_kind(model)  # refuse an unknown head before changing the model
        self._generator = selection_generator(config.seed)  # offset by the process's rank

        if config.lora is not None:
            inject_lora(model, config, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage, state_dict=state_dict)
        self._mark_only_adapters_as_trainable(model)
        if config.inference_mode:
            model.requires_grad_(False)
        self._forward_path = TokenTuneForward(model, config, self._generator, config.activation_compression)

    def _create_and_replace(self, *args, **kwargs):
        raise NotImplementedError("TokenTune wraps blocks with hooks; it replaces no module.")

    def _prepare_adapter_config(self, peft_config: TokenTuneConfig, model_config: dict) -> TokenTuneConfig:
        return peft_config

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        config: TokenTuneConfig = self.peft_config[self.active_adapters[0]]
        if config.lora is not None:
            super()._mark_only_adapters_as_trainable(model)
            return
        trainable = set(_standalone_trainable(model, config))
        for name, param in model.named_parameters():
            param.requires_grad = name in trainable

    @property
    def tokentune_active(self) -> bool:
        return self.model.training and torch.is_grad_enabled()

    @property
    def last_token_mask(self) -> torch.Tensor | None:
        """The positions selected in the latest training forward ([batch, length], bool)."""
        return None if self._forward_path is None else self._forward_path.last_token_mask

    @property
    def last_compression_stats(self) -> CompressionStats | None:
        """Saved-activation bytes of the latest training forward, with `activation_compression` set."""
        return None if self._forward_path is None else self._forward_path.last_compression_stats

    # ------------------------------------------------------------------ unloading and saving

    def _unload_and_optionally_merge(self, *args, **kwargs):
        self.remove_hooks()
        return super()._unload_and_optionally_merge(*args, **kwargs)

    def remove_hooks(self) -> None:
        """Detach TokenTune from the model (done by unload / merge_and_unload)."""
        if self._forward_path is not None:
            self._forward_path.remove()

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        if config.lora is not None:
            return super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        # Standalone TokenTune trains base tensors in place: save exactly those.
        names = set(_standalone_trainable(model, config))
        return {key: value for key, value in state_dict.items() if key in names}


def _standalone_trainable(model: nn.Module, config: TokenTuneConfig) -> list[str]:
    """Base parameters that standalone TokenTune trains (and saves)."""
    return trainable_parameter_names(model, config.trainable_modules, "TokenTuneConfig.trainable_modules")
