"""The training step the planner sizes, built the same way for an estimate (fake tensors) and for a measurement.

A model is given as a module (real or on the meta device), a transformers config, or a path / hub id of one. Its
task (what the inputs and labels are) comes from the model's class, the config's ``architectures``, or the PEFT
config's ``task_type``. Inputs are synthetic and real (token ids, labels, pixels: small): every token is a real
token with a label, the case a budget must hold.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
from dataclasses import dataclass

import torch
import transformers
from huggingface_hub.errors import StrictDataclassError
from peft import PeftConfig, PeftModel
from torch import nn

from ..compat import copy_loading_marks, storage_key
from ..configuration import check_bool, check_int
from ..quiet import warning_silenced
from ..recipe import trainable
from ..slimfit import find_slimfit

TASKS = ("causal_lm", "sequence_classification", "image_classification")
OPTIMIZERS = ("adamw", "sgd")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_AUTO_CLASSES = {
    "causal_lm": transformers.AutoModelForCausalLM,
    "sequence_classification": transformers.AutoModelForSequenceClassification,
    "image_classification": transformers.AutoModelForImageClassification,
}
_SUFFIXES = {
    "ForCausalLM": "causal_lm",
    "LMHeadModel": "causal_lm",
    "ForSequenceClassification": "sequence_classification",
    "ForImageClassification": "image_classification",
}
TASK_TYPES = {"causal_lm": "CAUSAL_LM", "sequence_classification": "SEQ_CLS"}  # PEFT has none for images
_PEFT_TASKS = {task_type: task for task, task_type in TASK_TYPES.items()}
# The sizes of a model config that the model is built from and the inputs are drawn with: each one the config has
# must be a positive int (transformers accepts, e.g., vocab_size=0 or num_attention_heads=0, then fails deep inside
# the build or the step). A list (a per-layer size) is left to the model.
CONFIG_SIZES = (
    "vocab_size",
    "hidden_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "intermediate_size",
    "num_labels",
    "image_size",
    "patch_size",
    "num_channels",
)

# Bounds of the sizes a step is planned for, checked before anything is built (the synthetic inputs are real
# tensors): far above any real micro-batch, far below what a typo such as seq_len=10**9 asks for.
MAX_BATCH_SIZE = 2**16
MAX_TOKENS = 2**24  # tokens per micro-batch (batch_size * seq_len): Llama 3's whole global batch was 16M tokens
MAX_PIXEL_VALUES = 2**28  # pixel values per micro-batch: 1 GiB as float32 (1,783 RGB images of 224 x 224)
MAX_SEQ_LEN = MAX_TOKENS  # where the config gives no position limit


@dataclass
class Workload:
    """What one training step processes, and with what: every input of an estimate, checked."""

    module: nn.Module | None  # the model given as a module, else None (built from ``config``)
    config: transformers.PretrainedConfig
    batch_size: int
    seq_len: int | None  # tokens per sequence; None for an image model (its config gives the image size)
    task: str
    optimizer: str
    dtype: torch.dtype


def resolve_workload(model, peft_config, batch_size, seq_len, optimizer, dtype, task) -> Workload:
    """Check every input of ``estimate_memory`` / ``measure_memory`` before anything is built."""
    module = model if isinstance(model, nn.Module) else None
    config = load_config(model) if module is None else getattr(module, "config", None)
    if not isinstance(config, transformers.PretrainedConfig):  # load_config's always is
        raise ValueError(
            f"model: {type(module).__name__} has no transformers config (`.config`), which the planner reads to "
            "make its inputs; pass a transformers model, or its config."
        )
    if peft_config is not None and not isinstance(peft_config, PeftConfig):
        raise TypeError(
            f"peft_config: expected a peft.PeftConfig (e.g. peft.LoraConfig, peft_slim.TokenTuneConfig) or None "
            f"(full fine-tuning), got {type(peft_config).__name__}; build the config from a dict with "
            "peft.LoraConfig(**values) or peft_slim.TokenTuneConfig(**values)."
        )
    batch_size = check_int("batch_size", batch_size, 1, MAX_BATCH_SIZE)
    if not isinstance(optimizer, str) or optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer={optimizer!r}: expected one of {OPTIMIZERS}.")
    if not isinstance(dtype, str) or dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r}: expected one of {sorted(DTYPES)}.")
    task = infer_task(module, config, peft_config, task)
    check_config_sizes(config, f"model: {type(config).__name__}.")
    if task == "image_classification":
        if seq_len is not None:
            raise ValueError(
                f"seq_len={seq_len!r}: an image model's sequence comes from its config (image_size, patch_size); "
                "pass seq_len=None."
            )
        size, channels = getattr(config, "image_size", 0), getattr(config, "num_channels", 3)
        if isinstance(size, int) and isinstance(channels, int) and batch_size * channels * size**2 > MAX_PIXEL_VALUES:
            raise ValueError(
                f"batch_size={batch_size}: {batch_size} images of {channels} x {size} x {size} are more than "
                f"{MAX_PIXEL_VALUES:,} pixel values per micro-batch; expected at most "
                f"{MAX_PIXEL_VALUES // max(1, channels * size * size)} images."
            )
    else:
        seq_len = check_int("seq_len", seq_len, 1, MAX_SEQ_LEN)
        limit = max_positions(config)
        if limit is not None and seq_len > limit:
            raise ValueError(
                f"seq_len={seq_len}: longer than the {limit} positions the model's config gives "
                f"(max_position_embeddings); expected an int in [1, {limit}]."
            )
        if batch_size * seq_len > MAX_TOKENS:
            raise ValueError(
                f"batch_size={batch_size}, seq_len={seq_len}: {batch_size * seq_len:,} tokens per micro-batch, "
                f"more than the {MAX_TOKENS:,} planned for; expected batch_size * seq_len <= {MAX_TOKENS}."
            )
    return Workload(module, config, batch_size, seq_len, task, optimizer, DTYPES[dtype])


def training_step(
    model, peft_config, batch_size, seq_len, optimizer, dtype, task, gradient_checkpointing, device, seed=None
):
    """The checked ``Workload``, the model to train on ``device`` ("meta": no weights; else random ones drawn after
    ``torch.manual_seed(seed)``) and its batch of inputs (drawn with ``seed``; None: 0)."""
    workload = resolve_workload(model, peft_config, batch_size, seq_len, optimizer, dtype, task)
    if seed is not None:
        torch.manual_seed(seed)
    with values_not_drawn() if device == "meta" else contextlib.nullcontext():
        trained = trainable_model(base_model(workload, device), peft_config, gradient_checkpointing)
    return workload, trained, make_inputs(trained, workload, 0 if seed is None else seed)


# torch.nn.init's functions that draw or fill a tensor's values in place
_INIT_FUNCTIONS = ("uniform_", "normal_", "trunc_normal_", "constant_", "ones_", "zeros_", "eye_", "dirac_")
_INIT_FUNCTIONS += ("xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_")


@contextlib.contextmanager
def values_not_drawn():
    """Inside it, ``torch.nn.init``'s functions leave their tensor as it is: a model without weights needs no values
    (PEFT draws its adapters' on the CPU before moving them to the base layer's device: here, the meta device)."""
    init = torch.nn.init
    originals = {name: getattr(init, name) for name in _INIT_FUNCTIONS}
    for name in _INIT_FUNCTIONS:
        setattr(init, name, _left_as_it_is)
    try:
        yield
    finally:
        for name, function in originals.items():
            setattr(init, name, function)


def _left_as_it_is(tensor, *args, **kwargs):
    return tensor


def max_positions(config) -> int | None:
    """The longest sequence the model's position embeddings cover, where its config says (else None)."""
    for name in ("max_position_embeddings", "n_positions", "max_sequence_length"):
        value = getattr(config, name, None)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            return value
    return None


