"""Saving and loading peft_slim adapters through PEFT's own methods, plus two explicit functions.

PEFT's ``PeftModel.save_pretrained`` (and so ``push_to_hub`` and Trainer checkpoints) writes a LoRA-stacked
adapter as a plain LoRA adapter: the config's own ``save_pretrained`` (``MethodConfig``) writes LoRA's
``adapter_config.json`` and, beside it, the method and its settings in ``peft_slim_config.json``. Vanilla PEFT loads
such a folder as LoRA, without peft_slim; :func:`from_pretrained` loads it with the method, to continue training.
A standalone adapter (base tensors, no LoRA) keeps peft_slim's own type in ``adapter_config.json``.

Nothing of PEFT is replaced: what PEFT's methods cannot do for us is done by the tuner's hooks (the base-model
check at injection, missing and unexpected keys at load) or here:

* :func:`save_pretrained`: PEFT's save into a new sibling folder that replaces the old one whole
  (``peft_slim.atomic_folder``), with peft_slim's section in the model card; ``peft-slim train`` uses it. The weights
  record their config files' digest, which the loads below check (:func:`consistent_read`).
* :func:`from_pretrained`: ``PeftModel.from_pretrained`` with the config from ``peft_slim_config.json`` (or, for
  adapters written by peft_slim 0.1.0, from ``adapter_config.json``); :func:`load_adapter`: the same for a further
  adapter on a model (``PeftModel.load_adapter`` reads the LoRA config and cannot be given another).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import re
import shutil
import tempfile
from collections.abc import Callable, Iterable
from typing import IO, Any

import torch
from torch import nn

from ..atomic_folder import FolderReplaced, held_files, recover, replaced_folder, sibling

CARD_NAME = "README.md"
RECORD_NAME = "peft_slim_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_FILES = ("adapter_config.json", RECORD_NAME)
WEIGHT_FILES = (WEIGHTS_NAME, "adapter_model.bin")
ADAPTER_FILES = (*CONFIG_FILES, *WEIGHT_FILES)
# In an adapter's safetensors metadata: the digests of its config files (see stamp_weights).
STAMP_KEY = "peft_slim.config_blake2b"
MODEL_FILES = re.compile(
    r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?|(generation_)?config\.json"
)
CARD_START = "<!-- peft_slim: loading (written by peft_slim.save_pretrained; kept up to date on every save) -->"
CARD_END = "<!-- /peft_slim -->"
MISMATCH_FLAG = "ignore_base_mismatch"
_TOKENIZER_FILES = (  # what transformers' tokenizers and processors write, common vocabulary files included
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "chat_template.jinja",
    "chat_template.json",
    "processor_config.json",
    "preprocessor_config.json",
    "vocab.txt",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "spiece.model",
)
# The key under which a standalone adapter's file holds the record of its base model (a uint8 tensor of JSON).
RECORD_KEY = "peft_slim.base_weights"


def is_peft_slim_model(peft_model: Any) -> bool:
    from .model import MethodTuner

    return isinstance(getattr(peft_model, "base_model", None), MethodTuner)


# ---------------------------------------------------------------------------------------------- explicit functions


def save_pretrained(
    model: Any, save_directory: str, tokenizer: Any = None, replace_model_files: bool = False, **kwargs
) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` made atomic, with peft_slim's card section for a
    peft_slim adapter. ``model``: a PeftModel (any PEFT type) or a transformers model. ``tokenizer`` (or any
    processor with ``save_pretrained``): saved into the folder in the same swap, replacing the tokenizer files there.
    ``replace_model_files=True``: every :func:`model_file` of the folder goes too, also those of another kind of
    model (a full model saved over a LoRA adapter, or the reverse).

    The files are written into a new folder beside ``save_directory`` that holds everything else of the folder too
    (files as hard links, sub-folders, symbolic links), then swapped in whole: a process killed at any point leaves
    the old files or the new ones (adapter and tokenizer together); leftovers of a killed save are cleaned up by the
    next one. Each adapter's ``adapter_model.safetensors`` records the digest of its config files
    (:func:`stamp_weights`), which :func:`from_pretrained` and :func:`load_adapter` check.
    """
    if not callable(getattr(model, "save_pretrained", None)):
        raise ValueError(
            f"peft_slim.save_pretrained expects a PeftModel or a transformers model, got {type(model).__name__}."
        )
    if not kwargs.get("is_main_process", True):  # PEFT and transformers write nothing then
        model.save_pretrained(save_directory, **kwargs)
        return
    folders: set[str] = set()
    if hasattr(model, "peft_config"):
        selected = kwargs.get("selected_adapters") or list(model.peft_config)
        folders = {"" if name == "default" else name for name in selected}

        def written_by_model(relative: str) -> bool:  # the files PEFT writes for these adapters
            folder, file = os.path.split(relative)
            return folder in folders and file in ADAPTER_FILES

    else:

        def written_by_model(relative: str) -> bool:  # a transformers model's weights (all shards) and configs
            return os.path.dirname(relative) == "" and bool(MODEL_FILES.fullmatch(relative))

    with tempfile.TemporaryDirectory(prefix="peft_slim-tokenizer-") as tokenizer_files:
        tokenizer_names: set[str] = set()
        if tokenizer is not None:  # written first, apart, so that the swap knows which old files it replaces
            tokenizer.save_pretrained(tokenizer_files)
            tokenizer_names = _tokenizer_file_names(tokenizer, tokenizer_files)

        def rewritten(relative: str) -> bool:  # written anew by this save: not kept from the old folder
            replaced = replace_model_files and model_file(relative)
            return replaced or written_by_model(relative) or relative in tokenizer_names

        with replaced_folder(save_directory, rewritten) as staging:
            model.save_pretrained(staging, **kwargs)
            for folder in folders:
                stamp_weights(os.path.join(staging, folder))
            if tokenizer is not None:
                shutil.copytree(tokenizer_files, staging, dirs_exist_ok=True)
            if is_peft_slim_model(model):
                add_card_section(os.path.join(staging, CARD_NAME), model)


