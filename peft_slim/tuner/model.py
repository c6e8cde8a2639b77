"""The tuner base every peft_slim method stands on: PEFT registration glue, nested LoRA, token selection,
activation compression and saving, so that a method adds only its own idea.

A method subclasses :class:`MethodTuner` and fills in at most four hooks:

* ``_check_model(model, config)``: refuse a model before anything changes;
* ``_trainable_base_parameters(model, config)``: which base parameters train (and save) without LoRA;
* ``_setup(model, config)``: the method's own state and hooks, after LoRA injection;
* ``_remove_method_hooks()``: undo ``_setup``'s hooks.

and, where its config has one, a token selection (``_token_selection(config)``).
"""

from __future__ import annotations

from typing import Any

import torch
from peft.tuners.lora import LoraLayer
from peft.tuners.tuners_utils import BaseTuner
from torch import nn

from ..compression import ActivationCompression, ActivationCompressionConfig, CompressionStats, compress_activations
from ..nested_lora import inject_lora
from ..token_selection import TokenSelectionConfig, TokenSelector
from .config import MethodConfig


class TrainingCompression:
    """Compress the activations saved in every training forward of ``model`` (train mode, grad enabled).

    Entered by a pre-hook that runs before any other, left by an always-called post-hook registered after the
    others (after a token selector's loss, whose saved tensors are compressed too, and after an exception).
    """

    def __init__(self, model: nn.Module, config: ActivationCompressionConfig):
        self.config = config
        self.last_stats: CompressionStats | None = None
        self._context: ActivationCompression | None = None
        self._handles = [
            model.register_forward_pre_hook(self._enter, prepend=True),
            model.register_forward_hook(self._exit, always_call=True),
        ]

    def _enter(self, model: nn.Module, args: tuple) -> None:
        if model.training and torch.is_grad_enabled():
            self._context = compress_activations(self.config).__enter__()
            self.last_stats = self._context.stats

    def _exit(self, model: nn.Module, args: tuple, output: Any) -> None:
        context, self._context = self._context, None
        if context is not None:
            context.__exit__(None, None, None)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


class MethodTuner(BaseTuner):
    """PEFT's ``BaseTuner`` for a peft_slim method: one adapter, no replaced modules, hooks instead.

    Trains the nested LoRA when the config has one, else the base parameters the method names. In training
    forwards the token selection (if any) and the activation compression (if any) are active. Outside
    training (eval mode or no grad) the model computes exactly what the base model (+ LoRA) does.
    """

    tuner_layer_cls = LoraLayer
    target_module_mapping: dict = {}

    def _pre_injection_hook(self, model: nn.Module, config: MethodConfig, adapter_name: str) -> None:
        self._selector: TokenSelector | None = None
        self._compression: TrainingCompression | None = None

    @property
    def method_name(self) -> str:
        return type(self).__name__.removesuffix("Model")

    # ------------------------------------------------------------------ the hooks a method fills in

    def _token_selection(self, config: MethodConfig) -> TokenSelectionConfig | None:
        """The token selection this config asks for (None: every token trains)."""
        return None

    def _check_model(self, model: nn.Module, config: MethodConfig) -> None:
        """Raise for a model the method cannot train exactly, before anything is changed."""

    def _trainable_base_parameters(self, model: nn.Module, config: MethodConfig) -> list[str]:
        """Names of the base parameters that train (and are saved) without LoRA."""
        raise NotImplementedError

    def _setup(self, model: nn.Module, config: MethodConfig) -> None:
        """The method's own state and hooks, once LoRA is injected and trainability is set."""

    def _remove_method_hooks(self) -> None:
        """Undo the hooks ``_setup`` installed."""

    # ------------------------------------------------------------------ PEFT's tuner API

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        if len(self.peft_config) > 1:
            raise ValueError(
                f"{self.method_name} supports a single adapter per model; this model already has "
                f"{sorted(self.peft_config)}."
            )
        config: MethodConfig = self.peft_config[adapter_name]
        selection = self._token_selection(config)
        if selection is not None:
            TokenSelector.check(model)
        self._check_model(model, config)
        if config.lora is not None:
            inject_lora(model, config, adapter_name, low_cpu_mem_usage=low_cpu_mem_usage, state_dict=state_dict)
        self._mark_only_adapters_as_trainable(model)
        self._setup(model, config)
        if config.inference_mode:
            model.requires_grad_(False)
            return
        if selection is not None:
            self._selector = TokenSelector.attach(model, selection)
        if config.activation_compression is not None:  # after the selector: its loss is compressed too
            self._compression = TrainingCompression(model, config.activation_compression)

    def _create_and_replace(self, *args, **kwargs):
        raise NotImplementedError(f"{self.method_name} works through hooks; it replaces no module.")

    def _prepare_adapter_config(self, peft_config: MethodConfig, model_config: dict) -> MethodConfig:
        return peft_config

    def _mark_only_adapters_as_trainable(self, model: nn.Module) -> None:
        config: MethodConfig = self._config
        if config.lora is not None:
            super()._mark_only_adapters_as_trainable(model)
            return
        trainable = set(self._trainable_base_parameters(model, config))
        for name, param in model.named_parameters():
            param.requires_grad = name in trainable

    @property
    def _config(self) -> MethodConfig:
        return self.peft_config[self.active_adapters[0]]

    # ------------------------------------------------------------------ what the last training forward did

    @property
    def last_token_mask(self) -> torch.Tensor | None:
        """The positions selected in the latest training forward ([batch, length], bool); None without selection."""
        return None if self._selector is None else self._selector.last_token_mask

    @property
    def last_compression_stats(self) -> CompressionStats | None:
        """Saved-activation bytes of the latest training forward, with `activation_compression` set."""
        return None if self._compression is None else self._compression.last_stats

    # ------------------------------------------------------------------ unloading and saving

    def remove_hooks(self) -> None:
        """Detach the method from the model (done by unload / merge_and_unload)."""
        if self._selector is not None:
            self._selector.detach()
        if self._compression is not None:
            self._compression.remove()
        self._remove_method_hooks()

    def _unload_and_optionally_merge(self, *args, **kwargs):
        self.remove_hooks()
        return super()._unload_and_optionally_merge(*args, **kwargs)

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        if config.lora is not None:
            return super()._get_adapter_state_dict(model, config, adapter_name, state_dict, unwanted_adapter_names)
        tuner = getattr(model, "base_model", None)
        if not isinstance(tuner, cls):
            raise ValueError(f"{cls.__name__}: saving needs the PeftModel that holds the tuner.")
        # By name and from ``state_dict``'s tensors: under FSDP those are gathered, the model's are shards.
        prefix = next(name for name, module in model.named_modules() if module is tuner.model) + "."
        return {
            key: value
            for key, value in state_dict.items()
            if key.startswith(prefix) and tuner._saves_base_tensor(key[len(prefix) :], value)
        }

    def _saves_base_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        """Without LoRA: whether base parameter ``name`` (relative to the base model), now ``tensor``, is saved."""
        raise NotImplementedError
