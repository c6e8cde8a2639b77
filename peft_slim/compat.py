"""Every private (underscore or internal-module) API of torch, transformers, PEFT and Python that peft_slim uses.

Each entry below names the private API, why peft_slim needs it, and what happens when a release moves it:
it either keeps working through a documented fallback (slower, or with a feature switched off and a
warning), or raises a ``RuntimeError``/``ImportError`` that names the library, its version, the missing
attribute and what to do. ``tests/test_compat.py`` exercises each one against the installed versions and
fails with the name of the private API that moved, so an upgrade that breaks one is caught in CI rather
than as a silent change of behaviour.

Nothing else in peft_slim touches a private API; add new ones here, with a test.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import os
import sys
import warnings
from collections.abc import Callable
from typing import Any

import peft.utils
import torch
import transformers
from torch import nn


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

    Fallback: None, with a warning. SlimFit's early check is then skipped; a misconfigured DDP still fails, later,
    with DDP's own "Expected to have finished reduction in the prior iteration" error.
    """
    from torch.nn.parallel import DistributedDataParallel

    getter = getattr(DistributedDataParallel, "_get_active_ddp_module", None)
    if getter is None:
        warnings.warn(
            _moved(
                "torch",
                torch.__version__,
                "DistributedDataParallel._get_active_ddp_module",
                "SlimFit cannot check that DDP was built with find_unused_parameters=True; the check is skipped.",
            ),
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return getter()


_OPTIMIZER_HOOK_DICTS = ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks")


def optimizer_step_hook_counts() -> tuple[int, int]:
    """How many global optimizer step pre-hooks and post-hooks are registered now, process-wide.

    Private API: ``torch.optim.optimizer._global_optimizer_pre_hooks`` / ``_global_optimizer_post_hooks``, the dicts
    that the public ``register_optimizer_step_pre_hook`` / ``..._post_hook`` fill. Only the tests read them, to check
    that SlimFit's step hooks go with the model (on unload, and when it is garbage-collected).

    No fallback: a RuntimeError that names the attribute.
    """
    import torch.optim.optimizer as optimizer_module

    hooks = [getattr(optimizer_module, name, None) for name in _OPTIMIZER_HOOK_DICTS]
    if not all(isinstance(found, dict) for found in hooks):
        raise RuntimeError(
            _moved(
                "torch",
                torch.__version__,
                "torch.optim.optimizer._global_optimizer_pre_hooks / _global_optimizer_post_hooks",
                "the tests cannot count global optimizer step hooks.",
            )
        )
    return len(hooks[0]), len(hooks[1])


def rowwise_byte_kernels() -> tuple[Callable, Callable] | None:
    """torch's fused row-wise 8-bit quantization ops ``(prepack, unpack)``, or None where this build lacks them.

    Private API: ``torch.ops.quantized.embedding_bag_byte_prepack`` / ``embedding_bag_byte_unpack`` (internal
    kernels of quantized EmbeddingBag). ``prepack`` turns an fp32/fp16 ``[rows, n]`` tensor into a uint8
    ``[rows, n + 8]`` tensor: per row, ``n`` codes then the fp32 scale and minimum; ``unpack`` decodes it to fp32.
    Activation compression uses them on the CPU to quantize at 8 bits in one pass over memory instead of five.
    (``peft_slim.compression.quant`` also checks, once, that they code exactly as its own grid.)

    Fallback: None; quantization then takes its own packed path (same grid, slower on the CPU).
    """
    try:
        namespace = torch.ops.quantized
        return namespace.embedding_bag_byte_prepack, namespace.embedding_bag_byte_unpack
    except (AttributeError, RuntimeError):  # torch.ops raises either for a missing op
        return None


def _norm_base_classes() -> tuple[type, ...]:
    base = getattr(nn.modules.batchnorm, "_NormBase", None)
    if isinstance(base, type):
        return (base,)
    # Every public class derived from _NormBase.
    batch = (nn.BatchNorm1d, nn.BatchNorm2d, nn.BatchNorm3d, nn.SyncBatchNorm)
    instance = (nn.InstanceNorm1d, nn.InstanceNorm2d, nn.InstanceNorm3d)
    lazy = (nn.LazyBatchNorm1d, nn.LazyBatchNorm2d, nn.LazyBatchNorm3d)
    lazy += (nn.LazyInstanceNorm1d, nn.LazyInstanceNorm2d, nn.LazyInstanceNorm3d)
    return batch + instance + lazy


# Private API: ``torch.nn.modules.batchnorm._NormBase``, the common base of BatchNorm*, SyncBatchNorm and
# InstanceNorm* (and their lazy forms). Activation compression classifies a module as a "norm" by it.
# Fallback: the public classes derived from it (a third-party subclass of _NormBase alone is then classified by its
# name, as "norm" when it ends in "Norm").
NORM_BASE_CLASSES: tuple[type, ...] = _norm_base_classes()


def _conv_base_classes() -> tuple[type, ...]:
    base = getattr(nn.modules.conv, "_ConvNd", None)
    if isinstance(base, type):
        return (base,)
    # Every public class derived from _ConvNd (the lazy ones derive from these).
    return (nn.Conv1d, nn.Conv2d, nn.Conv3d, nn.ConvTranspose1d, nn.ConvTranspose2d, nn.ConvTranspose3d)


# Private API: ``torch.nn.modules.conv._ConvNd``, the common base of Conv*d and ConvTranspose*d (and lazy forms).
# Activation compression classifies a module as "linear" by it. Fallback: the public classes derived from it.
CONV_BASE_CLASSES: tuple[type, ...] = _conv_base_classes()

# Internal module paths: ``torch.nn.modules.activation`` (where nn.ReLU, nn.GELU, nn.SiLU, ... are defined) and
# ``transformers.activations`` (GELUActivation, ACT2FN's classes). Activation compression gives a module the kind
# "activation" when its class is defined in one of them. No fallback: a class that moves is classified "other".
ACTIVATION_MODULES: tuple[str, ...] = ("torch.nn.modules.activation", "transformers.activations")

_BASE_ATTR = "_base"


def storage_base(tensor: torch.Tensor) -> torch.Tensor:
    """The tensor that owns ``tensor``'s storage: ``tensor`` itself, or the tensor it is a view of.

    Private API: ``Tensor._base`` (None for a non-view, else the root tensor of the view chain). A saved tensor is
    recognised as a weight when its root is a Parameter (a frozen layer saves ``weight.t()``), and the stats of a
    storage are kept alive exactly as long as its root tensor.

    No fallback (there is no public equivalent): a clear RuntimeError.
    """
    try:
        base = getattr(tensor, _BASE_ATTR)
    except AttributeError:
        raise RuntimeError(
            _moved(
                "torch",
                torch.__version__,
                f"Tensor.{_BASE_ATTR}",
                "activation compression cannot tell a view of a weight from an activation.",
            )
        ) from None
    return tensor if base is None else base


_VERSION_ATTR = "_version"


def tensor_version(tensor: torch.Tensor) -> Any:
    """A value that changes whenever ``tensor`` (or a view sharing its storage) is modified in place.

    Private API: ``Tensor._version`` (autograd's version counter). Activation compression reuses the compressed
    copy of a tensor saved twice only while the tensor's version is unchanged, and checks at backward that no saved
    tensor was written in place since it was saved (as autograd does for the tensors it holds itself).

    Fallback: a fresh object at every call (with a warning): no compressed copy is ever reused, which is correct but
    stores a tensor saved by several operations several times, and in-place writes are not detected.
    """
    try:
        return getattr(tensor, _VERSION_ATTR)
    except AttributeError:
        warnings.warn(
            _moved(
                "torch",
                torch.__version__,
                f"Tensor.{_VERSION_ATTR}",
                "activation compression no longer shares one compressed copy between the saves of a tensor, nor "
                "detects saved tensors written in place.",
            ),
            RuntimeWarning,
            stacklevel=2,
        )
        return object()


_TO_COPY_NODE = "ToCopyBackward0"  # the generated name of the autograd node of Tensor.to(dtype)
_LEAF_ATTR = "variable"  # AccumulateGrad's attribute holding its leaf tensor


@functools.cache
def _copy_graph_problem() -> str | None:
    """Why ``autocast_copy_source`` cannot work on this torch (checked once), or None when it can. Checked on real
    tensors even when first asked inside a memory estimate's fake-tensor mode."""
    with real_operators(), torch.inference_mode(False), torch.enable_grad():
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


def _is_transformers_config(config: Any) -> bool:
    return isinstance(config, transformers.PretrainedConfig)


def get_attn_implementation(config: Any) -> str | None:
    """The attention implementation a transformers model dispatches to at each forward (e.g. "sdpa"), or None.

    Private API: ``PretrainedConfig._attn_implementation``, the config attribute every attention layer (through
    ``ALL_ATTENTION_FUNCTIONS``) and the mask builders (``AttentionMaskInterface``) read at each forward. None for
    an object that is not a transformers config (the caller refuses the model).

    No fallback: a clear RuntimeError when a transformers config no longer has it.
    """
    if not hasattr(config, "_attn_implementation"):
        if _is_transformers_config(config):
            raise RuntimeError(
                _moved(
                    "transformers",
                    transformers.__version__,
                    "PretrainedConfig._attn_implementation",
                    "TokenTune cannot read or switch the model's attention function.",
                )
            )
        return None
    return config._attn_implementation


def set_attn_implementation(config: Any, name: str) -> None:
    """Make the model of ``config`` dispatch attention (and masks) to the implementation registered as ``name``.

    Private API: the ``PretrainedConfig._attn_implementation`` setter (it also sets every sub-config). TokenTune
    switches it at the start of each training forward and back at its end, to its own registered functions; the
    public ``PreTrainedModel.set_attn_implementation`` validates and reloads kernels, too heavy for every forward.

    No fallback: a clear RuntimeError when the attribute is gone (setting a new attribute would change nothing).
    """
    if not hasattr(config, "_attn_implementation"):
        raise RuntimeError(
            _moved(
                "transformers",
                transformers.__version__,
                f"{type(config).__name__}._attn_implementation",
                "TokenTune cannot switch the model's attention function.",
            )
        )
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

    Fallback: the environment variables that function reads, when it is gone.
    """
    try:
        from transformers.integrations import is_fsdp_enabled
    except ImportError:

        def is_fsdp_enabled() -> bool:
            flags = (os.environ.get(key, "false").lower() in ("1", "true", "yes") for key in _FSDP_LOADING_ENV)
            return torch.distributed.is_available() and torch.distributed.is_initialized() and all(flags)

    return bool(is_fsdp_enabled())


_FSDP_LOADING_ENV = ("ACCELERATE_USE_FSDP", "FSDP_CPU_RAM_EFFICIENT_LOADING")


_CHECKPOINTING_ATTR = "_gradient_checkpointing_func"


def checkpointing_function(block: nn.Module, strict: bool = True) -> Callable | None:
    """The function through which transformers checkpoints ``block``'s forward, or None when it has none.

    Private API: ``GradientCheckpointingLayer._gradient_checkpointing_func``, set on every block by
    ``gradient_checkpointing_enable()`` and called by the block's forward as ``func(partial(forward, ...), *args)``.
    TokenTune wraps it so that the backward replay of a block runs under TokenTune's attention functions.

    No fallback: with ``strict``, a clear RuntimeError when the block has gradient checkpointing on but no such
    attribute (the replay would silently attend without TokenTune's recorded keys and values). ``strict=False``
    (for clean-up) returns None instead.
    """
    function = getattr(block, _CHECKPOINTING_ATTR, None)
    if function is None and strict and getattr(block, "gradient_checkpointing", False) is True:
        raise RuntimeError(
            _moved(
                "transformers",
                transformers.__version__,
                f"{type(block).__name__}.{_CHECKPOINTING_ATTR} on a block with gradient_checkpointing=True",
                "TokenTune cannot route the checkpoint replay through its attention; disable gradient checkpointing.",
            )
        )
    return function


def set_checkpointing_function(block: nn.Module, function: Callable) -> None:
    """Make ``block``'s forward checkpoint through ``function`` (see :func:`checkpointing_function`).

    No fallback: a clear RuntimeError when the block has no checkpointing function to replace.
    """
    if getattr(block, _CHECKPOINTING_ATTR, None) is None:
        raise RuntimeError(
            _moved(
                "transformers",
                transformers.__version__,
                f"{type(block).__name__}.{_CHECKPOINTING_ATTR}",
                "TokenTune cannot route the checkpoint replay through its attention; disable gradient checkpointing.",
            )
        )
    setattr(block, _CHECKPOINTING_ATTR, function)


def eager_attention_function(module: nn.Module) -> Callable | None:
    """The module-level ``eager_attention_forward`` of the modeling file that defines ``module``'s class, or None.

    Internal convention: each ``transformers.models.<arch>.modeling_<arch>`` module defines its eager attention as a
    module-level ``eager_attention_forward(module, query, key, value, attention_mask, scaling, dropout, ...)``;
    it is not in the attention registry. TokenTune's "eager" entry calls it.

    No fallback: None, and the caller raises a ValueError that asks for attn_implementation="sdpa".
    """
    return getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)


def exportable_state_cls() -> type:
    """The base class through which transformers.Trainer saves a callback's state in its checkpoints.

    Internal module: ``transformers.trainer_callback.ExportableState`` (not exported from ``transformers``). The
    Trainer writes ``state()`` of every callback that is an instance of it into ``trainer_state.json``; SlimFit's
    callback derives from it so that the freeze schedule survives a resume.

    Fallback: a stand-in base class, with a warning: training works, the schedule is not saved in checkpoints
    (a resumed run restarts it).
    """
    import transformers.trainer_callback as trainer_callback

    cls = getattr(trainer_callback, "ExportableState", None)
    if isinstance(cls, type):
        return cls
    warnings.warn(
        _moved(
            "transformers",
            transformers.__version__,
            "transformers.trainer_callback.ExportableState",
            "SlimFitCallback cannot save the freeze schedule in Trainer checkpoints; a resumed run restarts it.",
        ),
        RuntimeWarning,
        stacklevel=2,
    )
    return _ExportableStateFallback


class _ExportableStateFallback:
    """Stands in for ``transformers.trainer_callback.ExportableState`` where it is missing (see above)."""

    def state(self) -> dict:
        return {"args": {}, "attributes": {}}


# ---------------------------------------------------------------------------------------------- PEFT


def base_model_class(peft_model: Any) -> type:
    """The class of the transformers model inside ``peft_model``, as ``PeftModel.save_pretrained`` records it.

    Private API: ``PeftModel._get_base_model_class()``. ``export_lora`` writes the same ``auto_mapping`` as PEFT so
    that ``AutoPeftModel*`` can load the export.

    Fallback: ``type(peft_model.get_base_model())``, the same class for every non-prompt-learning method (LoRA).
    """
    getter = getattr(type(peft_model), "_get_base_model_class", None)
    if getter is None:
        return type(peft_model.get_base_model())
    return getter(peft_model)


def auxiliary_training_wrapper_cls() -> type:
    """The base class of the wrappers PEFT puts on ``modules_to_save`` (and trainable token embeddings).

    Internal module: ``peft.utils.other.AuxiliaryTrainingWrapper`` (not in PEFT's documented API). Parameters under
    such a wrapper are PEFT's to train and save; TokenTune and SlimFit leave them alone.

    Fallback: ``peft.utils.ModulesToSaveWrapper`` (its public subclass for ``modules_to_save``, the only one
    peft_slim configures). ImportError when neither exists.
    """
    try:
        from peft.utils.other import AuxiliaryTrainingWrapper as cls
    except ImportError:
        cls = None
    if isinstance(cls, type):
        return cls
    cls = getattr(peft.utils, "ModulesToSaveWrapper", None)
    if isinstance(cls, type):
        return cls
    raise ImportError(
        _moved(
            "peft",
            peft.__version__,
            "peft.utils.other.AuxiliaryTrainingWrapper (nor peft.utils.ModulesToSaveWrapper)",
            "peft_slim cannot tell which parameters PEFT's modules_to_save wrappers own.",
        )
    )


def lora_adapter_state_dict(
    model: nn.Module, lora: Any, adapter_name: str, state_dict: dict, unwanted_adapter_names: list[str]
) -> dict:
    """The entries of ``state_dict`` that vanilla PEFT saves for LoRA adapter ``adapter_name`` configured by ``lora``.

    Private API: ``LoraModel._get_adapter_state_dict`` (the classmethod hook through which
    ``get_peft_model_state_dict`` asks a tuner what to save). A stacked peft_slim adapter is a LoRA adapter, so it
    saves exactly what LoRA saves for the same ``LoraConfig``: the LoRA tensors (DoRA magnitudes under their saved
    names), the biases ``lora.bias`` trains, anything a later PEFT adds. Keys keep the adapter name, as PEFT expects.

    No fallback: a RuntimeError naming it (any other selection would save other keys than vanilla LoRA).
    """
    from peft import LoraModel

    hook = getattr(LoraModel, "_get_adapter_state_dict", None)
    if hook is None:
        raise RuntimeError(
            _moved("peft", peft.__version__, "LoraModel._get_adapter_state_dict", "peft_slim cannot save LoRA.")
        )
    return hook(model, lora, adapter_name, state_dict, unwanted_adapter_names)


def lora_state_dict_for_load(model: nn.Module, lora: Any, adapter_name: str, state_dict: dict) -> dict:
    """``state_dict`` (as saved: no adapter name) with the keys of ``model``'s LoRA adapter ``adapter_name``.

    Private API: ``LoraModel._remap_adapter_state_dict_for_load``, the inverse of
    :func:`lora_adapter_state_dict` (DoRA's saved names included).

    No fallback: a RuntimeError naming it.
    """
    from peft import LoraModel

    hook = getattr(LoraModel, "_remap_adapter_state_dict_for_load", None)
    if hook is None:
        raise RuntimeError(
            _moved(
                "peft",
                peft.__version__,
                "LoraModel._remap_adapter_state_dict_for_load",
                "peft_slim cannot load LoRA weights.",
            )
        )
    return hook(model, lora, adapter_name, state_dict)


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


def set_lora_input_cast(layer: nn.Module, cast: Callable) -> None:
    """Replace how PEFT's LoRA ``layer`` casts its input to the adapter's dtype (its ``_cast_input_dtype``, private).

    ``cast(x, dtype)`` is called where PEFT calls ``layer._cast_input_dtype(x, dtype)``; set on the instance.
    """
    if not callable(getattr(layer, "_cast_input_dtype", None)):
        raise RuntimeError(
            _moved(
                "peft",
                peft.__version__,
                "LoraLayer._cast_input_dtype",
                "LoRA inputs cannot be kept at the base model's width.",
            )
        )
    layer._cast_input_dtype = cast


# ---------------------------------------------------------------------------------------------- TRL


TRL_FUSED_HEAD_ARGUMENT = "fused_lm_head"
TRL_FUSED_OUTPUT_FIELDS = ("loss", "log_probs", "entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")


def calling_trainer(max_depth: int = 64) -> Any | None:
    """The ``transformers.Trainer`` (TRL's trainers derive from it) whose method is on the call stack, or None.

    Private API: ``sys._getframe`` and frame locals (CPython). TRL's fused LM head (``model(..., labels=labels,
    fused_lm_head=True)``, which TRL >= 1.0 installs on the model's forward, see ``trl.trainer.utils.
    add_fused_lm_head``) carries no sign of the objective the per-token log-probabilities feed: the SFT loss sums
    them, DPO sums them per sequence, GRPO exponentiates them. Only the trainer that calls the model knows, so a
    token-selection forward, which can be exact for SFT only, asks which trainer is calling.

    Fallback: None where frames cannot be read (another Python implementation); the caller then refuses the
    fused call with an error.
    """
    getframe = getattr(sys, "_getframe", None)
    if getframe is None:
        return None
    frame = getframe(1)
    for _ in range(max_depth):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            return owner
        frame = frame.f_back
    return None


def trl_fused_output_cls() -> type:
    """The output class of TRL's fused LM head (``trl.trainer.utils.FusedCausalLMOutput``), or a stand-in.

    Internal module: ``trl.trainer.utils`` (TRL exports ``add_fused_lm_head`` from ``trl.trainer`` but not its
    output class). TRL reads the output by attribute (``log_probs``, ``entropy``, ``is_top1``, ``label_mask``,
    ``aux_loss``), so the stand-in, a ``ModelOutput`` with the same fields, behaves the same.

    Fallback: the stand-in, silently: attribute access is all TRL relies on.
    """
    try:
        from trl.trainer.utils import FusedCausalLMOutput
    except ImportError:
        return _FusedOutputFallback
    return FusedCausalLMOutput


@dataclasses.dataclass
class _FusedOutputFallback(transformers.utils.ModelOutput):
    """Stands in for ``trl.trainer.utils.FusedCausalLMOutput`` where it is missing (see above)."""

    loss: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    log_sum_sq_probs: torch.Tensor | None = None
    mean_logits: torch.Tensor | None = None
    is_top1: torch.Tensor | None = None
    label_mask: torch.Tensor | None = None
    aux_loss: torch.Tensor | None = None


# ---------------------------------------------------------------------------------------------- fake tensors
# The memory planner (peft_slim.planner) runs one training step on tensors that have shapes but no data.

_CDATA_ATTR = "_cdata"  # a storage's address (of its StorageImpl); the same for every view and Python wrapper


def storage_key(tensor: torch.Tensor) -> int:
    """An identity of ``tensor``'s storage, the same for every view of it: its data pointer, or for a storage without
    data (meta device, fake tensors: every data pointer is 0) the address of the storage itself.

    Private API: ``UntypedStorage._cdata``. No fallback: a clear RuntimeError (only data-less tensors need it).
    """
    storage = tensor.untyped_storage()
    if storage.device.type != "meta":
        return storage.data_ptr()
    try:
        return getattr(storage, _CDATA_ATTR)
    except AttributeError:
        raise RuntimeError(
            _moved("torch", torch.__version__, f"UntypedStorage.{_CDATA_ATTR}", "memory estimates cannot run.")
        ) from None


def _fake_tensor_module():
    try:
        from torch._subclasses import fake_tensor
    except ImportError:
        raise RuntimeError(
            _moved("torch", torch.__version__, "torch._subclasses.fake_tensor", "memory estimates cannot run.")
        ) from None
    return fake_tensor


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (private API ``torch._subclasses.fake_tensor``): inside it, operators compute shapes,
    dtypes and strides only. Real tensors given to an operator are converted (``allow_non_fake_inputs``): the
    planner passes real token ids and labels, which the token selection reads.

    No fallback: a clear RuntimeError.
    """
    return _fake_tensor_module().FakeTensorMode(allow_non_fake_inputs=True)


def is_fake_tensor(tensor: Any) -> bool:
    """Whether ``tensor`` is a fake tensor (shapes, no data). False on a torch without fake tensors."""
    try:
        from torch._subclasses.fake_tensor import FakeTensor
    except ImportError:
        return False
    return isinstance(tensor, FakeTensor)


def outside_fake_mode() -> Any:
    """A context in which operators run for real again, inside a ``fake_tensor_mode()`` (a no-op outside one).

    Private API: ``torch._subclasses.fake_tensor.unset_fake_temporarily``. The token selection draws its mask from
    the real inputs there. No fallback: a clear RuntimeError.
    """
    module = _fake_tensor_module()
    if not hasattr(module, "unset_fake_temporarily"):
        raise RuntimeError(
            _moved(
                "torch",
                torch.__version__,
                "torch._subclasses.fake_tensor.unset_fake_temporarily",
                "memory estimates of token selection cannot run.",
            )
        )
    return module.unset_fake_temporarily()


def real_operators() -> Any:
    """``outside_fake_mode()`` where torch has it, else a no-op: for the package's one-time self-checks (cached for
    the process), which must see real tensors even when first run inside a memory estimate."""
    try:
        return outside_fake_mode()
    except RuntimeError:
        import contextlib

        return contextlib.nullcontext()


def torch_dispatch_mode_class() -> type:
    """``TorchDispatchMode`` (private module ``torch.utils._python_dispatch``): a Python hook on every operator call,
    which the planner uses to follow the bytes of every tensor an operator creates. No fallback: RuntimeError."""
    try:
        from torch.utils._python_dispatch import TorchDispatchMode
    except ImportError:
        raise RuntimeError(
            _moved(
                "torch",
                torch.__version__,
                "torch.utils._python_dispatch.TorchDispatchMode",
                "memory estimates cannot run.",
            )
        ) from None
    return TorchDispatchMode


def tree_leaves(tree: Any) -> list:
    """The leaves of nested tuples, lists and dicts (private module ``torch.utils._pytree``): an operator's outputs.
    Fallback: a plain recursive walk."""
    try:
        from torch.utils._pytree import tree_leaves as leaves
    except ImportError:
        leaves = None
    if leaves is not None:
        return leaves(tree)
    if isinstance(tree, (tuple, list)):
        return [leaf for item in tree for leaf in tree_leaves(item)]
    if isinstance(tree, dict):
        return [leaf for item in tree.values() for leaf in tree_leaves(item)]
    return [tree]