def load_config(source) -> transformers.PretrainedConfig:
    """A transformers config from a config object, a dict, a config.json file, a folder or a hub id."""
    if isinstance(source, transformers.PretrainedConfig):
        return source
    if isinstance(source, dict):
        return _config_from_dict(source, "the config dict")
    if isinstance(source, (str, os.PathLike)):
        path = os.fspath(source)
        if os.path.isfile(path):
            try:
                with open(path) as handle:
                    return _config_from_dict(json.load(handle), path)
            except json.JSONDecodeError as error:
                raise ValueError(f"model: {path} is not a JSON config file ({error}).") from None
        try:
            return transformers.AutoConfig.from_pretrained(path)
        except (OSError, ValueError, StrictDataclassError) as error:
            raise ValueError(
                f"model: cannot load a transformers config from {path!r} (a config.json file, a folder holding one, "
                f"or a hub id reachable from here): {error}"
            ) from None
    raise ValueError(
        "model: expected a torch.nn.Module, a transformers config, a dict, or a path / hub id of a config, got "
        f"{type(source).__name__}."
    )


def _config_from_dict(values: dict, where: str) -> transformers.PretrainedConfig:
    if "model_type" not in values:
        raise ValueError(f"model: {where} has no 'model_type', so the architecture is unknown.")
    values = dict(values)
    check_config_sizes(values, f"model: {where}: ")
    try:
        return transformers.AutoConfig.for_model(values.pop("model_type"), **values)
    except (ValueError, StrictDataclassError) as error:  # transformers' own checks name the field
        raise ValueError(f"model: {where}: {error}") from None


