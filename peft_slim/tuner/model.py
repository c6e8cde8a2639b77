"""The tuner base every peft_slim method stands on (LoRA's own model class with the method's hooks), so that a
method adds only its own idea; docs/architecture.md, "Adding a method", walks through the hooks."""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass
from typing import Any

import torch
from peft import LoraModel
from peft.tuners.tuners_utils import BaseTuner, delete_adapter
from torch import nn

from ..compression import CompressionStats
from ..lora_inputs import keep_lora_inputs_narrow
from ..nested_lora import injected_lora
from ..token_selection import TokenSelectionConfig, TokenSelector
from ..trainable import is_under, peft_wrapped_names
from ..training_context import TrainingContext
from .config import MethodConfig
from .model_kinds import check_model_kind


class InferenceOnly:
    """Refuse a training forward (train mode, grad enabled) of ``model`` while its active adapter was loaded for
    inference (its method's hooks not set up), also once PEFT's ``set_adapter`` made it trainable."""

    def __init__(self, model: nn.Module, method_name: str, adapter_name: str):
        self.model = model
        self.method_name = method_name
        self.adapter_name = adapter_name
        self._handle = None
        self.reattach()

    def reattach(self) -> None:
        if self._handle is None:
            self._handle = self.model.register_forward_pre_hook(self._refuse_training)

    def detach(self) -> None:
        if self._handle is not None:
            self._handle.remove()
            self._handle = None

    def _refuse_training(self, model: nn.Module, args: tuple) -> None:
        if model.training and torch.is_grad_enabled():
            raise ValueError(
                f"To train adapter {self.adapter_name!r}, load it with is_trainable=True (peft_slim.from_pretrained("
                f"base, folder, is_trainable=True) or peft_slim.load_adapter(model, folder, {self.adapter_name!r}, "
                f"is_trainable=True)): it was loaded for inference, without {self.method_name}'s token selection, "
                "schedule and compression. For inference, call model.eval() or run under torch.no_grad()."
            )


def _names_adapter(parameter_name: str, adapter_name: str) -> bool:
    """Whether a parameter name is one of adapter ``adapter_name``'s (PEFT puts the name as one dotted part)."""
    return f".{adapter_name}." in parameter_name or parameter_name.endswith(f".{adapter_name}")


@dataclass(eq=False)
class AdapterState:
    """One adapter's method state (``MethodTuner._states``, by adapter name); a method subclasses it with what its
    ``_setup`` fills in (``state_cls``)."""

    selector: TokenSelector | None = None
    context: TrainingContext | None = None  # compression, token selection and freezing of each training forward
    inference_only: InferenceOnly | None = None

    def attach_training(self, model: nn.Module, selection, compression, freezing) -> None:
        """Attach the token selector for ``selection`` and the training context over ``compression``, the selector and
        ``freezing`` (each may be None; no context where all are): the tuner's and the transform's one way."""
        if selection is not None:
            self.selector = TokenSelector.attach(model, selection)
        if selection is not None or compression is not None or freezing is not None:
            self.context = TrainingContext(model, compression, self.selector, freezing)

    def _hooks(self) -> list:
        return [hooks for hooks in (self.selector, self.context, self.inference_only) if hooks is not None]

    def detach(self) -> None:
        for hooks in self._hooks():
            hooks.detach()

    def reattach(self) -> None:
        """Put the hooks back, in the order ``MethodTuner._inject`` installs them."""
        for hooks in self._hooks():
            hooks.reattach()


class MethodHooks:
    """What a method's PEFT tuner and its transform share: the hooks a method fills in, and what the last training
    forward of its active state (``_active_state()``) did."""

    def _token_selection(self, config: MethodConfig) -> TokenSelectionConfig | None:
        """The token selection this config asks for (None: every token trains)."""
        return None

    def _setup(self, model: nn.Module, config: MethodConfig) -> None:
        """The method's own state and hooks, once what trains is set (LoRA injected, for the tuner)."""

    def _remove_method_hooks(self) -> None:
        """Undo the hooks ``_setup`` installed."""

    def _freezing(self) -> Callable[[nn.Module], None] | None:
        """What to call before every forward with grad enabled, after compression and token selection are on (SlimFit
        freezes its units there); called once ``_setup`` ran."""
        return None

    @property
    def token_selector(self) -> TokenSelector | None:
        """The active token selection (TokenTune, SlimFit with ``token_selection``), or None."""
        state = self._active_state()
        return None if state is None else state.selector

    @property
    def last_token_mask(self) -> torch.Tensor | None:
        """The positions selected in the latest training forward ([batch, length], bool); None without selection."""
        selector = self.token_selector
        return None if selector is None else selector.last_token_mask

    @property
    def last_compression_stats(self) -> CompressionStats | None:
        """Saved-activation bytes of the latest training forward, with `activation_compression` set."""
        state = self._active_state()
        if state is None or state.context is None or state.context.compression is None:
            return None
        return state.context.last_stats