def model_file(relative: str) -> bool:
    """Whether ``relative`` (a path inside a save folder) is a model file at the folder's top level: an adapter's
    (``adapter_config.json``, its weights, ``peft_slim_config.json``) or a transformers model's (the weights, every
    shard and the shards' index, ``config.json``, ``generation_config.json``). ``save_pretrained(...,
    replace_model_files=True)`` removes them all, whatever kind of model it saves."""
    return os.path.dirname(relative) == "" and (relative in ADAPTER_FILES or bool(MODEL_FILES.fullmatch(relative)))


def _tokenizer_file_names(tokenizer: Any, written: str) -> set[str]:
    """The files a tokenizer save replaces: what this tokenizer wrote, and the names any tokenizer writes (so that
    a file of an earlier, different tokenizer does not outlive it beside the new one)."""
    names = {os.path.relpath(os.path.join(top, name), written) for top, _, files in os.walk(written) for name in files}
    names |= set(_TOKENIZER_FILES) | {str(name) for name in getattr(tokenizer, "vocab_files_names", {}).values()}
    return names


# ---------------------------------------------------------------------------------------------- consistent reads


def stamp_weights(folder: str) -> None:
    """Record in ``folder``'s ``adapter_model.safetensors`` (its metadata, :data:`STAMP_KEY`) the digest of each config
    file beside it, so that a reader can tell that the config it read is the one saved with these weights. PEFT and
    other readers ignore the entry. Nothing to do for an adapter without safetensors weights."""
    weights = os.path.join(folder, WEIGHTS_NAME)
    if not os.path.isfile(weights):
        return
    digests = {}
    for name in CONFIG_FILES:
        with contextlib.suppress(FileNotFoundError), open(os.path.join(folder, name), "rb") as handle:
            digests[name] = _config_digest(handle.read())
    with open(weights, "rb") as source:
        header = _safetensors_header(source)
        if not header:
            return
        header["__metadata__"] = {**header.get("__metadata__", {}), STAMP_KEY: json.dumps(digests, sort_keys=True)}
        encoded = json.dumps(header, separators=(",", ":")).encode()
        encoded += b" " * (-len(encoded) % 8)  # safetensors' padding: tensor data stays 8-byte aligned
        with open(weights + ".stamped", "wb") as target:
            target.write(len(encoded).to_bytes(8, "little") + encoded)
            shutil.copyfileobj(source, target)  # the tensor data, unchanged (offsets count from its start)
    os.replace(weights + ".stamped", weights)