def check_config_sizes(config, where: str) -> None:
    """Refuse a model config (a transformers config, or the dict it is made from) that the planner cannot build and
    feed, naming the field ``where`` + name (see ``CONFIG_SIZES``)."""
    values = {
        name: config.get(name) if isinstance(config, dict) else getattr(config, name, None) for name in CONFIG_SIZES
    }
    for name, value in values.items():
        if value is not None and not isinstance(value, (list, tuple)):
            check_int(f"{where}{name}", value, 1)
    heads, groups = values["num_attention_heads"], values["num_key_value_heads"]
    if isinstance(heads, int) and isinstance(groups, int) and heads % groups:
        raise ValueError(
            f"{where}num_key_value_heads={groups}: num_attention_heads={heads} is not a multiple of it; expected a "
            f"divisor of {heads}."
        )


def infer_task(model: nn.Module | None, config, peft_config: PeftConfig | None, task: str | None) -> str:
    """The task given, or the one the model's class, the config's architectures or the PEFT task type says; refused
    where the model given as a module, or the PEFT config's task_type, is for another task."""
    peft_task = getattr(peft_config, "task_type", None)
    peft_task = getattr(peft_task, "value", peft_task)
    names = [type(model).__name__] if model is not None else list(getattr(config, "architectures", None) or [])
    named = [found for name in names for suffix, found in _SUFFIXES.items() if name.endswith(suffix)]
    if task is not None:
        if not isinstance(task, str) or task not in TASKS:
            raise ValueError(f"task={task!r}: expected one of {TASKS}.")
        if model is not None and named and named[0] != task:
            raise ValueError(
                f"task={task!r}: the model given is a {names[0]}, a {named[0]} model; pass task={named[0]!r} (or "
                "None), or the model's config, from which the planner builds the model for the task."
            )
    else:
        task = named[0] if named else _PEFT_TASKS.get(peft_task)
    if task is None:
        raise ValueError(
            f"task: cannot tell what {names or 'this model'} is trained for (no known head class, no PEFT task_type "
            f"CAUSAL_LM/SEQ_CLS); pass task= one of {TASKS}."
        )
    if peft_task is not None and _PEFT_TASKS.get(peft_task) != task:
        wanted = TASK_TYPES.get(task)
        other = f", or task={_PEFT_TASKS[peft_task]!r}" if peft_task in _PEFT_TASKS else ""
        raise ValueError(
            f"peft_config.task_type={peft_task!r}: PEFT would wrap the {task} model for another task; expected "
            f"task_type={wanted!r}{other}."
        )
    return task


