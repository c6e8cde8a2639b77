"""Saving and loading a peft_slim adapter through PEFT's own ``PeftModel`` methods, made safe for it.

PEFT has no per-method hook for what ``PeftModel.save_pretrained``, ``push_to_hub`` and ``load_adapter`` do, so
:func:`install` wraps these three methods once (through ``compat.wrap_peft_model_method``). Each wrapper first asks
whether the model's adapter is peft_slim's (its tuner is a :class:`MethodTuner`); if not, it calls PEFT's method
with the same arguments and nothing else, so vanilla adapters (LoRA included) behave exactly as without peft_slim.

* ``save_pretrained``: PEFT's method writes its files (weights, ``adapter_config.json``, the model card) into a
  fresh hidden folder inside the target folder; the card gets peft_slim's section (:func:`add_card_section`); only
  then does each file replace its namesake in the target folder (``os.replace``, atomic on one file system). An
  exception or a full disk while writing leaves the target folder byte-identical and the hidden folder is removed.
  (Only a crash between the few final renames could leave new weights beside the old config.) Wrapping the whole
  method rather than the ``safe_save_file`` it calls covers every file, the model card too, keeps the bytes
  exactly PEFT's, and leaves PEFT's module globals (which other threads' vanilla saves use) untouched.
* ``push_to_hub``: transformers' version saves, then overwrites the card with the Hub's (or a generic transformers
  card), which would drop peft_slim's name and import line. For peft_slim adapters it is done here with
  huggingface_hub's public API: the Hub's card (if any) is updated by PEFT and by us, then every file is committed.
* ``load_adapter`` (``PeftModel.from_pretrained`` calls it): a standalone adapter whose base model differs from the
  one it was trained on is refused before anything is loaded (``ignore_base_mismatch=True`` loads it anyway), and
  missing keys are listed in the returned ``load_result`` as PEFT lists them for LoRA (``from_pretrained`` then
  warns with PEFT's message); unexpected keys are listed and warned about.
"""

from __future__ import annotations

import contextlib
import hashlib
import inspect
import os
import re
import shutil
import tempfile
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ..compat import unwrapped_peft_model_method, wrap_peft_model_method

CARD_NAME = "README.md"
CARD_START = "<!-- peft_slim: loading (written by save_pretrained; kept up to date on every save) -->"
CARD_END = "<!-- /peft_slim -->"
MISMATCH_FLAG = "ignore_base_mismatch"


def is_peft_slim_model(peft_model: Any) -> bool:
    from .model import MethodTuner

    return isinstance(getattr(peft_model, "base_model", None), MethodTuner)


# ---------------------------------------------------------------------------------------------- atomic folders


def _fsync(path: str) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def staged_directory(directory: str) -> Iterator[str]:
    """A fresh hidden folder inside ``directory`` to write into; on success its files replace their namesakes.

    Files keep their paths relative to the staging folder (an adapter saved in a sub-folder stays in it). On any
    exception nothing in ``directory`` is changed (apart from creating it) and the staging folder is removed.
    The weights are moved first and the card last, so a reader never sees a config newer than its weights.
    """
    if os.path.isfile(directory):
        raise ValueError(f"save_pretrained: {directory!r} is a file; give a directory.")
    os.makedirs(directory, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=".peft_slim-save-", dir=directory)
    try:
        yield staging
        moves = []
        for folder, _, files in os.walk(staging):
            for file in files:
                source = os.path.join(folder, file)
                _fsync(source)  # on disk before the rename makes it visible
                moves.append((source, os.path.join(directory, os.path.relpath(source, staging))))
        moves.sort(key=lambda move: (move[1].endswith(CARD_NAME), move[1].endswith(".json")))
        for source, target in moves:
            os.makedirs(os.path.dirname(target), exist_ok=True)
            os.replace(source, target)
        with contextlib.suppress(OSError):  # not every platform can fsync a directory
            _fsync(directory)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- model card


