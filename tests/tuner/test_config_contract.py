"""Every config checks and coerces its fields in __post_init__ (nested ones included) and (de)serialises
the same way; unknown keys raise for the user and warn for a saved file; a failed save damages nothing."""

from __future__ import annotations

import dataclasses
import json
import os
import warnings

import numpy as np
import peft
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftConfig, get_peft_model

import peft_slim
from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig
from peft_slim.tuner.config import METHOD_CONFIG_NAME

CONFIGS = [TokenTuneConfig, SlimFitConfig, TokenSelectionConfig, ActivationCompressionConfig]
LORA = LoraConfig(r=2, target_modules=["q_proj"])


# ---------------------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("cls", CONFIGS)
def test_misspelt_keyword_is_a_type_error_naming_it(cls):
    field = {TokenTuneConfig: "token_ratio", SlimFitConfig: "freeze_ratio"}.get(cls, "seed")
    if cls is ActivationCompressionConfig:
        field = "group_size"
    typo = field[:-1] + field[-1] * 2 + "x"
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}'"):  # Python's own, as PEFT's configs
        cls(**{typo: 1})


@pytest.mark.parametrize(
    ("fields", "where", "nearest"),
    [
        ({"lora": {"r": 4, "target_module": ["q_proj"]}}, "TokenTuneConfig.lora", "target_modules"),
        ({"activation_compression": {"bitz": 4}}, "TokenTuneConfig.activation_compression", "bits"),
    ],
)
def test_unknown_key_in_a_nested_dict_is_an_error(fields, where, nearest):
    with pytest.raises(ValueError, match=f"(?s){where}.*did you mean `{nearest}`"):
        TokenTuneConfig(**fields)


def test_unknown_key_in_slimfit_tokentune_dict_is_an_error():
    with pytest.raises(ValueError, match="(?s)SlimFitConfig.token_selection.*did you mean `token_ratio`"):
        SlimFitConfig(token_selection={"token_ratios": 0.2})


def test_unknown_keys_in_a_saved_config_warn_and_name_the_saving_version(tmp_path):
    compression = ActivationCompressionConfig(bits=4)
    TokenTuneConfig(token_ratio=0.25, activation_compression=compression, lora=LORA).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / METHOD_CONFIG_NAME).read_text())
    config["future_field"] = 1
    config["activation_compression"]["future_bits"] = 3
    config["peft_slim_version"] = "9.9.9"
    (tmp_path / METHOD_CONFIG_NAME).write_text(json.dumps(config))
    with pytest.warns(UserWarning) as caught:
        loaded = peft_slim.load_config(str(tmp_path))
    messages = " ".join(str(w.message) for w in caught)
    assert "future_field" in messages and "future_bits" in messages and "9.9.9" in messages
    assert "upgrade peft_slim" in messages
    assert isinstance(loaded, TokenTuneConfig) and loaded.activation_compression.bits == 4


@pytest.mark.parametrize("saved_by", [peft_slim.__version__, "0.0.1"])
def test_a_field_this_version_dropped_warns_without_asking_for_an_upgrade(tmp_path, saved_by):
    TokenTuneConfig(token_ratio=0.25, lora=LORA).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / METHOD_CONFIG_NAME).read_text())
    config["base_weights"] = None  # a field an earlier build of this version wrote
    config["peft_slim_version"] = saved_by
    (tmp_path / METHOD_CONFIG_NAME).write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"\['base_weights'\].*no longer uses them") as caught:
        peft_slim.load_config(str(tmp_path))
    assert not any("upgrade" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------- nested selection


def test_a_tokentune_config_in_slimfit_gives_its_selection_fields():
    config = SlimFitConfig(token_selection=TokenTuneConfig(num_tokens=8, selection="answer", seed=3))
    assert config.token_selection == TokenSelectionConfig(num_tokens=8, selection="answer", seed=3)


# ---------------------------------------------------------------------------------------------- coercion


def test_numpy_values_are_coerced_to_python_and_save(tmp_path):
    config = TokenTuneConfig(num_tokens=np.int64(8), seed=np.int32(3), lora=LORA)
    slim = SlimFitConfig(freeze_ratio=np.float32(0.5), max_frozen_steps=np.int64(7))
    assert type(config.num_tokens) is int and type(config.seed) is int
    assert type(slim.freeze_ratio) is float and type(slim.max_frozen_steps) is int
    config.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / METHOD_CONFIG_NAME).read_text())["num_tokens"] == 8


