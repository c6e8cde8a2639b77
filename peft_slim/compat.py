"""Every private (underscore or internal-module) API of torch, transformers, PEFT, TRL and Python that peft_slim uses
(the planner's own: ``peft_slim.planner.fake``), each with why and a test in ``tests/project/test_compat.py``, run on
the oldest and newest supported versions, so no fallback is kept; ``autocast_copy_source`` and ``add_enum_member``
also check at run time, where a change would be silently wrong.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import torch

# Internal module: ``peft.utils.other``. The base class of PEFT's ``modules_to_save`` / trainable-token wrappers,
# whose parameters TokenTune and SlimFit leave to PEFT.
from peft.utils.other import AuxiliaryTrainingWrapper as AuxiliaryTrainingWrapper
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.nn.parallel import DistributedDataParallel

# Internal module: ``transformers.trainer_callback.ExportableState``: the Trainer saves such callbacks' ``state()`` in
# checkpoints, so SlimFit's and TokenTune's survive a resume.
from transformers.trainer_callback import ExportableState as ExportableState


def stored_callback_attribute(state: Any, callback: object, attribute: str) -> Any:
    """``attribute`` as ``callback``'s class saved it through ``ExportableState`` in ``state.stateful_callbacks`` (its
    internal format: a dict per class, or a list of them for several instances, the first read), or None."""
    stored = state.stateful_callbacks.get(type(callback).__name__)
    if isinstance(stored, list):
        stored = stored[0] if stored else None
    return stored.get("attributes", {}).get(attribute) if isinstance(stored, dict) else None


def _moved(library: str, version: str, what: str, consequence: str) -> str:
    return (
        f"peft_slim.compat: {library} {version} has no {what}, a private API that peft_slim relies on; "
        f"{consequence} Install a {library} version from peft_slim's requirements (pyproject.toml), or report this "
        "to peft_slim with the versions of torch, transformers and peft."
    )


# ---------------------------------------------------------------------------------------------- torch


def active_saved_tensors_pack() -> Callable | None:
    """The pack function of the innermost saved-tensor hooks active in this thread, or None. Private API:
    ``torch._C._autograd._top_saved_tensors_default_hooks``, what ``saved_tensors_hooks`` pushes."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def active_ddp_module() -> nn.Module | None:
    """The ``DistributedDataParallel`` wrapper whose forward is running, or None (private: its
    ``_get_active_ddp_module()``): SlimFit refuses ``find_unused_parameters=False`` before DDP's reducer fails."""
    return DistributedDataParallel._get_active_ddp_module()


