"""One config path: every field of every config (nested ones included) is checked, coerced and (de)serialised
the same way; unknown keys raise for the user and warn for a saved file; a failed save damages nothing."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import warnings

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, PeftConfig, get_peft_model

import peft_slim
from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig
from peft_slim.tuner.config import RECORD_NAME

CONFIGS = [TokenTuneConfig, SlimFitConfig, TokenSelectionConfig, ActivationCompressionConfig]
LORA = LoraConfig(r=2, target_modules=["q_proj"])


# ---------------------------------------------------------------------------------------------- unknown keys


@pytest.mark.parametrize("cls", CONFIGS)
def test_misspelt_keyword_names_the_nearest_field(cls):
    field = {TokenTuneConfig: "token_ratio", SlimFitConfig: "freeze_ratio"}.get(cls, "seed")
    if cls is ActivationCompressionConfig:
        field = "group_size"
    typo = field[:-1] + field[-1] * 2 + "x"
    with pytest.raises(TypeError, match=f"unexpected keyword argument '{typo}'.*did you mean `{field}`"):
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
    with pytest.raises(ValueError, match="(?s)SlimFitConfig.tokentune.*did you mean `token_ratio`"):
        SlimFitConfig(tokentune={"token_ratios": 0.2})


def test_unknown_keys_in_a_saved_config_warn_and_name_the_saving_version(tmp_path):
    compression = ActivationCompressionConfig(bits=4)
    TokenTuneConfig(token_ratio=0.25, activation_compression=compression, lora=LORA).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / RECORD_NAME).read_text())
    config["future_field"] = 1
    config["activation_compression"]["future_bits"] = 3
    config["peft_slim_version"] = "9.9.9"
    (tmp_path / RECORD_NAME).write_text(json.dumps(config))
    with pytest.warns(UserWarning) as caught:
        loaded = peft_slim.load_config(str(tmp_path))
    messages = " ".join(str(w.message) for w in caught)
    assert "future_field" in messages and "future_bits" in messages and "9.9.9" in messages
    assert "upgrade peft_slim" in messages
    assert isinstance(loaded, TokenTuneConfig) and loaded.activation_compression.bits == 4


@pytest.mark.parametrize("saved_by", [peft_slim.__version__, "0.0.1"])
def test_a_field_this_version_dropped_warns_without_asking_for_an_upgrade(tmp_path, saved_by):
    TokenTuneConfig(token_ratio=0.25, lora=LORA).save_pretrained(str(tmp_path))
    config = json.loads((tmp_path / RECORD_NAME).read_text())
    config["base_weights"] = None  # a field an earlier build of this version wrote
    config["peft_slim_version"] = saved_by
    (tmp_path / RECORD_NAME).write_text(json.dumps(config))
    with pytest.warns(UserWarning, match=r"\['base_weights'\].*no longer uses them") as caught:
        peft_slim.load_config(str(tmp_path))
    assert not any("upgrade" in str(w.message) for w in caught)


# ---------------------------------------------------------------------------------------------- nested selection


def test_a_tokentune_config_in_slimfit_gives_its_selection_fields():
    config = SlimFitConfig(tokentune=TokenTuneConfig(num_tokens=8, selection="answer", seed=3))
    assert config.tokentune == TokenSelectionConfig(num_tokens=8, selection="answer", seed=3)


# ---------------------------------------------------------------------------------------------- coercion


def test_numpy_values_are_coerced_to_python_and_save(tmp_path):
    config = TokenTuneConfig(num_tokens=np.int64(8), seed=np.int32(3), lora=LORA)
    slim = SlimFitConfig(freeze_ratio=np.float32(0.5), max_frozen_steps=np.int64(7))
    assert type(config.num_tokens) is int and type(config.seed) is int
    assert type(slim.freeze_ratio) is float and type(slim.max_frozen_steps) is int
    config.save_pretrained(str(tmp_path))
    assert json.loads((tmp_path / RECORD_NAME).read_text())["num_tokens"] == 8


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

_BAD_LORA = [
    ({"r": True}, r"lora\.r must be an int >= 1, got True"),
    ({"r": 4.0}, r"lora\.r must be an int >= 1, got 4\.0"),
    ({"r": 0}, r"lora\.r must be an int >= 1, got 0"),
    ({"r": "8"}, r"lora\.r must be an int >= 1, got '8'"),
    ({"lora_alpha": "16"}, r"lora\.lora_alpha must be a finite float > 0, got '16'"),
    ({"lora_alpha": float("nan")}, r"lora\.lora_alpha must be a finite float > 0, got nan"),
    ({"lora_alpha": float("inf")}, r"lora\.lora_alpha must be a finite float > 0, got inf"),
    ({"lora_dropout": 2.0}, r"lora\.lora_dropout must be a float in \[0, 1\), got 2\.0"),
    ({"target_modules": ["q_proj", None]}, r"lora\.target_modules must be a list of module names"),
    ({"exclude_modules": [""]}, r"lora\.exclude_modules must be a list of module names"),
    ({"rank_pattern": {"q_proj": "4"}}, r"lora\.rank_pattern\['q_proj'\] must be an int >= 1, got '4'"),
    ({"alpha_pattern": {"q_proj": float("nan")}}, r"lora\.alpha_pattern\['q_proj'\] must be a finite float > 0"),
    ({"layers_to_transform": [0, "1"]}, r"lora\.layers_to_transform\[1\] must be an int >= 0, got '1'"),
    ({"layers_to_transform": 1.0}, r"lora\.layers_to_transform must be an int >= 0, or a list of them"),
    ({"use_rslora": "yes"}, r"lora\.use_rslora must be True or False, got 'yes'"),
    ({"bias": "al"}, r"lora\.bias must be one of \('none', 'all', 'lora_only'\), got 'al'"),
    ({"init_lora_weights": None}, r"lora\.init_lora_weights must be True, False or an initialisation's name"),
    ({"init_lora_weights": 1}, r"lora\.init_lora_weights must be True, False or an initialisation's name"),
]


@pytest.mark.parametrize("cls", [TokenTuneConfig, SlimFitConfig])
@pytest.mark.parametrize("form", [dict, LoraConfig], ids=["dict", "LoraConfig"])
@pytest.mark.parametrize(("fields", "message"), _BAD_LORA)
def test_nested_lora_fields_are_checked_as_the_method_fields(cls, form, fields, message):
    with pytest.raises(ValueError, match=f"{cls.__name__}\\.{message}"):
        cls(lora=form(**fields))


_anything = st.one_of(st.none(), st.booleans(), st.integers(-4, 2**40), st.floats(allow_nan=True), st.text(max_size=3))


@settings(max_examples=150, deadline=None)
@given(r=_anything, alpha=_anything, dropout=_anything, as_dict=st.booleans())
def test_nested_lora_numbers_are_exactly_ints_and_finite_floats(r, alpha, dropout, as_dict):
    def real(value):
        return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)

    valid = (
        isinstance(r, int) and not isinstance(r, bool) and r >= 1,
        real(alpha) and alpha > 0,
        real(dropout) and 0 <= dropout < 1,
    )
    fields = {"r": r, "lora_alpha": alpha, "lora_dropout": dropout}
    if not all(valid):
        first = ("r", "lora_alpha", "lora_dropout")[valid.index(False)]
        with pytest.raises(ValueError, match=f"TokenTuneConfig\\.lora\\.{first} must be"):
            TokenTuneConfig(lora=fields if as_dict else LoraConfig(**fields))
        return
    lora = TokenTuneConfig(lora=fields if as_dict else LoraConfig(**fields)).lora
    assert (lora.r, lora.lora_alpha, lora.lora_dropout) == (r, alpha, dropout)
    assert type(lora.lora_alpha) is type(alpha)  # an int alpha stays an int, as PEFT saves it


def test_numpy_values_in_the_nested_lora_are_coerced_to_python():
    lora = TokenTuneConfig(lora=LoraConfig(r=np.int64(4), lora_alpha=np.int32(8), lora_dropout=np.float32(0.5))).lora
    assert (type(lora.r), type(lora.lora_alpha), type(lora.lora_dropout)) == (int, int, float)


def test_a_bad_field_in_a_saved_nested_lora_is_refused_at_load(tmp_path):
    TokenTuneConfig(token_ratio=0.5, lora=LoraConfig(r=4, target_modules=["q_proj"])).save_pretrained(str(tmp_path))
    record = tmp_path / "peft_slim_config.json"
    values = json.loads(record.read_text())
    values["lora"]["r"] = "4"
    record.write_text(json.dumps(values))
    message = r"TokenTuneConfig\.lora\.r must be an int >= 1, got '4'"
    with pytest.raises(ValueError, match=message):
        peft_slim.load_config(str(tmp_path))
    with pytest.raises(ValueError, match=message):
        TokenTuneConfig.from_pretrained(str(tmp_path))


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
        SlimFitConfig(freeze_ratio=freeze, tokentune=selection, activation_compression=compression, lora=LORA),
    ):
        folder = str(tmp_path_factory.mktemp("config"))
        config.save_pretrained(folder)
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a config this version saved loads without a word
            loaded = peft_slim.load_config(folder)  # with LoRA: from peft_slim_config.json beside the LoRA config
            plain = PeftConfig.from_pretrained(folder)
        assert type(loaded) is type(config)
        assert loaded.to_dict() == config.to_dict()
        assert type(plain) is LoraConfig


# ---------------------------------------------------------------------------------------------- atomic saves


def test_a_failed_config_save_leaves_the_existing_file_untouched(tmp_path):
    TokenTuneConfig(token_ratio=0.5, lora=LORA).save_pretrained(str(tmp_path))
    before = {name: (tmp_path / name).read_bytes() for name in ("adapter_config.json", RECORD_NAME)}
    broken = TokenTuneConfig(token_ratio=0.5, lora=LORA)
    broken.revision = object()  # not JSON-serialisable: the save must fail before touching the disk
    with pytest.raises(TypeError):
        broken.save_pretrained(str(tmp_path))
    assert {name: (tmp_path / name).read_bytes() for name in before} == before
    assert sorted(os.listdir(tmp_path)) == sorted(before)  # no temporary file left behind


# ---------------------------------------------------------------------------------------------- saved files

SAVED = os.path.join(os.path.dirname(__file__), "data", "saved_configs")


def _recorded_configs() -> dict:
    import sys

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tools"))
    try:
        from record_saved_configs import configs
    finally:
        sys.path.pop(0)
    return configs()


@pytest.mark.parametrize("name", ["tokentune", "slimfit"])
def test_adapter_config_json_is_byte_identical_to_the_recorded_one(name, tmp_path):
    """The recorded files come from the code before configs became plain dataclasses (tools/record_saved_configs.py)."""
    from tiny_models import build

    model = get_peft_model(build("llama"), _recorded_configs()[name])
    model.save_pretrained(str(tmp_path))
    recorded = os.path.join(SAVED, name, "adapter_config.json")
    assert (tmp_path / "adapter_config.json").read_bytes() == open(recorded, "rb").read()


@pytest.mark.parametrize("name", ["tokentune", "slimfit"])
def test_a_folder_saved_by_the_earlier_code_loads_as_the_same_config(name):
    """The earlier sidecar repeats the LoRA settings: they are ignored, the LoRA is adapter_config.json's."""
    config = _recorded_configs()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = peft_slim.load_config(os.path.join(SAVED, name))
    assert type(loaded) is type(config)
    for spec in dataclasses.fields(config):
        if spec.name not in ("lora", "inference_mode", "peft_slim_version"):
            assert getattr(loaded, spec.name) == getattr(config, spec.name), spec.name
    for key in ("r", "lora_alpha", "target_modules", "task_type"):
        assert getattr(loaded.lora, key) == getattr(config.lora, key), key