def check_stamp(where: str, files: dict[str, IO[bytes]]) -> None:
    """Raise if the open config ``files`` of an adapter are not the ones :func:`stamp_weights` recorded in its open
    weights file (an adapter without the record passes)."""
    if WEIGHTS_NAME not in files:
        return
    stamp = _safetensors_header(files[WEIGHTS_NAME]).get("__metadata__", {}).get(STAMP_KEY)
    if stamp is None:
        return
    for name, digest in json.loads(stamp).items():
        handle = files.get(name)
        if handle is None or _config_digest(handle.seek(0) or handle.read()) != digest:
            raise ValueError(
                f"{where}: {name} is not the config saved with {WEIGHTS_NAME} (its digest differs from the one the "
                "weights record): the folder mixes two saves (copied during a save?) or the file was edited. Save "
                "the adapter again, or load the files as they are with peft.PeftModel.from_pretrained."
            )


def consistent_read(load: Callable) -> Callable:
    """Decorate ``load(model, model_id, ...)`` so that it reads one save of a local folder ``model_id``: the adapter's
    files are held open as one version of the folder (``atomic_folder.held_files``) and their stamp checked before
    ``load`` runs; if a save replaces the folder meanwhile, ``atomic_folder.FolderReplaced`` is raised after it."""

    @functools.wraps(load)
    def load_one_save(model: Any, model_id: str, *args, **kwargs) -> Any:
        folder = os.fspath(model_id)
        folder = os.path.join(folder, kwargs["subfolder"]) if kwargs.get("subfolder") else folder
        if not os.path.isdir(folder):  # a Hub repository: one revision is one commit
            return load(model, model_id, *args, **kwargs)
        loading = False
        try:
            with held_files(folder, (*CONFIG_FILES, *WEIGHT_FILES)) as files:
                check_stamp(folder, files)
                loading = True
                return load(model, model_id, *args, **kwargs)
        except FolderReplaced as error:
            if not loading:
                raise
            raise FolderReplaced(
                f"peft_slim.{load.__name__}: {error} The model may hold parts of both saves: load again, onto a fresh "
                "base model (from_pretrained) or after delete_adapter (load_adapter)."
            ) from error

    return load_one_save


def _config_digest(data: bytes) -> str:
    """blake2b of a config file's values, where the base model is left out (users edit that path by hand)."""
    try:
        values = json.loads(data)
    except (UnicodeDecodeError, json.JSONDecodeError):
        values = data.decode("latin-1")
    if isinstance(values, dict):
        values = {key: value for key, value in values.items() if key not in ("base_model_name_or_path", "revision")}
    return hashlib.blake2b(json.dumps(values, sort_keys=True).encode(), digest_size=16).hexdigest()


def _safetensors_header(handle: IO[bytes]) -> dict:
    """The JSON header of the safetensors file open in ``handle`` ({} if it is not one)."""
    handle.seek(0)
    length = int.from_bytes(handle.read(8), "little")
    try:
        header = json.loads(handle.read(length)) if length <= 100_000_000 else None
    except (UnicodeDecodeError, json.JSONDecodeError):
        header = None
    return header if isinstance(header, dict) else {}


def load_config(model_id: str, subfolder: str | None = None, **hub_kwargs) -> Any:
    """The peft_slim config of the adapter at ``model_id``: from ``peft_slim_config.json`` (LoRA-stacked adapters),
    else from ``adapter_config.json`` (standalone adapters, and every adapter peft_slim 0.1.0 wrote).

    A LoRA-stacked adapter's LoRA is written twice, in ``adapter_config.json`` (what vanilla PEFT loads) and in
    ``peft_slim_config.json``: where the two differ (one was edited), the adapter is refused, naming the fields.
    """
    from peft import PeftConfig
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    from .config import MethodConfig

    record = _adapter_file(model_id, RECORD_NAME, subfolder, **hub_kwargs)
    if record is None:
        config = PeftConfig.from_pretrained(model_id, subfolder=subfolder, **hub_kwargs)
        if not isinstance(config, MethodConfig):
            raise ValueError(
                f"{model_id!r} holds a {getattr(config.peft_type, 'value', config.peft_type)} adapter without "
                f"peft_slim's {RECORD_NAME}: it was not saved from a peft_slim method. Load it with "
                "peft.PeftModel.from_pretrained."
            )
        config._loaded_from = str(model_id)
        return config
    with open(record) as handle:
        text = handle.read()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{record} is not valid JSON ({error}; {len(text)} characters): the file is cut short or was edited by "
            "hand. Save the adapter again (peft_slim.save_pretrained replaces the folder whole), or restore the file."
        ) from None
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(values.get("peft_type")) if isinstance(values, dict) else None
    if config_cls is None or not issubclass(config_cls, MethodConfig):
        found = values.get("peft_type") if isinstance(values, dict) else values
        raise ValueError(
            f"{record}: peft_type {found!r} is not a peft_slim method (expected one of "
            f"{sorted(str(t) for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items() if issubclass(c, MethodConfig))})."
        )
    try:
        config = config_cls(**values)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{record}: {error}") from None
    if config.lora is not None:
        _check_same_lora(config, record, model_id, subfolder, hub_kwargs)
    config._loaded_from = str(model_id)
    return config