def test_a_single_module_name_is_one_name_not_its_characters():
    assert TokenTuneConfig(modules_to_save="score").modules_to_save == ["score"]
    assert SlimFitConfig(modules_to_save="classifier").modules_to_save == ["classifier"]


@pytest.mark.parametrize(
    ("cls", "fields", "message"),
    [
        (ActivationCompressionConfig, {"bits": 4.0}, "ActivationCompressionConfig.bits must be one of"),
        (ActivationCompressionConfig, {"group_size": 64.0}, "group_size"),
        (ActivationCompressionConfig, {"kind_bits": {"activation": 4.0}}, r"kind_bits\['activation'\]"),
        (SlimFitConfig, {"epsilon": float("inf")}, "epsilon must be a finite float > 0"),
        (SlimFitConfig, {"epsilon": float("nan")}, "epsilon"),
        (TokenTuneConfig, {"num_tokens": 10**30}, "num_tokens must be an int in"),
        (TokenTuneConfig, {"seed": 2**64}, "seed must be an int in"),
        (TokenTuneConfig, {"seed": -1}, "seed must be an int in"),
        (SlimFitConfig, {"seed": 2**64}, "seed must be an int in"),
        (SlimFitConfig, {"units": ["(unclosed"]}, "SlimFitConfig.units: '\\(unclosed' is not a valid regular"),
        (SlimFitConfig, {"always_trainable": "(bad"}, "always_trainable: '\\(bad' is not a valid regular"),
        (TokenTuneConfig, {"trainable_modules": "[x"}, "trainable_modules"),
        (TokenTuneConfig, {"modules_to_save": ["score", None]}, "TokenTuneConfig.modules_to_save"),
        (TokenTuneConfig, {"trainable_modules": ["q_proj", None]}, "TokenTuneConfig.trainable_modules"),
        (SlimFitConfig, {"always_trainable": [None]}, "SlimFitConfig.always_trainable"),
        (TokenTuneConfig, {"token_ratio": True}, "token_ratio"),
        (TokenTuneConfig, {"selection": "randm"}, "did you mean `random`"),
    ],
)
def test_bad_values_are_value_errors_naming_the_field(cls, fields, message):
    with pytest.raises(ValueError, match=message):
        cls(**fields)


# ---------------------------------------------------------------------------------------------- the nested LoRA


@pytest.mark.parametrize("cls", [TokenTuneConfig, SlimFitConfig])
def test_the_nested_lora_values_are_pefts_to_check(cls):
    """Only what would make the method silently wrong is refused (nested_lora.REFUSED_LORA_FIELDS); a LoRA value
    PEFT takes is taken, as PEFT's own LoraConfig holds it."""
    lora = LoraConfig(r=4, lora_alpha=8, rank_pattern={"q_proj": 2}, layers_to_transform=[0])
    assert cls(lora=lora).lora is lora
    assert cls(lora={"r": 4, "lora_alpha": 8}).lora.lora_alpha == 8  # (refused fields: tests/saving/test_saving.py)


# ---------------------------------------------------------------------------------------------- round trips

_ratios = st.one_of(st.none(), st.floats(0.01, 1.0))


