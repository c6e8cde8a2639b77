"""What every peft_slim method's config has: a nested LoRA, saved modules, activation compression, one contract."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Any, ClassVar

from peft import LoraConfig, PeftConfig
from peft.utils import CONFIG_NAME

from .._version import __version__
from ..compression import ActivationCompressionConfig
from ..configuration import (
    VERSION_KEY,
    Check,
    Lora,
    NameList,
    Nested,
    ValidatedConfig,
    atomic_write_text,
    config_dataclass,
    dump_json,
    to_json_value,
)
from ..nested_lora import check_lora_fields, lora_export_config, merged_modules_to_save
from ..registry import add_peft_type

_HUB_KEYWORDS = ("revision", "cache_dir", "token", "local_files_only", "force_download")


def _has_record(model_id: str, subfolder: str | None, hub_kwargs: dict) -> bool:
    from .saving import RECORD_NAME, _adapter_file

    return _adapter_file(model_id, RECORD_NAME, subfolder, **hub_kwargs) is not None


@dataclasses.dataclass
class BaseWeightsRecord(Check):
    """What ``save_pretrained`` records of a standalone adapter's base model (see ``MethodConfig.base_weights``)."""

    optional: bool = True
    expected: str = (
        "the record save_pretrained writes: {'saved': [parameter names], 'others': {'count': int, 'dtypes': "
        "[str], 'blake2b': str}} (leave it None)"
    )

    def coerce(self, value: Any, where: str) -> dict:
        if not isinstance(value, dict) or set(value) != {"saved", "others"}:
            self.fail(value, where)
        saved, others = value["saved"], value["others"]
        if not isinstance(saved, (list, tuple)) or not all(isinstance(name, str) and name for name in saved):
            self.fail(value, where)
        if not isinstance(others, dict) or set(others) != {"count", "dtypes", "blake2b"}:
            self.fail(value, where)
        count, dtypes, digest = others["count"], others["dtypes"], others["blake2b"]
        if isinstance(count, bool) or not isinstance(count, int) or count < 0 or not isinstance(digest, str):
            self.fail(value, where)
        if not isinstance(dtypes, (list, tuple)) or not all(isinstance(d, str) for d in dtypes):
            self.fail(value, where)
        return {"saved": sorted(saved), "others": {"count": count, "dtypes": sorted(dtypes), "blake2b": digest}}


