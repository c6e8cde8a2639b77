"""Every private (underscore or internal-module) API of torch, transformers, PEFT, TRL and Python that peft_slim uses.

Each entry names the private API and why peft_slim needs it. ``tests/test_compat.py`` has one test per entry that
runs it on the installed versions and fails with the name of the API that moved; CI runs them on the oldest and
the newest supported versions (``peft_slim.versions``), so no fallback is kept for releases outside that range. The
two exceptions guard against a silently wrong result rather than an old release: the autograd graph check of
``autocast_copy_source`` and the enum internals check of ``add_enum_member``. The memory planner's own private
torch APIs (fake-tensor mode, dispatch mode, pytree) live in ``peft_slim.planner.fake``.

Nothing else in peft_slim touches a private API; add new ones here (or in the planner's), with a test.
"""

from __future__ import annotations

import contextlib
import enum
import functools
import sys
from collections.abc import Callable, Iterator
from typing import Any

import peft
import torch
from peft.utils.other import AuxiliaryTrainingWrapper
from torch import nn
from torch.nn.parallel import DistributedDataParallel

# Internal module: ``transformers.trainer_callback.ExportableState`` (not exported from ``transformers``). The
# Trainer writes ``state()`` of every callback that is an instance of it into ``trainer_state.json``; SlimFit's and
# TokenTune's callbacks derive from it so that the freeze schedule and the selection generator survive a resume.
from transformers.trainer_callback import ExportableState as ExportableState


def _moved(library: str, version: str, what: str, consequence: str) -> str:
    return (
        f"peft_slim.compat: {library} {version} has no {what}, a private API that peft_slim relies on; "
        f"{consequence} Install a {library} version from peft_slim's requirements (pyproject.toml), or report this "
        "to peft_slim with the versions of torch, transformers and peft."
    )


# ---------------------------------------------------------------------------------------------- torch


def is_deepspeed_zero3_enabled() -> bool:
    """Whether transformers' DeepSpeed integration has a ZeRO-3 config active (accelerate / Trainer set it)."""
    try:
        from transformers.integrations.deepspeed import is_deepspeed_zero3_enabled as enabled
    except ImportError:  # moved: the parameters' own ds_* attributes are still checked (tuner/model_kinds.py)
        return False
    return bool(enabled())


def active_saved_tensors_pack() -> Callable | None:
    """The pack function of the innermost saved-tensor hooks active in this thread, or None.

    Private API: ``torch._C._autograd._top_saved_tensors_default_hooks``, what ``saved_tensors_hooks`` pushes.
    """
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return None if top is None else top[0]


def active_ddp_module() -> nn.Module | None:
    """The ``DistributedDataParallel`` wrapper whose forward is running right now, or None.

    Private API: ``DistributedDataParallel._get_active_ddp_module()`` (a classmethod TorchDynamo uses; DDP sets
    it for the duration of its forward). SlimFit's forward pre-hook runs on the inner model and cannot see the
    wrapper otherwise; it uses it to refuse ``find_unused_parameters=False`` before DDP's reducer fails.
    """
    return DistributedDataParallel._get_active_ddp_module()


def optimizer_running_step_hooks(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer whose ``step`` runs torch's step hooks for ``optimizer.step()``: ``optimizer`` itself, or, for a
    wrapper that skipped ``Optimizer.__init__`` and forwards ``step`` (accelerate's ``AcceleratedOptimizer``, which
    has no step hooks of its own), the optimizer it wraps (``.optimizer``), followed down.

    Private API: ``Optimizer._optimizer_step_pre_hooks``, the dict ``Optimizer.__init__`` creates and the public
    ``register_step_pre_hook`` fills. SlimFit attaches its step hooks (``slimfit_attach``) to the optimizer found.
    """
    while not hasattr(optimizer, "_optimizer_step_pre_hooks") and isinstance(
        getattr(optimizer, "optimizer", None), torch.optim.Optimizer
    ):
        optimizer = optimizer.optimizer
    return optimizer


def rowwise_byte_kernels() -> tuple[Callable, Callable] | None:
    """torch's fused row-wise 8-bit quantization ops ``(prepack, unpack)``, or None where this build lacks them.

    Private API: ``torch.ops.quantized.embedding_bag_byte_prepack`` / ``embedding_bag_byte_unpack`` (internal
    kernels of quantized EmbeddingBag). ``prepack`` turns an fp32/fp16 ``[rows, n]`` tensor into a uint8
    ``[rows, n + 8]`` tensor: per row, ``n`` codes then the fp32 scale and minimum; ``unpack`` decodes it to fp32.
    Activation compression uses them on the CPU to quantize at 8 bits in one pass over memory instead of five.
    (``peft_slim.compression.quant`` also checks, once, that they code exactly as its own grid.)

    None (a torch build without the quantized CPU kernels): quantization takes its own packed path (same grid,
    slower on the CPU), the one it takes on other devices.
    """
    try:
        namespace = torch.ops.quantized
        return namespace.embedding_bag_byte_prepack, namespace.embedding_bag_byte_unpack
    except (AttributeError, RuntimeError):  # torch.ops raises either for a missing op
        return None


# Private API: ``torch.nn.modules.batchnorm._NormBase``, the common base of BatchNorm*, SyncBatchNorm and
# InstanceNorm* (and their lazy forms). Activation compression classifies a module as a "norm" by it.
NORM_BASE_CLASSES: tuple[type, ...] = (nn.modules.batchnorm._NormBase,)

# Private API: ``torch.nn.modules.conv._ConvNd``, the common base of Conv*d and ConvTranspose*d (and lazy forms).
# Activation compression classifies a module as "linear" by it.
CONV_BASE_CLASSES: tuple[type, ...] = (nn.modules.conv._ConvNd,)

# Internal module paths: ``torch.nn.modules.activation`` (where nn.ReLU, nn.GELU, nn.SiLU, ... are defined) and
# ``transformers.activations`` (GELUActivation, ACT2FN's classes). Activation compression gives a module the kind
# "activation" when its class is defined in one of them; a class that moves is classified "other".
ACTIVATION_MODULES: tuple[str, ...] = ("torch.nn.modules.activation", "transformers.activations")


def storage_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``tensor``'s storage: ``tensor`` itself, or the tensor it is a view of.

    Private API: ``Tensor._base`` (None for a non-view, else the root tensor of the view chain). A saved tensor is
    recognised as a weight when its root is a Parameter (a frozen layer saves ``weight.t()``), and the stats of a
    storage are kept alive exactly as long as its root tensor.
    """
    base = tensor._base
    return tensor if base is None else base


def tensor_version(tensor: torch.Tensor) -> int:
    """A value that changes whenever ``tensor`` (or a view sharing its storage) is modified in place.

    Private API: ``Tensor._version`` (autograd's version counter). Activation compression reuses the compressed
    copy of a tensor saved twice only while the tensor's version is unchanged, and checks at backward that no saved
    tensor was written in place since it was saved (as autograd does for the tensors it holds itself).
    """
    return tensor._version


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, the same for every view of it: its data pointer, or for a storage without
    data (meta device, fake tensors: every data pointer is 0) the address of the storage itself.

    Private API: ``UntypedStorage._cdata`` (the address of its StorageImpl, shared by every view and Python wrapper).
    """
    storage = tensor.untyped_storage()
    if storage.device.type != "meta":
        return storage.data_ptr()
    return storage._cdata


def is_fake_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes, no data): the training code runs on them inside a memory
    estimate (``peft_slim.planner``). Private API: ``torch._subclasses.fake_tensor.FakeTensor``."""
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, FakeTensor)