def optimizer_running_step_hooks(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """``optimizer``, or for a wrapper without step hooks (accelerate's) the ``.optimizer`` it wraps, followed down:
    where SlimFit attaches its own. Private API: ``Optimizer._optimizer_step_pre_hooks``."""
    while not hasattr(optimizer, "_optimizer_step_pre_hooks") and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer
    return optimizer


def rowwise_byte_kernels() -> tuple[Callable, Callable] | None:
    """torch's fused row-wise 8-bit ops ``(prepack, unpack)``, or None where this build lacks them. Private API:
    ``torch.ops.quantized.embedding_bag_byte_prepack`` / ``_unpack``: ``[rows, n]`` to uint8 ``[rows, n + 8]``
    (codes, fp32 scale and minimum) and back; 8-bit compression on the CPU in one pass."""
    try:
        namespace = torch.ops.quantized
        return namespace.embedding_bag_byte_prepack, namespace.embedding_bag_byte_unpack
    except (AttributeError, RuntimeError):  # torch.ops raises either for a missing op
        return None


# Private APIs: ``torch.nn.modules.batchnorm._NormBase`` (BatchNorm*, InstanceNorm*) and
# ``torch.nn.modules.conv._ConvNd`` (Conv*d): activation compression's kinds "norm" and "linear".
NORM_BASE_CLASSES: tuple[type, ...] = (nn.modules.batchnorm._NormBase,)
CONV_BASE_CLASSES: tuple[type, ...] = (nn.modules.conv._ConvNd,)

# Internal module paths of torch's and transformers' activation classes: the kind "activation" (moved: "other").
ACTIVATION_MODULES: tuple[str, ...] = ("torch.nn.modules.activation", "transformers.activations")


def storage_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``tensor``'s storage (private: ``Tensor._base``): a saved ``weight.t()`` is a weight."""
    return tensor if tensor._base is None else tensor._base


def tensor_version(tensor: torch.Tensor) -> int:
    """A value that changes whenever ``tensor`` (or a view of its storage) is written in place (private:
    ``Tensor._version``), as autograd checks saved tensors."""
    return tensor._version


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, the same for every view: its data pointer, or on the meta device (every
    pointer 0) the storage's address negated (private: ``UntypedStorage._cdata``)."""
    storage = tensor.untyped_storage()
    return -storage._cdata if storage.device.type == "meta" else storage.data_ptr()


def is_fake_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` has shapes and no data (a memory estimate's): fake (private:
    ``torch._subclasses.fake_tensor.FakeTensor``) or on the meta device."""
    return isinstance(tensor, FakeTensor) or (isinstance(tensor, torch.Tensor) and tensor.device.type == "meta")


def run_device_type(tensor: torch.Tensor) -> str:
    """``tensor``'s device type for autocast and kernel choices; a meta tensor (a memory estimate) stands for CPU."""
    kind = tensor.device.type
    return "cpu" if kind == "meta" else kind


def outside_fake_mode() -> Any:
    """Operators run for real inside a memory estimate's fake-tensor mode (no-op outside one). Private API:
    ``torch._subclasses.fake_tensor.unset_fake_temporarily``."""
    return unset_fake_temporarily()


_TO_COPY_NODE = "ToCopyBackward0"  # the generated name of the autograd node of Tensor.to(dtype)
_LEAF_ATTR = "variable"  # AccumulateGrad's attribute holding its leaf tensor


@functools.cache
def _copy_graph_problem() -> str | None:
    """Why ``autocast_copy_source`` cannot work on this torch (checked once, on real tensors), or None."""
    with outside_fake_mode(), torch.inference_mode(False), torch.enable_grad():
        leaf = nn.Parameter(torch.ones(2))
        node = leaf.to(torch.float16).grad_fn
    if type(node).__name__ != _TO_COPY_NODE:
        return f"autograd node named {_TO_COPY_NODE} for Tensor.to(dtype) (it is {type(node).__name__})"
    try:
        found = getattr(node.next_functions[0][0], _LEAF_ATTR)
    except (AttributeError, IndexError, TypeError):
        return f"AccumulateGrad.{_LEAF_ATTR} behind {_TO_COPY_NODE}.next_functions"
    if found is not leaf:
        return f"AccumulateGrad.{_LEAF_ATTR} holding the leaf tensor"
    return None


def autocast_copy_source(grad_fn: Any) -> torch.Tensor | None:
    """The leaf tensor that ``grad_fn`` casts to another dtype (autocast's weight copy, which compression keeps),
    else None. Private API: the node name ``ToCopyBackward0`` and ``AccumulateGrad.variable``; checked once, a
    RuntimeError where they changed (compressing weight copies would silently change gradients)."""
    problem = _copy_graph_problem()
    if problem is not None:
        consequence = "activation compression cannot recognise autocast weight copies."
        raise RuntimeError(_moved("torch", torch.__version__, problem, consequence))
    if type(grad_fn).__name__ != _TO_COPY_NODE:
        return None
    return getattr(grad_fn.next_functions[0][0], _LEAF_ATTR, None)


# ---------------------------------------------------------------------------------------------- transformers


def get_attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers model dispatches to (e.g. "sdpa"), or None (not a transformers
    config). Private API: ``PretrainedConfig._attn_implementation``."""
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, name: str) -> None:
    """Make ``config``'s model dispatch attention (and masks) to ``name``. Private API: the
    ``PretrainedConfig._attn_implementation`` setter (the public ``set_attn_implementation`` reloads kernels)."""
    config._attn_implementation = name


_LOADED_MARK = "_is_hf_initialized"


def newly_initialized_parameters(model: nn.Module) -> list[str] | None:
    """Names of the parameters of ``model`` that ``from_pretrained`` initialised instead of loading; None without a
    record of a load. Private API: the ``_is_hf_initialized`` mark transformers' loader sets on each loaded tensor."""
    named = list(model.named_parameters())
    marked = [getattr(param, _LOADED_MARK, False) is True for _, param in named]
    return [name for (name, _), loaded in zip(named, marked) if not loaded] if any(marked) else None


def copy_loading_marks(source: nn.Module, copy: nn.Module) -> None:
    """Give ``copy``'s parameters (a deep or meta copy of ``source``, which drops them) ``source``'s loading marks."""
    copies = dict(copy.named_parameters())
    for name, param in source.named_parameters():
        if getattr(param, _LOADED_MARK, False) is True and name in copies:
            setattr(copies[name], _LOADED_MARK, True)


def checkpointing_function(block: nn.Module) -> Callable | None:
    """The function through which transformers checkpoints ``block``'s forward, or None (private:
    ``_gradient_checkpointing_func``): TokenTune wraps it so that the replay runs under its attention functions."""
    return getattr(block, "_gradient_checkpointing_func", None)


def set_checkpointing_function(block: nn.Module, function: Callable) -> None:
    """Make ``block``'s forward checkpoint through ``function`` (see :func:`checkpointing_function`)."""
    block._gradient_checkpointing_func = function


@contextlib.contextmanager
def checkpointing_paused(block: nn.Module) -> Iterator[None]:
    """Run ``block``'s forward without transformers' checkpointing (private: its ``gradient_checkpointing`` flag):
    TokenTune's recomputation already is a checkpoint."""
    enabled = getattr(block, "gradient_checkpointing", None)
    if not enabled:
        yield
        return
    block.gradient_checkpointing = False
    try:
        yield
    finally:
        block.gradient_checkpointing = enabled


def eager_attention_function(module: nn.Module) -> Callable | None:
    """The ``eager_attention_forward`` of ``module``'s modeling file (a transformers convention outside its registry),
    which TokenTune's "eager" entry calls; None for remote code."""
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


# ---------------------------------------------------------------------------------------------- PEFT


def set_lora_input_cast(layer: nn.Module, cast: Callable) -> None:
    """Replace how PEFT's LoRA ``layer`` casts its input (its private ``_cast_input_dtype``, set on the instance)."""
    layer._cast_input_dtype = cast


# ---------------------------------------------------------------------------------------------- Python


_ENUM_INTERNALS = ("_member_map_", "_value2member_map_", "_member_names_")


def add_enum_member(enum_cls: type[enum.Enum], name: str) -> enum.Enum:
    """``enum_cls[name]`` of a ``(str, Enum)`` class, added first if missing (PEFT's ``register_peft_method`` takes
    only members of its closed ``PeftType``). Private API: the ``Enum`` internals, checked before anything changes."""
    if name in enum_cls.__members__:
        return enum_cls[name]
    if not (isinstance(enum_cls, enum.EnumMeta) and issubclass(enum_cls, str)):
        raise TypeError(f"add_enum_member needs a (str, Enum) class, got {enum_cls!r}.")
    missing = [attr for attr in _ENUM_INTERNALS if attr not in vars(enum_cls)]  # its own, not Enum's
    if missing:
        consequence = f"peft_slim cannot add {name!r} to {enum_cls.__name__}."
        raise RuntimeError(_moved("Python", sys.version.split()[0], f"enum internals {missing}", consequence))
    if name in enum_cls._value2member_map_:
        raise ValueError(f"{enum_cls.__name__} already has a member with the value {name!r}.")
    member = str.__new__(enum_cls, name)
    member._name_ = name
    member._value_ = name
    member.__objclass__ = enum_cls
    enum_cls._member_map_[name] = member
    enum_cls._value2member_map_[name] = member
    enum_cls._member_names_.append(name)
    hashable = getattr(enum_cls, "_hashable_values_", None)  # Python 3.13+
    if isinstance(hashable, list) and name not in hashable:
        hashable.append(name)
    type.__setattr__(enum_cls, name, member)
    return member


# ---------------------------------------------------------------------------------------------- TRL


TRL_FUSED_HEAD_ARGUMENT = "fused_lm_head"


def trl_fused_output_cls() -> type:
    """``trl.trainer.utils.FusedCausalLMOutput`` (internal module), asked for only when TRL's fused head calls."""
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput
