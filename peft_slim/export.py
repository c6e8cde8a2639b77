"""Export a stacked LoRA adapter as a plain PEFT LoRA adapter, without `peft_slim_config.json`."""

from __future__ import annotations

import os

from peft import PeftModel

from .atomic_folder import replaced_folder
from .tuner.config import METHOD_CONFIG_NAME
from .tuner.saving import ADAPTER_FILES, is_peft_slim_model


def export_lora(model: PeftModel, out_dir: str, adapter_name: str = "default") -> str:
    """Write ``model``'s LoRA adapter to ``out_dir`` as vanilla PEFT saves a LoraConfig adapter.

    ``save_pretrained`` already writes a plain LoRA adapter (``adapter_config.json`` and the weights); this writes
    the same files without ``peft_slim_config.json`` (the method's settings) and replaces ``out_dir`` atomically as
    ``peft_slim.save_pretrained`` does (a failure leaves what it held untouched; the folder's other files, folders
    and links stay). Returns ``out_dir``.
    """
    if not isinstance(model, PeftModel) or not is_peft_slim_model(model):
        raise ValueError(f"export_lora expects a peft.PeftModel of a peft_slim method, got {type(model).__name__}.")
    if adapter_name not in model.peft_config:
        raise ValueError(f"export_lora: no adapter named {adapter_name!r}; have {sorted(model.peft_config)}.")
    folder = "" if adapter_name == "default" else adapter_name  # where PEFT's save_pretrained puts it

    def rewritten(relative: str) -> bool:
        return os.path.dirname(relative) == folder and os.path.basename(relative) in ADAPTER_FILES

    with replaced_folder(out_dir, rewritten) as staging:
        model.save_pretrained(staging, selected_adapters=[adapter_name], save_embedding_layers=False)
        os.remove(os.path.join(staging, folder, METHOD_CONFIG_NAME))
    return out_dir
