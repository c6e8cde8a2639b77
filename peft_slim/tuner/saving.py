"""What PEFT's own saving and loading cannot do: an atomic :func:`save_pretrained` (with peft_slim's card section,
the plain LoRA adapter alone, or under ``torch.distributed``), and :func:`from_pretrained` / :func:`load_adapter`
with the method's config (``load_config``), each reading one save of a folder (:func:`consistent_read`).

PEFT's ``save_pretrained`` (so ``push_to_hub`` and Trainer checkpoints) already writes a plain LoRA adapter plus
``peft_slim_config.json`` (``MethodConfig.save_pretrained``), which vanilla PEFT loads as LoRA.
"""

from __future__ import annotations

import functools
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable
from typing import Any

import torch.distributed as dist
from peft import PeftModel
from torch import nn

from ..atomic_folder import FolderReplaced, held_files, recover, replaced_folder, sibling
from ..process_rank import rank
from .card import CARD_NAME, add_card_section
from .config import METHOD_CONFIG_NAME, load_config
from .model import MethodTuner, unchanged_if_raises

WEIGHTS_NAME = "adapter_model.safetensors"
CONFIG_FILES = ("adapter_config.json", METHOD_CONFIG_NAME)
ADAPTER_FILES = (*CONFIG_FILES, WEIGHTS_NAME, "adapter_model.bin")
MODEL_FILES = re.compile(
    r"(model|pytorch_model)(-\d+-of-\d+)?\.(safetensors|bin)(\.index\.json)?|(generation_)?config\.json"
)
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


def is_peft_slim_model(peft_model: Any) -> bool:
    return isinstance(getattr(peft_model, "base_model", None), MethodTuner)


# ---------------------------------------------------------------------------------------------- explicit functions