@config_dataclass
class MethodConfig(PeftConfig, ValidatedConfig):
    """Base of the PEFT configs of peft_slim's methods (a subclass sets ``method``, e.g. "TOKENTUNE").

    With `lora`, the method trains that LoRA adapter; without it, base weights. Every field, nested ones
    included, is checked and serialised by ``peft_slim.configuration``; ``save_pretrained`` is atomic.
    """

    method: ClassVar[str] = ""

    lora: LoraConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft.LoraConfig: train this LoRA adapter. None: train the base model's weights.",
            "check": Lora(),
        },
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={
            "help": "Extra modules (e.g. a new classification head) trained and saved in full, as in LoRA.",
            "check": NameList(),
        },
    )
    activation_compression: ActivationCompressionConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft_slim.ActivationCompressionConfig (or its dict): compress the activations saved for "
            "backward inside every training forward. None: no compression.",
            "check": Nested(ActivationCompressionConfig),
        },
    )
    base_weights: dict | None = field(
        default=None,
        metadata={
            "help": "Read from standalone adapters saved by earlier peft_slim versions (leave it None; saving now "
            "keeps this record in adapter_model.safetensors, beside the tensors it describes): `saved`, the base "
            "parameters the file holds, and `others`, the count, dtypes and joint blake2b digest of every other base "
            "parameter as it was when the model was wrapped. Loading reports a saved tensor missing from the file, "
            "and refuses a base model whose other parameters differ.",
            "check": BaseWeightsRecord(),
        },
    )
    peft_slim_version: str | None = field(
        default=None,
        metadata={"help": "The peft_slim version that saved this config (written on save; informative)."},
    )

    def __post_init__(self):
        super().__post_init__()  # PeftConfig's: task type and PEFT's version
        self.peft_type = add_peft_type(self.method)
        ValidatedConfig.__post_init__(self)

    def _check(self) -> None:
        super()._check()
        if self.lora is not None:
            where = f"{type(self).__name__}.lora"
            check_lora_fields(self.lora, where)
            self.modules_to_save = merged_modules_to_save(self.modules_to_save, self.lora, where)

    # PEFT's own code reads these from an adapter's config, as from a LoraConfig (`bias`: which biases train and
    # are saved; `target_modules` and `trainable_token_indices`: whether save_pretrained's
    # save_embedding_layers="auto" saves the embedding layers). A stacked adapter answers with its LoRA's values,
    # so that PEFT treats it exactly as that LoRA adapter; without LoRA, as a config that has none of them.

    @property
    def bias(self) -> str:
        return "none" if self.lora is None else self.lora.bias

    @property
    def target_modules(self) -> Any:
        return None if self.lora is None else self.lora.target_modules

    @property
    def trainable_token_indices(self) -> Any:
        return None if self.lora is None else self.lora.trainable_token_indices

    @property
    def runtime_config(self) -> Any:
        # PeftModel.from_pretrained sets runtime_config.ephemeral_gpu_offload when the config has one.
        if self.lora is None:
            raise AttributeError(f"{type(self).__name__} has a runtime_config only with `lora`.")
        return self.lora.runtime_config

    def to_dict(self) -> dict[str, Any]:
        values = {spec.name: to_json_value(getattr(self, spec.name)) for spec in dataclasses.fields(self)}
        values[VERSION_KEY] = __version__
        return values

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """Write the adapter's config files, each atomically (a failure leaves the file that was there untouched).

        With `lora`: ``adapter_config.json`` is the plain LoraConfig of the adapter (what vanilla PEFT reads, so the
        folder is a standard LoRA adapter) and ``peft_slim_config.json`` this whole config (what
        ``peft_slim.from_pretrained`` reads to continue with the method); the record is written first, so the file
        PEFT writes last stays last. Without `lora`: ``adapter_config.json`` is this config.
        """
        from .saving import RECORD_NAME

        if os.path.isfile(save_directory):
            raise ValueError(f"save_pretrained: {save_directory!r} is a file; give a directory.")
        auto_mapping = kwargs.pop("auto_mapping_dict", None)
        record = self.to_dict()
        if auto_mapping is not None:
            record["auto_mapping"] = auto_mapping
        record_text = dump_json(record)  # fails here, before the disk is touched
        if self.lora is None:
            atomic_write_text(os.path.join(save_directory, CONFIG_NAME), record_text)
            return
        lora = to_json_value(self.lora_export_config())
        if auto_mapping is not None:
            lora["auto_mapping"] = auto_mapping
        lora_text = dump_json(lora)
        atomic_write_text(os.path.join(save_directory, RECORD_NAME), record_text)
        atomic_write_text(os.path.join(save_directory, CONFIG_NAME), lora_text)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs):
        """The saved config: ``peft_slim_config.json`` where the folder has one (a LoRA-stacked adapter), else
        ``adapter_config.json``. ``ignore_base_mismatch`` (from ``PeftModel.from_pretrained``'s keywords) is kept
        for the base-model check of a standalone adapter."""
        from .saving import MISMATCH_FLAG, load_config

        ignore_mismatch = bool(kwargs.pop(MISMATCH_FLAG, False))
        hub_kwargs = {key: value for key, value in kwargs.items() if key in _HUB_KEYWORDS}
        if _has_record(pretrained_model_name_or_path, subfolder, hub_kwargs):
            config = load_config(pretrained_model_name_or_path, subfolder=subfolder, **hub_kwargs)
        else:
            config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        config._ignore_base_mismatch = ignore_mismatch
        config._loaded_from = str(pretrained_model_name_or_path)
        return config

    def lora_export_config(self) -> LoraConfig:
        """The plain LoraConfig equivalent of this adapter, as vanilla PEFT would save it."""
        return lora_export_config(self.lora, self)