def base_model(workload: Workload, device: str) -> nn.Module:
    """The model to train: from the config on ``device`` (random weights; "meta": none at all), or a copy of the
    module given whose parameters and buffers are on ``device`` ("meta": the original's are not copied)."""
    model, config, task, dtype = workload.module, workload.config, workload.task, workload.dtype
    if model is None:
        with torch.device(device):
            built = _AUTO_CLASSES[task].from_config(copy.deepcopy(config))  # the model keeps its config: a copy
        return built.to(dtype)
    if isinstance(model, PeftModel):
        raise ValueError(
            "model: pass the base model and its PEFT config separately (estimate_memory(base, peft_config, ...)), "
            "not a PeftModel: the planner applies the config itself."
        )
    memo = {}  # deepcopy takes these for the tensors (on "meta": none of the original's data is copied)
    for tensor in [*model.parameters(), *model.buffers()] if device == "meta" else []:
        empty = torch.empty_like(tensor, device="meta")
        memo[id(tensor)] = (
            nn.Parameter(empty, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else empty
        )
    built = copy.deepcopy(model, memo)
    copy_loading_marks(model, built)  # which weights the checkpoint lacked: SlimFit trains them at every step
    return built.to(dtype)


def trainable_model(base: nn.Module, peft_config: PeftConfig | None, gradient_checkpointing: bool) -> nn.Module:
    """``base`` with the PEFT config applied (None: full fine-tuning), in train mode."""
    if check_bool("gradient_checkpointing", gradient_checkpointing):
        if not getattr(base, "supports_gradient_checkpointing", False):
            raise ValueError(f"gradient_checkpointing: {type(base).__name__} does not support it.")
        base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
        if getattr(base.config, "use_cache", False):  # what transformers does at the first forward, saying so
            base.config.use_cache = False
    # PEFT reads transformers' deprecated `is_gradient_checkpointing` (a FutureWarning per model wrapped: per setting
    # of a plan); nothing the caller can change. A method without `lora`: its transform on `base`.
    with warning_silenced(FutureWarning, "`is_gradient_checkpointing` is deprecated"):
        model, _ = trainable(base, copy.deepcopy(peft_config))
    after_step(model)  # SlimFit sized at its worst step: the largest units train
    return model.train()


def make_inputs(model: nn.Module, workload: Workload, seed: int = 0) -> dict:
    """One batch of real, synthetic inputs with labels."""
    config = model.config
    generator = torch.Generator().manual_seed(seed)
    batch = workload.batch_size
    if workload.task == "image_classification":
        size, channels = config.image_size, getattr(config, "num_channels", 3)
        dtype = next(model.parameters()).dtype
        pixels = torch.randn(batch, channels, size, size, generator=generator).to(dtype)
        return {"pixel_values": pixels, "labels": torch.randint(config.num_labels, (batch,), generator=generator)}
    ids = torch.randint(config.vocab_size, (batch, workload.seq_len), generator=generator)
    pad = getattr(config, "pad_token_id", None)
    if pad is not None:  # every token real: none is the padding id
        ids = torch.where(ids == pad, (pad + 1) % config.vocab_size, ids)
    if workload.task == "causal_lm":
        return {"input_ids": ids, "labels": ids.clone()}
    return {"input_ids": ids, "labels": torch.randint(config.num_labels, (batch,), generator=generator)}


def make_optimizer(model: nn.Module, name: str) -> torch.optim.Optimizer:
    """The optimizer over every parameter that can train (SlimFit's frozen units get no gradient and no state)."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4) if name == "adamw" else torch.optim.SGD(params, lr=1e-4)
    schedule = find_slimfit(model)  # the tuner, or the transform's handle
    if schedule is not None:
        schedule.slimfit_attach(optimizer)  # its steps are scored, as in training
    return optimizer


def after_step(model: nn.Module) -> None:
    """Keep SlimFit on its worst step (the largest units train) for the next step too."""
    schedule = find_slimfit(model)
    if schedule is not None:
        schedule.train_largest_units()


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages of ``tensors``."""
    seen = {storage_key(t): t.untyped_storage().nbytes() for t in tensors if t is not None}
    return sum(seen.values())


def weight_bytes(model: nn.Module) -> int:
    """Bytes of ``model``'s parameters and buffers (shared ones once)."""
    return storage_bytes([*model.parameters(), *model.buffers()])


def gradient_bytes(model: nn.Module) -> int:
    return storage_bytes(p.grad for p in model.parameters())


def optimizer_state_bytes(optimizer: torch.optim.Optimizer) -> int:
    return storage_bytes(v for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v))