# Fields of adapter_config.json that name things rather than define the adapter: PEFT sets `inference_mode` at load,
# `peft_version` says who wrote the file; the base model's name, revision and class (`auto_mapping`, for AutoPeftModel)
# are used only where no base model is given.
_NAMING_FIELDS = ("inference_mode", "peft_version", "base_model_name_or_path", "revision", "auto_mapping")


def _check_same_lora(config: Any, record: str, model_id: str, subfolder: str | None, hub_kwargs: dict) -> None:
    """Refuse a LoRA-stacked adapter whose ``adapter_config.json`` (vanilla PEFT's) and ``peft_slim_config.json``
    (``record``, read into ``config``) describe different LoRA adapters: one folder, one model."""
    from peft import LoraConfig, PeftConfig
    from peft.utils import CONFIG_NAME

    from ..configuration import to_json_value

    if _adapter_file(model_id, CONFIG_NAME, subfolder, **hub_kwargs) is None:
        return  # nothing else to load it from
    adapter = PeftConfig.from_pretrained(model_id, subfolder=subfolder, **hub_kwargs)
    ours = to_json_value(config.lora_export_config())
    if isinstance(adapter, LoraConfig):
        theirs = to_json_value(adapter)
        keys = sorted((ours.keys() | theirs.keys()) - set(_NAMING_FIELDS))
    else:
        theirs, keys = {"peft_type": to_json_value(adapter.peft_type)}, ["peft_type"]
    differ = [key for key in keys if ours.get(key) != theirs.get(key)]
    if differ:
        listed = "; ".join(
            f"{key} is {theirs.get(key)!r} in {CONFIG_NAME} and {ours.get(key)!r} in {RECORD_NAME}" for key in differ
        )
        raise ValueError(
            f"{os.path.dirname(record)}: {CONFIG_NAME} and {RECORD_NAME} describe different LoRA adapters: {listed}. "
            "Vanilla PEFT loads the first and peft_slim the second: two different models from one folder, so one of "
            "the files was edited after saving. Make them agree (edit either file), or save the adapter again."
        )


@consistent_read
def from_pretrained(
    model: nn.Module,
    model_id: str,
    adapter_name: str = "default",
    is_trainable: bool = False,
    ignore_base_mismatch: bool = False,
    **kwargs,
) -> Any:
    """``PeftModel.from_pretrained`` with the adapter's peft_slim method and settings, e.g. to continue training.

    ``PeftModel.from_pretrained`` alone loads a LoRA-stacked adapter as the plain LoRA adapter it is (same outputs,
    no token selection, freezing or compression). ``ignore_base_mismatch=True`` loads a standalone adapter onto a
    base model other than the one it was trained on. ``kwargs`` go to ``PeftModel.from_pretrained``. A load that
    raises leaves ``model`` as it was given. ``is_trainable=False`` sets up no method: training it is refused.
    """
    from peft import PeftModel

    from .model import unchanged_if_raises

    model_id = os.fspath(model_id)
    if not os.path.exists(model_id) and os.path.isdir(sibling(model_id, "new")):
        recover(model_id)  # a save was killed between its two renames: the new folder is complete
    hub_kwargs = {key: kwargs[key] for key in ("subfolder", "revision", "cache_dir", "token") if key in kwargs}
    config = load_config(model_id, **hub_kwargs)
    config._ignore_base_mismatch = ignore_base_mismatch  # read by the tuner at injection
    with unchanged_if_raises(model):  # a refused load leaves the model as it was given
        return PeftModel.from_pretrained(
            model, model_id, adapter_name=adapter_name, is_trainable=is_trainable, config=config, **kwargs
        )