def save_pretrained(
    model: Any,
    save_directory: str,
    tokenizer: Any = None,
    replace_model_files: bool = False,
    plain_lora: bool = False,
    distributed: bool = False,
    **kwargs,
) -> None:
    """``model.save_pretrained(save_directory, **kwargs)`` (a PeftModel of any type, or a transformers model) made
    atomic: written into a new folder beside ``save_directory`` holding everything else of it too, then swapped in
    whole, so a kill at any point leaves the old files or the new ones; peft_slim's card section for its adapters.

    ``tokenizer`` (or any processor): saved in the same swap, replacing the tokenizer files there.
    ``replace_model_files=True``: every :func:`model_file` of the folder goes too, of any kind of model.
    ``plain_lora=True`` (a peft_slim adapter): the plain LoRA adapter alone, without ``peft_slim_config.json`` or the
    card section. ``distributed=True``: call it on every rank with the wrapped or sharded model (DDP, FSDP2, FSDP1);
    every rank joins the gathering of full tensors, which rank 0 writes.
    """
    inner = unwrap(model) if distributed else model
    if not callable(getattr(inner, "save_pretrained", None)):
        wrapped = isinstance(getattr(inner, "module", None), nn.Module)
        raise ValueError(
            f"peft_slim.save_pretrained expects a PeftModel or a transformers model, got {type(model).__name__}"
            + (": for a model wrapped by DDP or FSDP pass distributed=True, on every rank." if wrapped else ".")
        )
    if plain_lora and not is_peft_slim_model(inner):
        raise ValueError(
            f"peft_slim.save_pretrained: plain_lora=True leaves {METHOD_CONFIG_NAME} out of a peft_slim adapter, and "
            f"a {type(inner).__name__} has none; save it without plain_lora."
        )
    if distributed:
        state_dict = full_state_dict(model)
        if rank() == 0:
            save_pretrained(
                inner, save_directory, tokenizer, replace_model_files, plain_lora, state_dict=state_dict, **kwargs
            )
        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        return
    if not kwargs.get("is_main_process", True):  # PEFT and transformers write nothing then
        model.save_pretrained(save_directory, **kwargs)
        return
    folders = None  # the adapters' folders, for a PeftModel
    if hasattr(model, "peft_config"):
        selected = kwargs.get("selected_adapters") or list(model.peft_config)
        folders = {"" if name == "default" else name for name in selected}

    with tempfile.TemporaryDirectory(prefix="peft_slim-tokenizer-") as tokenizer_files:
        tokenizer_names: set[str] = set()
        if tokenizer is not None:  # written first, apart, so that the swap knows which old files it replaces
            tokenizer.save_pretrained(tokenizer_files)
            tokenizer_names = _tokenizer_file_names(tokenizer, tokenizer_files)

        def rewritten(relative: str) -> bool:  # written anew by this save: not kept from the old folder
            folder, file = os.path.split(relative)
            if folders is None:  # a transformers model's weights (all shards) and configs
                by_model = folder == "" and bool(MODEL_FILES.fullmatch(relative))
            else:  # PEFT's files of these adapters
                by_model = folder in folders and file in ADAPTER_FILES
            return by_model or (replace_model_files and model_file(relative)) or relative in tokenizer_names

        with replaced_folder(save_directory, rewritten) as staging:
            model.save_pretrained(staging, **kwargs)
            if tokenizer is not None:
                shutil.copytree(tokenizer_files, staging, dirs_exist_ok=True)
            if plain_lora:
                for folder in folders:
                    os.remove(os.path.join(staging, folder, METHOD_CONFIG_NAME))
            elif is_peft_slim_model(model):
                add_card_section(os.path.join(staging, CARD_NAME), model)


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / FSDP1 wrappers (FSDP2 ``fully_shard`` keeps the model itself)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def full_state_dict(model: nn.Module) -> dict:
    """The full, unsharded state dict on rank 0 (on CPU), ``{}`` on other ranks. Call it on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return unwrap(model).state_dict()
    # torch.distributed.checkpoint is slow to import, and needed only under a process group
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def model_file(relative: str) -> bool:
    """Whether ``relative`` (a path inside a save folder) is an adapter's or a transformers model's file at the top
    level (``ADAPTER_FILES``, ``MODEL_FILES``: weights, shards and index, configs)."""
    return os.path.dirname(relative) == "" and (relative in ADAPTER_FILES or bool(MODEL_FILES.fullmatch(relative)))


def _tokenizer_file_names(tokenizer: Any, written: str) -> set[str]:
    """The files a tokenizer save replaces: what this tokenizer wrote, and the names any tokenizer writes (so that
    a file of an earlier, different tokenizer does not outlive it beside the new one)."""
    names = {os.path.relpath(os.path.join(top, name), written) for top, _, files in os.walk(written) for name in files}
    names |= set(_TOKENIZER_FILES) | {str(name) for name in getattr(tokenizer, "vocab_files_names", {}).values()}
    return names


# ---------------------------------------------------------------------------------------------- consistent reads


# How many times a load that a save swapped the folder under is undone and read again before FolderReplaced.
LOAD_ATTEMPTS = 5


def consistent_read(undo: Callable[..., None]) -> Callable:
    """Decorate ``load(model, model_id, ...)`` to read one save of a local folder (recovered first), its files held
    open as one version; if a save replaces it meanwhile, ``undo(model, result, *args, **kwargs)`` takes the load off
    and it is read again, up to ``LOAD_ATTEMPTS`` times."""

    def decorate(load: Callable) -> Callable:
        @functools.wraps(load)
        def load_one_save(model: Any, model_id: str, *args, **kwargs) -> Any:
            model_id = os.fspath(model_id)  # `load` is given a str
            folder = os.path.join(model_id, kwargs["subfolder"]) if kwargs.get("subfolder") else model_id
            for saved in dict.fromkeys((model_id, folder)):  # the subfolder too: a save may have written it alone
                real = os.path.realpath(saved)  # where a save through a link to the folder puts its siblings
                if not os.path.exists(real) and os.path.isdir(sibling(real, "new")):
                    recover(real)  # a save was killed between its two renames: the new folder is complete
            if not os.path.isdir(folder):  # a Hub repository: one revision is one commit
                return load(model, model_id, *args, **kwargs)
            for _ in range(LOAD_ATTEMPTS):
                result = loading = None
                try:
                    with held_files(folder, ADAPTER_FILES):
                        loading = True
                        result = load(model, model_id, *args, **kwargs)
                    return result
                except FolderReplaced as error:
                    if not loading:
                        raise
                    replaced = error
                    if result is None:  # the load itself raised: nothing of it to take off
                        continue
                    try:
                        undo(model, result, *args, **kwargs)
                    except Exception as failed:
                        raise FolderReplaced(
                            f"peft_slim.{load.__name__}: {error} The model may hold parts of both saves: load again, "
                            "onto a fresh base model (from_pretrained) or after delete_adapter (load_adapter)."
                        ) from failed
            raise FolderReplaced(
                f"peft_slim.{load.__name__}: {replaced} It was read {LOAD_ATTEMPTS} times, each replaced by a save "
                "during the read, and the model is as given: load again once the saves stop."
            ) from replaced

        return load_one_save

    return decorate


def _take_off_loaded(model: nn.Module, loaded: Any, *args, **kwargs) -> None:
    """Undo ``from_pretrained``: the tuner it put on ``model`` taken off, the model as given."""
    tuner = getattr(loaded, "base_model", None)
    if not isinstance(tuner, MethodTuner):
        raise TypeError(f"cannot take a {type(tuner).__name__} off the model")
    tuner._take_off()


def _delete_loaded(model: Any, loaded: Any, adapter_name: str | None = None, *args, **kwargs) -> None:
    """Undo ``load_adapter``: the adapter it added deleted."""
    model.delete_adapter(adapter_name if adapter_name is not None else kwargs["adapter_name"])


@consistent_read(_take_off_loaded)
def from_pretrained(
    model: nn.Module,
    model_id: str,
    adapter_name: str = "default",
    is_trainable: bool = False,
    **kwargs,
) -> Any:
    """``PeftModel.from_pretrained`` (which alone loads the plain LoRA adapter) with the adapter's peft_slim method and
    settings, e.g. to continue training. A load that raises leaves ``model`` as given; ``is_trainable=False`` sets up
    no method: training it is refused."""
    hub_kwargs = {key: kwargs[key] for key in ("subfolder", "revision", "cache_dir", "token") if key in kwargs}
    config = load_config(model_id, **hub_kwargs)
    # The tuner's load hook reports missing keys (also for load_adapter, where PEFT only returns them): PEFT's own
    # report of the same keys after from_pretrained is left out.
    with unchanged_if_raises(model), warnings.catch_warnings():  # a refused load leaves the model as it was given
        warnings.filterwarnings("ignore", "Found missing adapter keys", UserWarning, r"peft\.peft_model")
        return PeftModel.from_pretrained(
            model, model_id, adapter_name=adapter_name, is_trainable=is_trainable, config=config, **kwargs
        )


@consistent_read(_delete_loaded)
def load_adapter(model: Any, model_id: str, adapter_name: str, is_trainable: bool = False, **kwargs) -> Any:
    """``model.load_adapter`` (a PeftModel of the same method) with the saved method and settings: PEFT's own reads
    ``adapter_config.json``, LoRA's, and refuses a LoRA adapter beside a peft_slim one. Returns PEFT's load result."""
    if not is_peft_slim_model(model):
        raise ValueError(
            f"peft_slim.load_adapter expects a PeftModel of a peft_slim method, got {type(model).__name__}"
            f"{' of ' + type(model.base_model).__name__ if hasattr(model, 'base_model') else ''}; for a plain LoRA "
            "model use model.load_adapter."
        )
    if adapter_name in model.peft_config:
        raise ValueError(f"peft_slim.load_adapter: the model already has an adapter named {adapter_name!r}.")
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
