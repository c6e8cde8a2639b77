"""What every peft_slim method's config has: a nested LoRA, saved modules, activation compression, one contract."""

from __future__ import annotations

import dataclasses
import os
from dataclasses import field
from typing import Any, ClassVar

from peft import LoraConfig, PeftConfig
from peft.utils import CONFIG_NAME

from ..compression import ActivationCompressionConfig
from ..configuration import (
    VERSION_KEY,
    Lora,
    NameList,
    Nested,
    ValidatedConfig,
    atomic_write_text,
    config_dataclass,
    dump_json,
    to_json_value,
)
from ..nested_lora import lora_export_config
from ..registry import add_peft_type


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
    peft_slim_version: str | None = field(
        default=None,
        metadata={"help": "The peft_slim version that saved this config (written on save; informative)."},
    )

    def __post_init__(self):
        super().__post_init__()  # PeftConfig's: task type and PEFT's version
        self.peft_type = add_peft_type(self.method)
        ValidatedConfig.__post_init__(self)

    def to_dict(self) -> dict[str, Any]:
        from .. import __version__

        values = {spec.name: to_json_value(getattr(self, spec.name)) for spec in dataclasses.fields(self)}
        values[VERSION_KEY] = __version__
        return values

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """Write ``adapter_config.json`` atomically: a failure leaves the file that was there untouched."""
        if os.path.isfile(save_directory):
            raise ValueError(f"save_pretrained: {save_directory!r} is a file; give a directory.")
        values = self.to_dict()
        auto_mapping = kwargs.pop("auto_mapping_dict", None)
        if auto_mapping is not None:
            values["auto_mapping"] = auto_mapping
        text = dump_json(values)  # fails here, before the disk is touched
        atomic_write_text(os.path.join(save_directory, CONFIG_NAME), text)

    def lora_export_config(self) -> LoraConfig:
        """The plain LoraConfig equivalent of this adapter, as vanilla PEFT would save it."""
        return lora_export_config(self.lora, self)