@consistent_read
def load_adapter(model: Any, model_id: str, adapter_name: str, is_trainable: bool = False, **kwargs) -> Any:
    """``model.load_adapter`` for a saved peft_slim adapter: a further adapter named ``adapter_name`` on ``model`` (a
    PeftModel of the same peft_slim method), with the saved method and settings. Returns PEFT's load result.

    ``model.load_adapter`` alone reads ``adapter_config.json``, which for a LoRA-stacked adapter is LoRA's, and PEFT
    then refuses to put a LoRA adapter beside a TokenTune or SlimFit one. ``kwargs`` go to ``model.load_adapter``.
    """
    if not is_peft_slim_model(model):
        raise ValueError(
            f"peft_slim.load_adapter expects a PeftModel of a peft_slim method, got {type(model).__name__}"
            f"{' of ' + type(model.base_model).__name__ if hasattr(model, 'base_model') else ''}; for a plain LoRA "
            "model use model.load_adapter."
        )
    if adapter_name in model.peft_config:
        raise ValueError(f"peft_slim.load_adapter: the model already has an adapter named {adapter_name!r}.")
    model_id = os.fspath(model_id)
    hub_kwargs = {key: kwargs[key] for key in ("subfolder", "revision", "cache_dir", "token") if key in kwargs}
    config = load_config(model_id, **hub_kwargs)
    config.inference_mode = not is_trainable
    model.add_adapter(adapter_name, config, low_cpu_mem_usage=kwargs.get("low_cpu_mem_usage", False))
    try:
        if is_trainable:
            model.set_requires_grad(adapter_name)
        return model.load_adapter(model_id, adapter_name, is_trainable=is_trainable, **kwargs)
    except BaseException:
        model.delete_adapter(adapter_name)
        raise


def _adapter_file(model_id: str, name: str, subfolder: str | None = None, **hub_kwargs) -> str | None:
    """Local path of file ``name`` of the adapter at ``model_id`` (a folder or a Hub repository); None if absent."""
    folder = os.path.join(model_id, subfolder) if subfolder else model_id
    if os.path.isdir(folder):
        path = os.path.join(folder, name)
        return path if os.path.isfile(path) else None
    from huggingface_hub import hf_hub_download
    from huggingface_hub.errors import EntryNotFoundError

    try:
        return hf_hub_download(model_id, name, subfolder=subfolder, **hub_kwargs)
    except EntryNotFoundError:
        return None


# ---------------------------------------------------------------------------------------------- model card


def card_section(peft_model: Any, adapter_ref: str | None = None) -> str:
    """The card's "how to load" section: with plain PEFT (LoRA) or with peft_slim (standalone), and how to
    continue training with the method."""
    tuner = peft_model.base_model
    config = tuner._config
    base_cls = type(peft_model.get_base_model())
    base_ref = config.base_model_name_or_path or "<the base model it was trained from>"
    adapter_ref = adapter_ref or "<the folder or Hub id of this adapter>"
    base_lines = [
        f"from {_public_module(base_cls)} import {base_cls.__name__}",
        "",
        f'base = {base_cls.__name__}.from_pretrained("{base_ref}")',
    ]
    if config.lora is not None:
        lines = [
            f"This is a plain PEFT **LoRA** adapter, trained with peft_slim's **{tuner.method_name}** (its settings "
            f"are in `{RECORD_NAME}`). It loads without peft_slim:",
            "",
            "```python",
            "from peft import PeftModel",
            *base_lines,
            f'model = PeftModel.from_pretrained(base, "{adapter_ref}")',
            "```",
            "",
            f"To continue training with {tuner.method_name} and the same settings: "
            f'`peft_slim.from_pretrained(base, "{adapter_ref}", is_trainable=True)`.',
        ]
    else:
        peft_type = str(getattr(config.peft_type, "value", config.peft_type))
        lines = [
            f"This is a standalone **{tuner.method_name}** adapter (PEFT type `{peft_type}`) made with peft_slim: it "
            "holds only the base tensors training changed. PEFT knows this type once `peft_slim` is imported; load "
            "it onto the exact base model it was trained from (peft_slim checks this and refuses another one):",
            "",
            "```python",
            "import peft_slim  # registers TokenTune and SlimFit with PEFT",
            "from peft import PeftModel",
            *base_lines,
            f'model = PeftModel.from_pretrained(base, "{adapter_ref}")',
            "```",
            "",
            "`model.merge_and_unload()` gives the tuned model as a plain transformers model.",
        ]
    return "\n".join([CARD_START, "## Loading this adapter (peft_slim)", "", *lines, CARD_END])


