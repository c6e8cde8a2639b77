"""Full fine-tuning with a peft_slim method: its hooks attached to a plain model, as torchao's ``quantize_(model,
config)``; the model trains in any loop and saves as the checkpoint it is; ``remove()`` takes the method off."""

from __future__ import annotations

from typing import Any, ClassVar

from peft.tuners.tuners_utils import BaseTunerLayer
from torch import nn

from ..token_selection import TokenSelector
from .config import MethodConfig
from .model import AdapterState, MethodHooks
from .model_kinds import check_model_kind

# Where a transform's handle sits on the model it changed: a plain attribute, so nothing of it is saved.
HANDLE = "_peft_slim_transform"


class MethodTransform(MethodHooks):
    """The handle a transform returns: what it attached to ``model`` until ``remove()``. A method subclasses it with
    ``config_cls``, ``transform_name`` and the ``MethodHooks`` it needs."""

    config_cls: ClassVar[type[MethodConfig]]
    transform_name: ClassVar[str]  # the public function, for messages
    state_cls: ClassVar[type[AdapterState]] = AdapterState

    def __init__(self, model: nn.Module, config: MethodConfig):
        name = f"peft_slim.{self.transform_name}"
        if not isinstance(config, self.config_cls):
            raise TypeError(f"{name}: config must be a {self.config_cls.__name__}, got {type(config).__name__}.")
        if config.lora is not None:
            raise ValueError(
                f"{name}: the config has `lora`; train that LoRA adapter with peft.get_peft_model(model, config). "
                f"{name} trains the model's own weights: give the config without `lora`."
            )
        if config.modules_to_save:
            raise ValueError(
                f"{name}: modules_to_save={config.modules_to_save!r} is PEFT's (a trained copy beside a frozen "
                "module); full fine-tuning trains the modules themselves: leave it unset."
            )
        if config.inference_mode:
            raise ValueError(f"{name}: inference_mode=True; a transform is for training: leave it False.")
        wrapped = [n for n, module in model.named_modules() if isinstance(module, BaseTunerLayer)]
        if wrapped or hasattr(model, "peft_config"):
            raise ValueError(
                f"{name}: the model holds PEFT adapters ({wrapped[:3] or type(model).__name__}); full fine-tuning "
                "transforms a plain model. Merge them first (merge_and_unload()), or train the adapter through PEFT."
            )
        if find_transform(model) is not None:
            raise ValueError(f"{name}: the model already has a peft_slim transform; call its remove() first.")
        self.model = model
        self._config = config
        self._state = self.state_cls()
        self._given_requires_grad = {n: p.requires_grad for n, p in model.named_parameters()}
        selection = self._token_selection(config)
        check_model_kind(model, self.method_name, selects_tokens=selection is not None)
        if selection is not None:
            TokenSelector.check(model)
        try:
            trainable = set(self._trainable_base_parameters(model, config))
            for parameter_name, param in model.named_parameters():
                param.requires_grad = parameter_name in trainable
            self._setup(model, config)
            self._state.attach_training(model, selection, config.activation_compression, self._freezing())
        except BaseException:
            self.remove()
            raise
        model.__dict__[HANDLE] = self

    @property
    def method_name(self) -> str:
        return self.config_cls.__name__.removesuffix("Config")

    def remove(self) -> None:
        """Take the method off the model, every parameter's requires_grad as given; the weights keep their training."""
        self._state.detach()
        self._remove_method_hooks()
        for parameter_name, param in self.model.named_parameters():
            param.requires_grad = self._given_requires_grad.get(parameter_name, param.requires_grad)
        if self.model.__dict__.get(HANDLE) is self:
            del self.model.__dict__[HANDLE]

    def _active_state(self) -> AdapterState:
        return self._state

    def _trainable_base_parameters(self, model: nn.Module, config: MethodConfig) -> list[str]:
        """The names of the parameters that train: all of them (a method may train fewer)."""
        return [name for name, _ in model.named_parameters()]


def find_transform(model: nn.Module, cls: type[MethodTransform] = MethodTransform) -> Any:
    """The ``cls`` handle of the transform on ``model`` or a module inside it (DDP's, accelerate's), or None."""
    for module in model.modules():
        handle = module.__dict__.get(HANDLE)
        if isinstance(handle, cls):
            return handle
    return None