def outside_fake_mode() -> Any:
    """A context in which operators run for real again, inside a memory estimate's fake-tensor mode (a no-op
    outside one). Private API: ``torch._subclasses.fake_tensor.unset_fake_temporarily``. The token selection draws
    its mask from the real inputs there; the package's one-time self-checks (cached for the process) run there."""
    from torch._subclasses.fake_tensor import unset_fake_temporarily

    return unset_fake_temporarily()


_TO_COPY_NODE = "ToCopyBackward0"  # the generated name of the autograd node of Tensor.to(dtype)
_LEAF_ATTR = "variable"  # AccumulateGrad's attribute holding its leaf tensor


@functools.cache
def _copy_graph_problem() -> str | None:
    """Why ``autocast_copy_source`` cannot work on this torch (checked once), or None when it can. Checked on real
    tensors even when first asked inside a memory estimate's fake-tensor mode."""
    with outside_fake_mode(), torch.inference_mode(False), torch.enable_grad():
        leaf = nn.Parameter(torch.ones(2))
        node = leaf.to(torch.float16).grad_fn
    if type(node).__name__ != _TO_COPY_NODE:
        return f"autograd node named {_TO_COPY_NODE} for Tensor.to(dtype) (it is {type(node).__name__})"
    try:
        source = node.next_functions[0][0]
        found = getattr(source, _LEAF_ATTR)
    except (AttributeError, IndexError, TypeError):
        return f"AccumulateGrad.{_LEAF_ATTR} behind {_TO_COPY_NODE}.next_functions"
    if found is not leaf:
        return f"AccumulateGrad.{_LEAF_ATTR} holding the leaf tensor"
    return None


def autocast_copy_source(grad_fn: Any) -> torch.Tensor | None:
    """The leaf tensor that ``grad_fn`` casts to another dtype, when it is a dtype copy of a leaf; else None.

    Private API: the autograd graph's node class name ``ToCopyBackward0`` (generated by torch's codegen) and
    ``AccumulateGrad.variable``. Under autocast, a trainable weight is saved as its lower-precision copy, whose
    ``grad_fn`` is a ``ToCopyBackward0`` of the weight's ``AccumulateGrad``: that is how activation compression
    knows to keep it as it is rather than compress it like an activation.

    No fallback (compressing weight copies would silently change gradients): a clear RuntimeError, checked once.
    """
    problem = _copy_graph_problem()
    if problem is not None:
        raise RuntimeError(
            _moved(
                "torch", torch.__version__, problem, "activation compression cannot recognise autocast weight copies."
            )
        )
    if type(grad_fn).__name__ != _TO_COPY_NODE:
        return None
    return getattr(grad_fn.next_functions[0][0], _LEAF_ATTR, None)


# ---------------------------------------------------------------------------------------------- transformers


def get_attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers model dispatches to at each forward (e.g. "sdpa"), or None.

    Private API: ``PretrainedConfig._attn_implementation``, the config attribute every attention layer (through
    ``ALL_ATTENTION_FUNCTIONS``) and the mask builders (``AttentionMaskInterface``) read at each forward. None for
    an object that is not a transformers config (the caller refuses the model).
    """
    return getattr(config, "_attn_implementation", None)


def set_attn_implementation(config: Any, name: str) -> None:
    """Make the model of ``config`` dispatch attention (and masks) to the implementation registered as ``name``.

    Private API: the ``PretrainedConfig._attn_implementation`` setter (it also sets every sub-config). TokenTune
    switches it at the start of each training forward and back at its end, to its own registered functions; the
    public ``PreTrainedModel.set_attn_implementation`` validates and reloads kernels, too heavy for every forward.
    """
    config._attn_implementation = name


_LOADED_MARK = "_is_hf_initialized"


def newly_initialized_parameters(model: nn.Module) -> list[str] | None:
    """Names of the parameters of ``model`` that ``from_pretrained`` initialised instead of loading: the checkpoint
    lacked them (its missing keys), or held them in another shape (``ignore_mismatched_sizes``). None when the model
    carries no record of a load: built from a config, or its parameters replaced since (``copy.deepcopy``).

    Private API: the ``_is_hf_initialized`` mark transformers' loader sets on every tensor it loads (so that the
    weight initialisation after it skips them). It is the only record a plain ``from_pretrained`` leaves on the
    model: the missing keys themselves go to the log and, with ``output_loading_info=True``, to the caller. A
    parameter replaced after loading has no mark (``resize_token_embeddings`` makes a new, unmarked untied LM head).

    Fallback: when no parameter has the mark (e.g. transformers renamed it), None, as for a model built from a
    config; ``tests/test_compat.py`` catches the rename.
    """
    named = list(model.named_parameters())
    marked = [getattr(param, _LOADED_MARK, False) is True for _, param in named]
    if not any(marked):
        return None
    return [name for (name, _), loaded in zip(named, marked) if not loaded]


def copy_loading_marks(source: nn.Module, copy: nn.Module) -> None:
    """Give the parameters of ``copy`` (a ``copy.deepcopy`` of ``source``, or one on the meta device) the loading
    marks of ``source``'s (see ``newly_initialized_parameters``): a deep copy of a parameter drops them."""
    copies = dict(copy.named_parameters())
    for name, param in source.named_parameters():
        if getattr(param, _LOADED_MARK, False) is True and name in copies:
            setattr(copies[name], _LOADED_MARK, True)


def loading_marks_differ_across_processes() -> bool:
    """Whether transformers' loading marks differ between the processes of this run: under accelerate's FSDP with
    CPU-RAM-efficient loading, processes other than the first receive the weights by broadcast, and transformers
    marks every tensor of theirs as loaded (``transformers.integrations.is_fsdp_enabled()``).
    """
    from transformers.integrations import is_fsdp_enabled

    return bool(is_fsdp_enabled())


def checkpointing_function(block: nn.Module) -> Callable | None:
    """The function through which transformers checkpoints ``block``'s forward, or None when it has none.

    Private API: ``GradientCheckpointingLayer._gradient_checkpointing_func``, set on every block by
    ``activation_checkpointing_enable()`` and called by the block's forward as ``func(partial(forward, ...), *args)``.
    TokenTune wraps it so that the backward replay of a block runs under TokenTune's attention functions.
    """
    return getattr(block, "_gradient_checkpointing_func", None)


def set_checkpointing_function(block: nn.Module, function: Callable) -> None:
    """Make ``block``'s forward checkpoint through ``function`` (see :func:`checkpointing_function`)."""
    block._gradient_checkpointing_func = function


@contextlib.contextmanager
def checkpointing_paused(block: nn.Module) -> Iterator[None]:
    """Run ``block``'s forward without transformers' activation checkpointing inside this context.

    Private API: ``GradientCheckpointingLayer.gradient_checkpointing``, the flag its forward reads on every call
    (``activation_checkpointing_enable()`` sets it). TokenTune recomputes a block's selected pass in backward,
    which already is a checkpoint; checkpointing that recomputation again would only compute it twice.
    """
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
    """The module-level ``eager_attention_forward`` of the modeling file that defines ``module``'s class, or None.

    Internal convention: each ``transformers.models.<arch>.modeling_<arch>`` module defines its eager attention as a
    module-level ``eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, ...)``;
    it is not in the attention registry. TokenTune's "eager" entry calls it.

    None (a modeling file without one, such as remote code): the caller raises a ValueError that asks for
    attn_implementation="sdpa".
    """
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


# ---------------------------------------------------------------------------------------------- PEFT


def auxiliary_training_wrapper_cls() -> type:
    """The base class of the wrappers PEFT puts on ``modules_to_save`` (and trainable token embeddings).

    Internal module: ``peft.utils.other.AuxiliaryTrainingWrapper`` (not in PEFT's documented API). Parameters under
    such a wrapper are PEFT's to train and save; TokenTune and SlimFit leave them alone.
    """
    return AuxiliaryTrainingWrapper


def lora_adapter_state_dict(
    model: nn.Module, lora: Any, adapter_name: str, state_dict: dict, unwanted_adapter_names: list[str]
) -> dict:
    """The entries of ``state_dict`` that vanilla PEFT saves for LoRA adapter ``adapter_name`` configured by ``lora``.

    Private API: ``LoraModel._get_adapter_state_dict`` (the classmethod hook through which
    ``get_peft_model_state_dict`` asks a tuner what to save, PEFT >= 0.21). A stacked peft_slim adapter is a LoRA
    adapter, so it saves exactly what LoRA saves for the same ``LoraConfig``: the LoRA tensors (DoRA magnitudes under
    their saved names), the biases ``lora.bias`` trains, anything a later PEFT adds. Keys keep the adapter name.
    """
    return peft.LoraModel._get_adapter_state_dict(model, lora, adapter_name, state_dict, unwanted_adapter_names)


def lora_state_dict_for_load(model: nn.Module, lora: Any, adapter_name: str, state_dict: dict) -> dict:
    """``state_dict`` (as saved: no adapter name) with the keys of ``model``'s LoRA adapter ``adapter_name``.

    Private API: ``LoraModel._remap_adapter_state_dict_for_load`` (PEFT >= 0.21), the inverse of
    :func:`lora_adapter_state_dict` (DoRA's saved names included).
    """
    return peft.LoraModel._remap_adapter_state_dict_for_load(model, lora, adapter_name, state_dict)


def set_lora_input_cast(layer: nn.Module, cast: Callable) -> None:
    """Replace how PEFT's LoRA ``layer`` casts its input to the adapter's dtype (its ``_cast_input_dtype``, private).

    ``cast(x, dtype)`` is called where PEFT calls ``layer._cast_input_dtype(x, dtype)``; set on the instance.
    """
    layer._cast_input_dtype = cast


# ---------------------------------------------------------------------------------------------- Python


_ENUM_INTERNALS = ("_member_map_", "_value2member_map_", "_member_names_")


def add_enum_member(enum_cls: type[enum.Enum], name: str) -> enum.Enum:
    """``enum_cls[name]`` (value ``name``) of a ``(str, Enum)`` class, adding the member first if it is missing.

    Private API: the ``Enum`` class internals ``_member_map_``, ``_value2member_map_`` and ``_member_names_`` (and
    ``_hashable_values_`` where Python has it). PEFT's ``PeftType`` is a closed ``(str, Enum)`` and
    ``register_peft_method`` accepts only its members; Python has no public way to add one. Idempotent.

    No fallback: a clear RuntimeError, before anything is changed, when the internals are missing.
    """
    if name in enum_cls.__members__:
        return enum_cls[name]
    if not (isinstance(enum_cls, enum.EnumMeta) and issubclass(enum_cls, str)):
        raise TypeError(f"add_enum_member needs a (str, Enum) class, got {enum_cls!r}.")
    missing = [attr for attr in _ENUM_INTERNALS if attr not in vars(enum_cls)]  # its own, not Enum's
    if missing:
        raise RuntimeError(
            _moved(
                "Python",
                sys.version.split()[0],
                f"enum internals {missing}",
                f"peft_slim cannot add {name!r} to {enum_cls.__name__}.",
            )
        )
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
    """The output class of TRL's fused LM head, ``trl.trainer.utils.FusedCausalLMOutput`` (TRL >= 1.15).

    Internal module: ``trl.trainer.utils`` (TRL exports ``add_fused_lm_head`` from ``trl.trainer`` but not its
    output class). Only asked for when TRL's fused head calls the model, so TRL is installed.
    """
    from trl.trainer.utils import FusedCausalLMOutput

    return FusedCausalLMOutput