def card_section(peft_model: Any, adapter_ref: str | None) -> str:
    """The card's "how to load" section: peft_slim, the import, and what fails without it."""
    tuner = peft_model.base_model
    config = tuner._config
    peft_type = str(getattr(config.peft_type, "value", config.peft_type))
    base_cls = type(peft_model.get_base_model())
    base_ref = config.base_model_name_or_path or "<the base model it was trained from>"
    adapter_ref = adapter_ref or "<the folder or Hub id of this adapter>"
    lines = [
        CARD_START,
        "## Loading this adapter (peft_slim)",
        "",
        f"This is a **{tuner.method_name}** adapter (PEFT type `{peft_type}`) made with peft_slim. "
        f"PEFT knows this type only once `peft_slim` is imported (install it with `pip install peft-slim`); "
        f"without the import, `PeftModel.from_pretrained` and `AutoPeftModel*.from_pretrained` fail with "
        f"`KeyError: '{peft_type}'`.",
        "",
        "```python",
        "import peft_slim  # registers TokenTune and SlimFit with PEFT",
        "from peft import PeftModel",
        f"from {_public_module(base_cls)} import {base_cls.__name__}",
        "",
        f'base = {base_cls.__name__}.from_pretrained("{base_ref}")',
        f'model = PeftModel.from_pretrained(base, "{adapter_ref}")',
        "```",
        "",
    ]
    if config.lora is not None:
        lines.append(
            "`peft_slim.export_lora(model, folder)` writes the same LoRA adapter as a plain PEFT LoRA adapter, "
            "which loads without peft_slim."
        )
    else:
        lines.append(
            "The adapter holds only the base tensors training changed: load it onto the exact base model it was "
            "trained from (peft_slim checks this and refuses another one)."
        )
    lines.append(CARD_END)
    return "\n".join(lines)


def _public_module(cls: type) -> str:
    """``transformers`` for a class it exports (the usual case), else the module that defines ``cls``."""
    import transformers

    return "transformers" if getattr(transformers, cls.__name__, None) is cls else cls.__module__


def add_card_section(path: str, peft_model: Any, adapter_ref: str | None = None, tags: Iterable[str] = ()) -> None:
    """Add peft_slim's tags and loading section to the model card at ``path`` (replacing an older section)."""
    from huggingface_hub import ModelCard

    card = ModelCard.load(path)
    method_tag = peft_model.base_model.method_name.lower()
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), "peft_slim", method_tag, *tags]))
    section = card_section(peft_model, adapter_ref)
    pattern = re.compile(re.escape(CARD_START) + r".*?" + re.escape(CARD_END), re.DOTALL)
    text = card.text
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:  # after the title, if the card starts with one
        head, newline, rest = text.lstrip("\n").partition("\n")
        text = f"{head}\n\n{section}\n{rest}" if head.startswith("# ") else f"{section}\n\n{text}"
    card.text = text
    card.save(path)


# ---------------------------------------------------------------------------------------------- the wrappers


def save_folder(
    original: Callable, peft_model: Any, save_directory: str, adapter_ref: str | None, tags: Iterable[str], **kwargs
) -> None:
    """PEFT's ``save_pretrained`` into a staging folder, the card completed, then moved into ``save_directory``."""
    with staged_directory(save_directory) as staging:
        card = os.path.join(save_directory, CARD_NAME)
        if os.path.isfile(card):  # PEFT updates the card that is there
            shutil.copy2(card, os.path.join(staging, CARD_NAME))
        original(peft_model, staging, **kwargs)
        add_card_section(os.path.join(staging, CARD_NAME), peft_model, adapter_ref, tags)