ONE_AT_A_TIME = (
    "a peft_slim model runs one adapter at a time (each carries its own token selection, schedule and compression, "
    "which cannot be combined)"
)

# (model, tuners): the tuners created on `model` inside `unchanged_if_raises(model)`.
_NEW_TUNERS: ContextVar[tuple[nn.Module, list] | None] = ContextVar("peft_slim_new_tuners", default=None)


@contextmanager
def unchanged_if_raises(model: nn.Module) -> Iterator[None]:
    """Run a wrap or load of ``model``: if it raises, the peft_slim tuners it put on ``model`` are taken off again."""
    token = _NEW_TUNERS.set((model, []))
    try:
        yield
    except BaseException:
        for tuner in reversed(_NEW_TUNERS.get()[1]):
            tuner._take_off()
        raise
    finally:
        _NEW_TUNERS.reset(token)


class MethodTuner(MethodHooks, LoraModel):
    """LoRA's own model class for a peft_slim method: LoRA's injection, trainability, merging, disabling, unloading
    and saving (prefix ``lora_``) of the config's nested ``lora``, with the method's hooks active in training
    forwards only. Several adapters can live on one model, each with its own ``AdapterState`` in ``_states``; only the
    active adapter's hooks are on the model (``set_adapter`` switches them)."""

    state_cls: type[AdapterState] = AdapterState  # a method's own, with the fields its ``_setup`` fills in

    def _pre_injection_hook(self, model: nn.Module, config: MethodConfig, adapter_name: str) -> None:
        # Every adapter's method state, by adapter name; the hooks of all but the active one are off the model.
        self._states: dict[str, AdapterState] = {}
        # What taking the tuner off again restores (a get_peft_model or load that raised: `_take_off`).
        self._given_requires_grad = {name: param.requires_grad for name, param in model.named_parameters()}
        watched = _NEW_TUNERS.get()
        if watched is not None and watched[0] is model:
            watched[1].append(self)

    @property
    def method_name(self) -> str:
        return type(self).__name__.removesuffix("Model")

    # ------------------------------------------------------------------ the hooks only a tuner has

    def _check_model(self, model: nn.Module, config: MethodConfig) -> None:
        """Raise for a model the method cannot train exactly, before anything is changed."""

    def _restore_method_hooks(self) -> None:
        """Install again what ``_remove_method_hooks`` removed (the adapter becomes active again)."""

    # ------------------------------------------------------------------ PEFT's tuner API

    def forward(self, *args: Any, **kwargs: Any):
        """PEFT's forward inside the active adapter's training context's ``guard()`` (left on any exception)."""
        state = self._active_state()
        if state is None or state.context is None:
            return self.model(*args, **kwargs)
        with state.context.guard():
            return self.model(*args, **kwargs)

    def inject_adapter(
        self,
        model: nn.Module,
        adapter_name: str,
        autocast_adapter_dtype: bool = True,
        low_cpu_mem_usage: bool = False,
        state_dict: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self._require_lora(self.peft_config[adapter_name])
        others = [name for name in self.peft_config if name != adapter_name]
        if not others or not self.active_adapters:
            try:
                self._inject(model, adapter_name, autocast_adapter_dtype, low_cpu_mem_usage, state_dict)
            except BaseException:
                self._take_off()  # get_peft_model refused: the model as it was given
                raise
            return
        # Another adapter (add_adapter / load_adapter): set it up as if active, park it, and leave the model as it was
        # (same adapter active, requires_grad kept, the new adapter frozen until set_adapter, as PEFT leaves a LoRA).
        if len(self.active_adapters) != 1:
            raise ValueError(
                f"{self.method_name}: add_adapter with active adapters {self.active_adapters}: {ONE_AT_A_TIME}. Call "
                "set_adapter(name) with one name."
            )
        live = self.active_adapters[0]
        kept = {param: param.requires_grad for param in model.parameters()}  # by identity, as tensors hash
        self.remove_hooks()  # the live adapter's, until it is active again below
        try:
            self.active_adapter = adapter_name
            self._inject(model, adapter_name, autocast_adapter_dtype, low_cpu_mem_usage, state_dict)
        except BaseException:
            self.remove_hooks()  # off the model: whatever hooks the failed set-up installed
            self._states.pop(adapter_name, None)
            BaseTuner.set_adapter(self, live)  # then its LoRA out again (not active: deleted without a warning)
            delete_adapter(model, adapter_name, prefix=self.prefix, layer_cls=self.tuner_layer_cls)
            raise
        else:
            self.remove_hooks()  # the new adapter's hooks wait off the model for set_adapter
        finally:
            BaseTuner.set_adapter(self, live)
            for name, param in model.named_parameters():
                if param in kept:
                    param.requires_grad = kept[param]
                elif _names_adapter(name, adapter_name):
                    param.requires_grad = False
            self._unpark(live)

    def _inject(self, model: nn.Module, adapter_name: str, autocast_dtype: bool, low_cpu_mem_usage: bool, state_dict):
        config: MethodConfig = self.peft_config[adapter_name]
        state = self._states[adapter_name] = self.state_cls()
        selection = self._token_selection(config)
        check_model_kind(model, self.method_name, selects_tokens=selection is not None)
        if selection is not None:
            TokenSelector.check(model)
            for name, why in (
                ("alora_invocation_tokens", "aLoRA's offsets count positions of the whole sequence"),
                ("monteclora_config", "MonteCLoRA's weight samples differ between the forward and its recomputation"),
            ):
                if getattr(config.lora, name) is not None:
                    raise ValueError(
                        f"{type(config).__name__}.lora.{name} is not supported with token selection: {why}. Use it "
                        "without token selection (SlimFit without `token_selection`)."
                    )
        self._check_model(model, config)
        # LoRA's own injection reads the adapter's config from `peft_config`: the nested LoRA there while it runs.
        self.peft_config[adapter_name] = injected_lora(model, config)
        try:
            super().inject_adapter(model, adapter_name, autocast_dtype, low_cpu_mem_usage, state_dict)
        finally:
            self.peft_config[adapter_name] = config
        keep_lora_inputs_narrow(model)  # no fp32 copies of bf16/fp16 inputs saved for the adapters
        if len(self.peft_config) > 1:  # only this adapter's LoRA trainable while it is set up, as PEFT sets it
            BaseTuner.set_adapter(self, adapter_name)
        self._mark_only_adapters_as_trainable(model)
        self._setup(model, config)
        if config.inference_mode:  # the method's hooks are not set up: a forward that would train it is refused
            model.requires_grad_(False)
            state.inference_only = InferenceOnly(model, self.method_name, adapter_name)
            return
        state.attach_training(model, selection, config.activation_compression, self._freezing())

    def _require_lora(self, config: MethodConfig) -> None:
        if config.lora is None:
            transform = f"peft_slim.{self.method_name.lower()}_"
            raise ValueError(
                f"{type(config).__name__}.lora is None: set lora=peft.LoraConfig(...) to train a LoRA adapter with "
                f"get_peft_model, or fine-tune the model's own weights with {transform}(model, config) (no PEFT)."
            )

    @property
    def _state(self) -> AdapterState:
        return self._states[self.active_adapters[0]]

    def _unpark(self, adapter_name: str) -> None:
        """Put back the hooks ``remove_hooks`` took off ``adapter_name`` (now active), in the order of ``_inject``."""
        self._restore_method_hooks()
        self._states[adapter_name].reattach()

    def set_adapter(self, adapter_name: str | list[str], inference_mode: bool = False) -> None:
        """PEFT's ``set_adapter`` (one name), switching the method state with it."""
        names = [adapter_name] if isinstance(adapter_name, str) else list(adapter_name)
        if len(names) != 1:
            raise ValueError(
                f"{self.method_name}: set_adapter({adapter_name!r}): {ONE_AT_A_TIME}. Give one adapter name."
            )
        (name,) = names
        if name not in self.peft_config:
            raise ValueError(
                f"{self.method_name}: set_adapter: no adapter {name!r}; this model has {sorted(self.peft_config)}."
            )
        live = self.active_adapters[0] if len(self.active_adapters) == 1 else None
        switching = live != name and name in self._states  # its hooks are off the model: put them on
        if switching and live is not None:
            self.remove_hooks()
        super().set_adapter(name, inference_mode=inference_mode)
        if switching:
            self._unpark(name)
        self._after_set_adapter()

    def _after_set_adapter(self) -> None:
        """PEFT's ``set_adapter`` just set requires_grad of the adapter's parameters (a method re-applies its own)."""

    def delete_adapter(self, adapter_name: str) -> None:
        """PEFT's ``delete_adapter`` (it refuses an unknown name) with the adapter's method state and hooks."""
        active = adapter_name in self.active_adapters  # else parked: its hooks are off the model already
        if active:
            self.remove_hooks()
        super().delete_adapter(adapter_name)
        del self._states[adapter_name]
        if active and len(self.active_adapters) == 1 and self.active_adapters[0] in self._states:
            self._unpark(self.active_adapters[0])
            self._after_set_adapter()

    def add_weighted_adapter(self, *args, **kwargs) -> None:
        raise ValueError(
            f"{self.method_name}: add_weighted_adapter is not supported: {ONE_AT_A_TIME}. Combine the adapters as "
            "plain LoRA adapters (peft.PeftModel.from_pretrained loads a saved one as such)."
        )

    @property
    def _config(self) -> MethodConfig:
        return self.peft_config[self.active_adapters[0]]

    def _active_state(self) -> AdapterState | None:
        names = self.active_adapters
        return self._states.get(names[0]) if len(names) == 1 else None

    # ------------------------------------------------------------------ unloading and saving

    def remove_hooks(self) -> None:
        """Detach the active adapter's method from the model (unload, merge_and_unload, parking it)."""
        state = self._active_state()
        if state is not None:
            state.detach()
        self._remove_method_hooks()

    def _take_off(self) -> None:
        """Undo this tuner's wrapping of a get_peft_model or load that raised: hooks off, LoRA layers and PEFT's
        wrappers out (as ``unload()``), requires_grad as given (a load refuses before it writes a value)."""
        self.remove_hooks()
        BaseTuner._unload_and_optionally_merge(self, merge=False)
        for name, param in self.model.named_parameters():
            param.requires_grad = self._given_requires_grad.get(name, param.requires_grad)

    def _unload_and_optionally_merge(self, *args, **kwargs):
        self.remove_hooks()
        return super()._unload_and_optionally_merge(*args, **kwargs)

    # Saving and loading: LoRA's, given the nested LoraConfig (which biases, DoRA's keys, ...).

    @classmethod
    def _get_adapter_state_dict(cls, model, config, adapter_name, state_dict, unwanted_adapter_names):
        return super()._get_adapter_state_dict(model, config.lora, adapter_name, state_dict, unwanted_adapter_names)

    @classmethod
    def _remap_adapter_state_dict_for_load(cls, model, config, adapter_name, state_dict):
        remapped = super()._remap_adapter_state_dict_for_load(model, config.lora, adapter_name, dict(state_dict))
        tuner = getattr(model, "base_model", None)
        if isinstance(tuner, MethodTuner):
            tuner._check_loaded(model, config, adapter_name, remapped)
        return remapped

    @classmethod
    def _convert_state_dict_for_initial_model(cls, model, peft_config, *args, **kwargs):
        raise ValueError(
            "save_pretrained: path_initial_model_for_weight_conversion converts PiSSA/CorDA/OLoRA LoRA adapters; it "
            f"does not apply to a {peft_config.peft_type} adapter. Save it (a plain LoRA adapter), load that with "
            "peft.PeftModel.from_pretrained and convert it with PEFT."
        )

    def _check_loaded(self, peft_model: nn.Module, config: MethodConfig, adapter_name: str, loaded: dict) -> None:
        """Refuse an adapter file with tensors of other shapes than this model's before any is loaded (torch would
        load the others first); warn about the keys it lacks (PEFT's ``load_adapter`` only returns them, without the
        biases ``lora.bias`` saves) and about tensors this model has no place for."""
        state_dict = peft_model.state_dict()
        wrong = [key for key, value in loaded.items() if key in state_dict and value.shape != state_dict[key].shape]
        if wrong:
            listed = ", ".join(
                f"{key}: {list(loaded[key].shape)} in the file, {list(state_dict[key].shape)} here"
                for key in wrong[:3]
            )
            raise ValueError(
                f"{self.method_name} adapter: {len(wrong)} tensor(s) of the adapter "
                f"file do not fit this model ({listed}{', ...' if len(wrong) > 3 else ''}), so nothing was loaded. "
                f"Load it onto the model it was saved from ({config.base_model_name_or_path or 'name not recorded'})."
            )
        # PEFT's rule for LoRA (LoRA's prefix and the adapter name in the key), plus the biases `lora.bias` saves.
        expected = {key for key in state_dict if "lora_" in key and _names_adapter(key, adapter_name)}
        saved_by_lora = self._get_adapter_state_dict(peft_model, config, adapter_name, state_dict, [])
        expected |= {key for key in saved_by_lora if "lora_" not in key and key in state_dict}
        missing = sorted(expected - loaded.keys())
        if missing:  # PEFT's wording
            warnings.warn(f"Found missing adapter keys while loading the checkpoint: {missing}.", stacklevel=2)
        # Not warned about: PEFT's own copies of a modules_to_save head's bias with bias="all".
        wrapped = peft_wrapped_names(peft_model)
        unexpected = sorted(key for key in loaded.keys() - state_dict.keys() if not is_under(key, wrapped))
        if unexpected:
            warnings.warn(
                f"{self.method_name} adapter: found unexpected keys (tensors this model has no place for; they were "
                f"not loaded) in the adapter file: {unexpected}.",
                stacklevel=2,
            )


def find_tuner(model: nn.Module, cls: type[MethodTuner] = MethodTuner) -> MethodTuner | None:
    """The first ``cls`` tuner inside ``model`` (a PeftModel, possibly wrapped by DDP or accelerate), or None."""
    return next((module for module in model.modules() if isinstance(module, cls)), None)
