"""Export a stacked LoRA adapter as a plain PEFT LoRA adapter."""

from __future__ import annotations

import os

from peft import PeftModel
from peft.utils import SAFETENSORS_WEIGHTS_NAME, get_peft_model_state_dict
from safetensors.torch import save_file

from .compat import base_model_class
from .tuner.saving import staged_directory


def export_lora(model: PeftModel, out_dir: str, adapter_name: str = "default") -> str:
    """Write ``model``'s LoRA adapter to ``out_dir`` as vanilla PEFT would save a LoraConfig adapter.

    The result loads with ``peft.PeftModel.from_pretrained`` in a process that never imports peft_slim.
    Both files are written atomically: a failure leaves whatever ``out_dir`` held untouched. Returns ``out_dir``.
    """
    if not isinstance(model, PeftModel):
        raise ValueError(f"export_lora expects a peft.PeftModel, got {type(model).__name__}.")
    if adapter_name not in model.peft_config:
        raise ValueError(f"export_lora: no adapter named {adapter_name!r}; have {sorted(model.peft_config)}.")
    config = model.peft_config[adapter_name]
    if getattr(config, "lora", None) is None:
        raise ValueError(
            f"export_lora: adapter {adapter_name!r} ({config.peft_type}) has no `lora` config; it trained base "
            "weights. Use save_pretrained, or merge_and_unload() and save the merged model."
        )
    lora_config = config.lora_export_config()
    state_dict = get_peft_model_state_dict(model, adapter_name=adapter_name, save_embedding_layers=False)
    if lora_config.base_model_name_or_path is None:
        lora_config.base_model_name_or_path = model.get_base_model().__dict__.get("name_or_path", None) or None
    auto_mapping = None
    if lora_config.task_type is None:  # as PeftModel.save_pretrained does, so AutoPeftModel* can load it
        base_cls = base_model_class(model)
        auto_mapping = {"base_model_class": base_cls.__name__, "parent_library": base_cls.__module__}
    # Copies: safetensors refuses tensors that share memory (with bias="all", a modules_to_save head's bias is saved
    # under two keys, as PEFT's save_pretrained saves it, which clones them too).
    tensors = {key: value.detach().cpu().contiguous().clone() for key, value in state_dict.items()}
    with staged_directory(out_dir) as staging:
        lora_config.save_pretrained(staging, auto_mapping_dict=auto_mapping)
        save_file(tensors, os.path.join(staging, SAFETENSORS_WEIGHTS_NAME), metadata={"format": "pt"})
    return out_dir