def _save_pretrained(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def save_pretrained(self, *args, **kwargs):
        if not is_peft_slim_model(self):
            return original(self, *args, **kwargs)
        arguments = signature.bind(self, *args, **kwargs).arguments
        extra = arguments.pop("kwargs", {})
        arguments.pop("self")
        if arguments.get("path_initial_model_for_weight_conversion") is not None:
            raise ValueError(
                "save_pretrained: path_initial_model_for_weight_conversion converts PiSSA/CorDA/OLoRA LoRA adapters; "
                f"it does not apply to a {self.base_model.method_name} adapter. Use peft_slim.export_lora first "
                "and convert the plain LoRA adapter with PEFT."
            )
        if not arguments.get("is_main_process", True):  # PEFT writes nothing then
            return original(self, *args, **kwargs)
        save_directory = arguments.pop("save_directory")
        save_folder(original, self, save_directory, None, (), **arguments, **extra)

    return save_pretrained


def _push_to_hub(original: Callable) -> Callable:
    def push_to_hub(self, *args, **kwargs):
        if not is_peft_slim_model(self):
            return original(self, *args, **kwargs)
        return push_folder(self, *args, **kwargs)

    return push_to_hub


def push_folder(
    peft_model: Any,
    repo_id: str,
    *,
    commit_message: str | None = None,
    commit_description: str | None = None,
    private: bool | None = None,
    token: bool | str | None = None,
    revision: str | None = None,
    create_pr: bool = False,
    max_shard_size: int | str | None = None,  # accepted as transformers' push_to_hub does; adapters are not sharded
    tags: list[str] | None = None,
) -> Any:
    """``push_to_hub`` for a peft_slim adapter: the files ``save_pretrained`` writes (the card starting from the
    Hub's, if the repository has one, plus ``tags``), in one commit, through huggingface_hub's public API."""
    from huggingface_hub import CommitOperationAdd, HfApi, ModelCard
    from huggingface_hub.errors import EntryNotFoundError

    api = HfApi()
    repo_id = api.create_repo(repo_id, private=private, token=token, exist_ok=True).repo_id
    with tempfile.TemporaryDirectory() as folder:
        with contextlib.suppress(EntryNotFoundError):  # keep the card already on the Hub, updated
            ModelCard.load(repo_id, token=token).save(os.path.join(folder, CARD_NAME))
        save_folder(unwrapped_peft_model_method("save_pretrained"), peft_model, folder, repo_id, tags or ())
        operations = [
            CommitOperationAdd(path_in_repo=_repo_path(path, folder), path_or_fileobj=path)
            for path in sorted(_files(folder))
        ]
        if revision is not None and not revision.startswith("refs/pr"):
            api.create_branch(repo_id=repo_id, branch=revision, token=token, exist_ok=True)
        return api.create_commit(
            repo_id=repo_id,
            operations=operations,
            commit_message=commit_message or "Upload model",
            commit_description=commit_description,
            token=token,
            create_pr=create_pr,
            revision=revision,
        )


def _repo_path(path: str, folder: str) -> str:
    return os.path.relpath(path, folder).replace(os.sep, "/")


def _files(folder: str) -> Iterator[str]:
    for root, _, files in os.walk(folder):
        for file in files:
            yield os.path.join(root, file)


def _load_adapter(original: Callable) -> Callable:
    signature = inspect.signature(original)

    def load_adapter(self, *args, **kwargs):
        if not is_peft_slim_model(self):
            return original(self, *args, **kwargs)
        from peft import PeftConfig

        from .config import MethodConfig

        ignore_mismatch = kwargs.pop(MISMATCH_FLAG, False)
        arguments = signature.bind(self, *args, **kwargs).arguments
        model_id, adapter_name = arguments["model_id"], arguments["adapter_name"]
        tuner, saved = self.base_model, None
        if adapter_name in self.peft_config:
            # The saved config's record, not the model's: a Trainer reloads an earlier checkpoint into the model.
            saved = PeftConfig.from_pretrained(model_id, **arguments.get("kwargs", {}))
            if isinstance(saved, MethodConfig):
                tuner._check_base_model(saved, str(model_id), ignore_mismatch)
            else:
                saved = None
        tuner._loaded_keys = None
        load_result = original(self, *args, **kwargs)
        loaded, tuner._loaded_keys = tuner._loaded_keys, None
        if saved is not None and loaded is not None:
            # PEFT keeps only the missing keys that contain the method's prefix ("tokentune_", "slimfit_"), which
            # none of ours do; list those the adapter file should have held.
            load_result.missing_keys[:] = tuner._missing_keys(self, saved, adapter_name, loaded)
        # Listed in load_result as PEFT lists them, and warned about, except the copies PEFT itself saves of a
        # modules_to_save head's bias with bias="all" (loaded through the head's own key).
        wrapped = wrapper_module_names(self)
        unexpected = [key for key in load_result.unexpected_keys if not _under(key, wrapped)]
        if unexpected:
            warnings.warn(
                f"{tuner.method_name} adapter {str(model_id)!r}: found unexpected keys (tensors this model has no "
                f"place for; they were not loaded) in the adapter file: {sorted(unexpected)}.",
                stacklevel=2,
            )
        return load_result

    return load_adapter


def install() -> None:
    """Wrap PeftModel's saving and loading methods for peft_slim adapters (idempotent)."""
    wrap_peft_model_method("save_pretrained", _save_pretrained)
    wrap_peft_model_method("push_to_hub", _push_to_hub)
    wrap_peft_model_method("load_adapter", _load_adapter)


# ---------------------------------------------------------------------------------------------- base identity


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