@settings(max_examples=40, deadline=None)
@given(
    ratio=_ratios,
    count=st.one_of(st.none(), st.integers(1, 4096)),
    rule=st.sampled_from(["random", "answer"]),
    seed=st.one_of(st.none(), st.integers(0, 2**62)),
    bits=st.sampled_from([None, 2, 4, 8]),
    freeze=st.floats(0.0, 0.99),
)
def test_every_valid_config_round_trips_through_json(tmp_path_factory, ratio, count, rule, seed, bits, freeze):
    if ratio is not None and count is not None:
        with pytest.raises(ValueError, match="exactly one of"):
            TokenTuneConfig(token_ratio=ratio, num_tokens=count)
        return
    selection = {"token_ratio": ratio, "num_tokens": count, "selection": rule, "seed": seed}
    compression = {"bits": bits, "kind_bits": {"activation": 4}}
    for config in (
        TokenTuneConfig(**selection, activation_compression=compression, lora=LoraConfig(r=2)),
        SlimFitConfig(
            freeze_ratio=freeze,
            units=[r".*layers\.(\d+)\..*"],
            token_selection=selection,
            activation_compression=compression,
            lora=LORA,
        ),
    ):
        folder = str(tmp_path_factory.mktemp("config"))
        config.save_pretrained(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a config this version saved loads without a word
            loaded = peft_slim.load_config(folder)  # with LoRA: from peft_slim_config.json beside the LoRA config
            plain = PeftConfig.from_pretrained(folder)
        assert type(loaded) is type(config)
        assert loaded.method_dict() == config.method_dict()
        assert loaded.lora_export_config().to_dict() == config.lora_export_config().to_dict()
        assert type(plain) is LoraConfig


# ---------------------------------------------------------------------------------------------- atomic saves


def test_a_failed_config_save_leaves_the_existing_file_untouched(tmp_path):
    TokenTuneConfig(token_ratio=0.5, lora=LORA).save_pretrained(str(tmp_path))
    before = {name: (tmp_path / name).read_bytes() for name in ("adapter_config.json", METHOD_CONFIG_NAME)}
    broken = TokenTuneConfig(token_ratio=0.5, lora=LORA)
    broken.revision = object()  # not JSON-serialisable: the save must fail before touching the disk
    with pytest.raises(TypeError):
        broken.save_pretrained(str(tmp_path))
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(tmp_path)) == sorted(before)  # no temporary file left behind


# ---------------------------------------------------------------------------------------------- saved files

SAVED = os.path.join(os.path.dirname(os.path.dirname(__file__)), "helpers", "data", "saved_configs")


def _recorded_configs() -> dict:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", "tools"))
    try:
        from record_saved_configs import configs
    finally:
        sys.path.pop(0)
    return configs()


@pytest.mark.parametrize("name", ["tokentune", "slimfit"])
def test_adapter_config_json_is_byte_identical_to_the_recorded_one(name, tmp_path):
    """Recorded from the code before configs became plain dataclasses (tools/record_saved_configs.py)."""
    from helpers.tiny_models import build

    recorded = os.path.join(SAVED, name, "adapter_config.json")
    with open(recorded, "rb") as handle:
        expected = handle.read()
    if json.loads(expected)["peft_version"] != peft.__version__:
        pytest.skip(f"recorded with PEFT {json.loads(expected)['peft_version']}, whose LoraConfig has other fields")
    get_peft_model(build("llama"), _recorded_configs()[name]).save_pretrained(str(tmp_path))
    assert (tmp_path / "adapter_config.json").read_bytes() == expected


@pytest.mark.parametrize("name", ["tokentune", "slimfit"])
def test_a_folder_saved_by_the_earlier_code_loads_as_the_same_config(name):
    """The earlier sidecar repeats the LoRA settings: they are ignored, the LoRA is adapter_config.json's. SlimFit's
    holds `token_selection` under its earlier name `tokentune`. Saved before `prompt_ratio` existed, the selection
    loads with prompt_ratio 1.0: the rule it trained with (the budget filled with prompt tokens)."""
    config = _recorded_configs()[name]
    if name == "tokentune":
        config = dataclasses.replace(config, prompt_ratio=1.0)
    else:
        selection = dataclasses.replace(config.token_selection, prompt_ratio=1.0)
        config = dataclasses.replace(config, token_selection=selection)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = peft_slim.load_config(os.path.join(SAVED, name))
    assert type(loaded) is type(config)
    for spec in dataclasses.fields(config):
        if spec.name not in ("lora", "inference_mode", "peft_slim_version"):
            assert getattr(loaded, spec.name) == getattr(config, spec.name), spec.name
    for key in ("r", "lora_alpha", "target_modules", "task_type"):
        assert getattr(loaded.lora, key) == getattr(config.lora, key), key
