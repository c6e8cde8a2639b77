"""What every peft_slim method's config has: a nested LoRA, saved modules, activation compression, one contract;
and reading a saved adapter's config back (:func:`load_config`, from a folder or a Hub repository)."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar

from huggingface_hub import hf_hub_download
from huggingface_hub.errors import EntryNotFoundError
from peft import LoraConfig, PeftConfig
from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING
from peft.utils import CONFIG_NAME

from .._version import __version__
from ..compression import ActivationCompressionConfig
from ..configuration import VERSION_KEY, atomic_write_text, check_names, nested, saved_fields, to_json_value
from ..nested_lora import check_lora_fields, merged_modules_to_save
from ..registry import add_peft_type
from ..token_selection.config import saved_selection

METHOD_CONFIG_NAME = "peft_slim_config.json"  # a LoRA-stacked adapter's method and its own settings
_HUB_KEYWORDS = ("revision", "cache_dir", "token", "local_files_only", "force_download")
# PeftConfig's fields, read from adapter_config.json (an earlier peft_slim_config.json repeats them, and the LoRA).
_PEFT_FIELDS = frozenset(f.name for f in fields(PeftConfig)) | {"lora"}


def _lora_value(name: str, without_lora: Any) -> property:
    """A config property read from its nested LoRA (``without_lora`` when it has none: a transform's config)."""
    return property(lambda self: getattr(self.lora, name, without_lora))


@dataclass
class MethodConfig(PeftConfig):
    """Base of the PEFT configs of peft_slim's methods (a subclass sets ``method``): through PEFT the method trains
    the LoRA `lora` (required there); without it the config is for the method's transform (full fine-tuning)."""

    method: ClassVar[str] = ""
    nested_types: ClassVar[dict[str, type]] = {"activation_compression": ActivationCompressionConfig}
    saved_names: ClassVar[dict[str, str]] = {}  # a field's name in sidecars of an earlier peft_slim -> its name now

    lora: LoraConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft.LoraConfig: the LoRA adapter the method trains (required by get_peft_model). None: only "
            "for full fine-tuning with peft_slim.tokentune_ / slimfit_, which train the model's own weights."
        },
    )
    modules_to_save: list[str] | None = field(
        default=None,
        metadata={"help": "Extra modules (e.g. a new classification head) trained and saved in full, as in LoRA."},
    )
    activation_compression: ActivationCompressionConfig | dict | None = field(
        default=None,
        metadata={
            "help": "A peft_slim.ActivationCompressionConfig (or its dict): compress the activations saved for "
            "backward inside every training forward. None: no compression."
        },
    )
    peft_slim_version: str | None = field(
        default=None,
        metadata={"help": "The peft_slim version that saved this config (written on save; informative)."},
    )

    def __post_init__(self):
        PeftConfig.__post_init__(self)  # task type and PEFT's version
        self.peft_type = add_peft_type(self.method)
        name = type(self).__name__
        self.lora = nested(f"{name}.lora", self.lora, LoraConfig)
        self.modules_to_save = check_names(f"{name}.modules_to_save", self.modules_to_save, regex=False)
        compression = self.activation_compression
        self.activation_compression = nested(
            f"{name}.activation_compression", compression, ActivationCompressionConfig
        )
        if self.lora is not None:
            check_lora_fields(self.lora, f"{name}.lora")
            self.modules_to_save = merged_modules_to_save(self.modules_to_save, self.lora, f"{name}.lora")

    # PEFT reads these from an adapter's config as from a LoraConfig (which biases train and are saved; whether
    # save_embedding_layers="auto" saves the embeddings): the nested LoRA's, so PEFT treats it as that LoRA adapter.
    bias = _lora_value("bias", "none")
    target_modules = _lora_value("target_modules", None)
    trainable_token_indices = _lora_value("trainable_token_indices", None)

    def __getattr__(self, name: str) -> Any:
        # Any other LoRA setting PEFT reads from the adapter's config (aLoRA's, KaSA's, ...): the nested LoRA's.
        lora = self.__dict__.get("lora")
        if name.startswith("_") or not isinstance(lora, LoraConfig) or not hasattr(lora, name):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return getattr(lora, name)

    @property
    def runtime_config(self) -> Any:
        # PeftModel.from_pretrained sets runtime_config.ephemeral_gpu_offload when the config has one.
        if self.lora is None:
            raise AttributeError(f"{type(self).__name__} has a runtime_config only with `lora`.")
        return self.lora.runtime_config

    def to_dict(self) -> dict[str, Any]:
        values = {spec.name: to_json_value(getattr(self, spec.name)) for spec in fields(self)}
        return {**values, VERSION_KEY: __version__}

    def method_dict(self) -> dict[str, Any]:
        """What ``peft_slim_config.json`` holds: the method (``peft_type``) and its own fields; the LoRA and PEFT's
        fields are in ``adapter_config.json`` only."""
        own = {key: value for key, value in self.to_dict().items() if key not in _PEFT_FIELDS}
        return {**own, "peft_type": to_json_value(self.peft_type)}

    def save_pretrained(self, save_directory: str, **kwargs) -> None:
        """Write ``adapter_config.json`` (the plain LoraConfig vanilla PEFT reads) and, first, so that PEFT's file
        stays the last written, ``peft_slim_config.json`` (the method's own fields), each atomically."""
        if os.path.isfile(save_directory):
            raise ValueError(f"save_pretrained: {save_directory!r} is a file; give a directory.")
        auto_mapping = kwargs.pop("auto_mapping_dict", None)
        extra = {} if auto_mapping is None else {"auto_mapping": auto_mapping}
        # Both fail here, before the disk is touched (indented, sorted keys: as PEFT writes).
        method_text = json.dumps(self.method_dict(), indent=2, sort_keys=True)
        lora_text = json.dumps({**to_json_value(self.lora_export_config()), **extra}, indent=2, sort_keys=True)
        atomic_write_text(os.path.join(save_directory, METHOD_CONFIG_NAME), method_text)
        atomic_write_text(os.path.join(save_directory, CONFIG_NAME), lora_text)

    @classmethod
    def from_pretrained(cls, pretrained_model_name_or_path: str, subfolder: str | None = None, **kwargs):
        """The saved config (:func:`load_config`); an ``adapter_config.json`` alone of this method is an earlier
        peft_slim's adapter without LoRA: refused."""
        hub_kwargs = {key: value for key, value in kwargs.items() if key in _HUB_KEYWORDS}
        if adapter_file(pretrained_model_name_or_path, METHOD_CONFIG_NAME, subfolder, **hub_kwargs) is not None:
            return load_config(pretrained_model_name_or_path, subfolder=subfolder, **hub_kwargs)
        config = super().from_pretrained(pretrained_model_name_or_path, subfolder=subfolder, **kwargs)
        refuse_standalone(config, pretrained_model_name_or_path)
        return config

    def lora_export_config(self) -> LoraConfig:
        """The plain LoraConfig that vanilla PEFT would save for this adapter's nested ``lora``."""
        if self.lora is None:
            raise ValueError(
                f"{type(self).__name__}.lora is None: there is no LoRA adapter to save. Set lora=LoraConfig(...); a "
                "config without it is for full fine-tuning (peft_slim.tokentune_ / slimfit_), saved as the model."
            )
        values = {
            key: sorted(value) if isinstance(value, set) else value for key, value in self.lora.to_dict().items()
        }
        config = LoraConfig.from_peft_type(**values)  # its sets as lists: PEFT only converts a config's top-level sets
        config.base_model_name_or_path = self.base_model_name_or_path
        config.revision = self.revision
        config.task_type = self.task_type
        config.inference_mode = True
        if self.modules_to_save:
            config.modules_to_save = sorted(set(config.modules_to_save or []) | set(self.modules_to_save))
        return config