def _public_module(cls: type) -> str:
    """``transformers`` for a class it exports (the usual case), else the module that defines ``cls``."""
    import transformers

    return "transformers" if getattr(transformers, cls.__name__, None) is cls else cls.__module__


def add_card_section(path: str, peft_model: Any, adapter_ref: str | None = None, tags: Iterable[str] = ()) -> None:
    """Add peft_slim's tags and loading section to the model card at ``path`` (replacing an older section)."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    tuner = peft_model.base_model
    lora_tag = ["lora"] if tuner._config.lora is not None else []
    card.data.tags = list(
        dict.fromkeys([*(card.data.tags or []), *lora_tag, "peft_slim", tuner.method_name.lower(), *tags])
    )
    section = card_section(peft_model, adapter_ref)
    pattern = re.compile(re.escape(CARD_START) + r".*?" + re.escape(CARD_END), re.DOTALL)
    legacy = re.compile(r"<!-- peft_slim: loading \(written by save_pretrained.*?" + re.escape(CARD_END), re.DOTALL)
    text = card.text
    if pattern.search(text) or legacy.search(text):
        text = (pattern if pattern.search(text) else legacy).sub(lambda _: section, text, count=1)
    else:  # after the title, if the card starts with one
        head, newline, rest = text.lstrip("\n").partition("\n")
        text = f"{head}\n\n{section}\n{rest}" if head.startswith("# ") else f"{section}\n\n{text}"
    card.text = text
    card.save(path)


# ---------------------------------------------------------------------------------------------- base identity


def record_tensor(record: dict) -> torch.Tensor:
    """``record`` (JSON-ready) as a uint8 tensor, to travel in the adapter file with the tensors it describes."""
    return torch.frombuffer(bytearray(json.dumps(record, sort_keys=True).encode()), dtype=torch.uint8).clone()


def record_from_tensor(tensor: torch.Tensor, where: str) -> dict:
    """The record ``record_tensor`` stored, checked as ``MethodConfig.base_weights`` is."""
    from .config import BaseWeightsRecord

    try:
        value = json.loads(bytes(tensor.cpu().numpy().tobytes()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{where}: the adapter file's {RECORD_KEY!r} is not a peft_slim record ({error}).") from None
    return BaseWeightsRecord().coerce(value, f"{where}: {RECORD_KEY}")


def tensor_digest(tensor: torch.Tensor) -> bytes:
    """blake2b (16 bytes) of a tensor's bytes; of its dtype and shape alone for a tensor without data (the meta
    device, e.g. a model built for a memory estimate: it is never saved)."""
    if tensor.device.type == "meta":
        return hashlib.blake2b(f"meta {tensor.dtype} {list(tensor.shape)}".encode(), digest_size=16).digest()
    data = tensor.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
    return hashlib.blake2b(data.numpy(), digest_size=16).digest()


def identity(entries: Iterable[tuple[str, str, tuple, bytes]]) -> dict[str, Any]:
    """One record of many tensors given as ``(name, dtype, shape, digest)``: count, dtypes and a joint blake2b."""
    joint = hashlib.blake2b(digest_size=16)
    count, dtypes = 0, set()
    for name, dtype, shape, digest in sorted(entries):
        joint.update(f"{name}\0{dtype}\0{list(shape)}\0".encode() + digest)
        count += 1
        dtypes.add(dtype)
    return {"count": count, "dtypes": sorted(dtypes), "blake2b": joint.hexdigest()}


def wrapper_module_names(model: nn.Module) -> list[str]:
    """Names of the modules PEFT wraps (``modules_to_save``, trainable tokens) in ``model``."""
    from ..compat import auxiliary_training_wrapper_cls

    wrapper_cls = auxiliary_training_wrapper_cls()
    return [name for name, module in model.named_modules() if isinstance(module, wrapper_cls)]


def _under(name: str, modules: list[str]) -> bool:
    return any(name == module or name.startswith(module + ".") for module in modules)


def base_parameter_names(model: nn.Module) -> list[str]:
    """The base model's parameters that an adapter may rely on: all but those under PEFT's wrappers (whose trained
    copies PEFT saves itself) and LoRA's own."""
    wrapped = wrapper_module_names(model)
    return [name for name, _ in model.named_parameters() if ".lora_" not in name and not _under(name, wrapped)]
