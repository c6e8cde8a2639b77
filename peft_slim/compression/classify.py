"""What a saved tensor is: a weight (never compressed) or an activation of a kind, that of the innermost module
running when it is saved (or the one ``save_as`` marks, e.g. TokenTune's keys/values saved by the block).

The module stack comes from process-wide forward hooks, registered only while a context is active, because a model
runs modules it does not hold (transformers' kernelized functions); each stack follows only the thread and
``contextvars`` context that started it.
"""

from __future__ import annotations

import contextvars
import functools
import threading

import torch
from torch import nn
from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
from torch.utils.weak import WeakIdKeyDictionary

from ..compat import (
    ACTIVATION_MODULES,
    CONV_BASE_CLASSES,
    NORM_BASE_CLASSES,
    autocast_copy_source,
    is_fake_tensor,
    storage_base,
)

_FLOATS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_NORMS = (nn.LayerNorm, nn.GroupNorm, nn.RMSNorm, nn.LocalResponseNorm, *NORM_BASE_CLASSES)
_LINEAR = (nn.Linear, *CONV_BASE_CLASSES)


@functools.cache
def module_kind(module_type: type) -> str:
    """The kind of the tensors saved directly inside modules of this type."""
    name = module_type.__name__
    if issubclass(module_type, _LINEAR) or name == "Conv1D":
        return "linear"
    if issubclass(module_type, _NORMS) or name.endswith("Norm"):
        return "norm"
    if "Attention" in name:
        return "attention"
    if module_type.__module__ in ACTIVATION_MODULES:
        return "activation"
    return "other"


# Tensors whose kind is not their saving module's, by identity (held weakly: the mark goes with the tensor).
_MARKED: WeakIdKeyDictionary = WeakIdKeyDictionary()


def save_as(kind: str, *tensors: torch.Tensor) -> None:
    """Class ``tensors``, when autograd saves them, as ``kind`` whatever module saves them."""
    for tensor in tensors:
        _MARKED[tensor] = kind


def saved_kind(tensor: torch.Tensor, module: nn.Module | None) -> str:
    """The kind of ``tensor`` saved inside ``module`` (None: outside any): its mark, else the module's kind."""
    marked = _MARKED.get(tensor)
    if marked is not None:
        return marked
    return "other" if module is None else module_kind(type(module))


# The stacks started in the running context (a new thread starts with none; a copied context, e.g. an asyncio
# task's, has those of the code that created it).
_STARTED: contextvars.ContextVar[tuple[ModuleStack, ...]] = contextvars.ContextVar("module_stacks", default=())


class ModuleStack:
    """The modules running right now in the thread and context that ``start()``ed it, innermost last."""

    def __init__(self):
        self.modules: list[nn.Module] = []
        self._handles = []
        self._thread: int | None = None

    def start(self) -> None:
        self._thread = threading.get_ident()
        _STARTED.set((*_STARTED.get(), self))
        self._handles = [
            register_module_forward_pre_hook(self._enter),
            register_module_forward_hook(self._leave, always_call=True),
        ]

    def stop(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self.modules.clear()
        self._thread = None
        # Filtered, not reset by token (which raises if left from another context); a stale entry is inert: no thread.
        _STARTED.set(tuple(stack for stack in _STARTED.get() if stack is not self))

    def here(self) -> bool:
        """Whether the running code is in the thread and the context that started this stack."""
        return self._thread == threading.get_ident() and any(stack is self for stack in _STARTED.get())

    @property
    def innermost(self) -> nn.Module | None:
        return self.modules[-1] if self.modules else None

    def _enter(self, module: nn.Module, args) -> None:
        if self.here():
            self.modules.append(module)

    def _leave(self, module: nn.Module, args, output) -> None:
        # A module entered before start() (e.g. the one whose pre-hook started us) was never pushed.
        if self.modules and self.modules[-1] is module and self.here():
            self.modules.pop()


def is_weight(tensor: torch.Tensor, module: nn.Module | None) -> bool:
    """Whether a saved tensor is a parameter, a view of one (its root ``_base``), or an autocast copy of one: a
    trainable weight's is a ``ToCopyBackward`` of its accumulator; a frozen weight's has no history, and has the
    shape, but not the dtype, of one of the saving module's own parameters."""
    root = storage_base(tensor)
    if isinstance(root, nn.Parameter):
        return True
    grad_fn = root.grad_fn
    if grad_fn is not None:
        return isinstance(autocast_copy_source(grad_fn), nn.Parameter)
    # (Autocast's own state cannot be asked here: its dispatch key is excluded while it runs the op.)
    if module is None or root.requires_grad:
        return False
    return any(p.shape == root.shape and p.dtype != root.dtype for p in module.parameters(recurse=False))


def is_compressible(tensor: torch.Tensor, min_numel: int) -> bool:
    """Whether an activation can be stored compressed: a plain floating tensor worth it (not a statistic)."""
    return (
        # subclasses (DTensor, quantized weights, ...) are left alone; a fake tensor stands for a plain one
        (type(tensor) is torch.Tensor or is_fake_tensor(tensor))
        and tensor.layout == torch.strided
        and tensor.dtype in _FLOATS
        and tensor.numel() >= max(1, min_numel)
        # per-row statistics (keepdim reductions, e.g. a norm's inverse RMS): tiny, yet each scales a whole row
        and tensor.dim() > 0
        and tensor.shape[-1] != 1
        # an expanded (overlapping) view would grow when copied out
        and tensor.numel() * tensor.element_size() <= tensor.untyped_storage().nbytes()
    )