# ---------------------------------------------------------------------------------------------- loading


def load_config(model_id: str, subfolder: str | None = None, **hub_kwargs) -> Any:
    """The peft_slim config of the adapter at ``model_id``: the method's fields from ``peft_slim_config.json``, the
    LoRA and PEFT's fields from ``adapter_config.json`` (an earlier sidecar's copy of them is read only without it)."""
    method_file = adapter_file(model_id, METHOD_CONFIG_NAME, subfolder, **hub_kwargs)
    if method_file is None:
        config = PeftConfig.from_pretrained(model_id, subfolder=subfolder, **hub_kwargs)
        if not isinstance(config, MethodConfig):
            raise ValueError(
                f"{model_id!r} holds a {getattr(config.peft_type, 'value', config.peft_type)} adapter without "
                f"peft_slim's {METHOD_CONFIG_NAME}: it was not saved from a peft_slim method. Load it with "
                "peft.PeftModel.from_pretrained."
            )
        refuse_standalone(config, model_id)
        return config
    with open(method_file) as handle:
        text = handle.read()
    try:
        values = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(
            f"{method_file} is not valid JSON ({error}; {len(text)} characters): the file is cut short or was edited "
            "by hand. Save the adapter again, or restore the file."
        ) from None
    config_cls = PEFT_TYPE_TO_CONFIG_MAPPING.get(values.get("peft_type")) if isinstance(values, dict) else None
    if config_cls is None or not issubclass(config_cls, MethodConfig):
        found = values.get("peft_type") if isinstance(values, dict) else values
        raise ValueError(
            f"{method_file}: peft_type {found!r} is not a peft_slim method (expected one of "
            f"{sorted(str(t) for t, c in PEFT_TYPE_TO_CONFIG_MAPPING.items() if issubclass(c, MethodConfig))})."
        )
    peft_fields = values  # an earlier peft_slim_config.json without adapter_config.json beside it
    if adapter_file(model_id, CONFIG_NAME, subfolder, **hub_kwargs) is not None:
        adapter = PeftConfig.from_pretrained(model_id, subfolder=subfolder, **hub_kwargs)
        if not isinstance(adapter, LoraConfig):
            raise ValueError(
                f"{model_id!r}: {CONFIG_NAME} holds a {getattr(adapter.peft_type, 'value', adapter.peft_type)} "
                f"adapter, but {METHOD_CONFIG_NAME} a {values['peft_type']} one, which stands on LoRA. Save it again."
            )
        adapter.inference_mode = False  # written True for vanilla PEFT; PEFT sets the method config's at load
        peft_fields = {**to_json_value(adapter), "lora": adapter}
    version = values.get(VERSION_KEY)
    values = {config_cls.saved_names.get(key, key): value for key, value in values.items()}
    own = saved_fields(
        config_cls, {k: v for k, v in values.items() if k not in _PEFT_FIELDS}, version, config_cls.nested_types
    )
    if "selection" in own:  # TokenTune's own selection fields
        own = saved_selection(own)
    if isinstance(own.get("token_selection"), dict):  # SlimFit's
        own["token_selection"] = saved_selection(own["token_selection"])
    common = {
        key: peft_fields.get(key) for key in ("task_type", "base_model_name_or_path", "revision", "auto_mapping")
    }
    lora = peft_fields.get("lora")
    if isinstance(lora, dict):
        lora = LoraConfig(**saved_fields(LoraConfig, lora, version, {}))
    try:
        config = config_cls(**own, **common, lora=lora)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{method_file}: {error}") from None
    refuse_standalone(config, model_id)
    return config


def refuse_standalone(config: Any, model_id: str) -> None:
    """Refuse an earlier peft_slim's adapter without LoRA, naming the transform that replaced it."""
    if config.lora is None:
        transform = f"peft_slim.{str(getattr(config.peft_type, 'value', config.peft_type)).lower()}_"
        raise ValueError(
            f"{model_id!r} is a {type(config).__name__} adapter without LoRA (base weights trained in place), which "
            f"peft_slim no longer loads: full fine-tuning is now {transform}(model, config) on a plain model, saved "
            "as a model checkpoint (model.save_pretrained). To keep these weights, load adapter_model.safetensors "
            "into the base model (keys without 'base_model.model.', load_state_dict(strict=False)) and save that."
        )


def adapter_file(model_id: str, name: str, subfolder: str | None = None, **hub_kwargs) -> str | None:
    """Local path of file ``name`` of the adapter at ``model_id`` (a folder or a Hub repository); None if absent."""
    folder = os.path.join(model_id, subfolder) if subfolder else model_id
    if os.path.isdir(folder):
        path = os.path.join(folder, name)
        return path if os.path.isfile(path) else None
    try:
        return hf_hub_download(model_id, name, subfolder=subfolder, **hub_kwargs)
    except EntryNotFoundError:
        return None
