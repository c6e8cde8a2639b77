"""`import peft_slim` makes TokenTune and SlimFit first-class PEFT types, idempotently, and the config round-trips.
(Which class each loader gives for a saved adapter: tests/saving/test_save_load_export.py.)"""

from __future__ import annotations

import copy
import importlib
import json
import os
import subprocess
import sys
import textwrap

import peft
import peft.mapping
import pytest
from helpers.tiny_models import build, make_batch
from peft import LoraConfig, PeftConfig, get_peft_model
from peft.utils.peft_types import PeftType

import peft_slim
import peft_slim.registry
from peft_slim import SlimFitConfig, SlimFitModel, TokenTuneConfig, TokenTuneModel

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the helpers package is
REPO = os.path.dirname(HERE)


def _mapping_snapshot() -> dict:
    return {
        "config": dict(peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING),
        "tuner": dict(peft.mapping.PEFT_TYPE_TO_TUNER_MAPPING),
        "prefix": dict(peft.mapping.PEFT_TYPE_TO_PREFIX_MAPPING),
        "mixed": dict(peft.mapping.PEFT_TYPE_TO_MIXED_MODEL_MAPPING),
        "members": list(PeftType._member_names_),
        "value_map": dict(PeftType._value2member_map_),
    }


# ---------------------------------------------------------------------------------------------- registration


@pytest.mark.parametrize(
    ("name", "config_cls", "model_cls"),
    [("TOKENTUNE", TokenTuneConfig, TokenTuneModel), ("SLIMFIT", SlimFitConfig, SlimFitModel)],
)
def test_each_method_is_a_peft_type_and_registered(name, config_cls, model_cls):
    member = getattr(PeftType, name)
    assert isinstance(member, PeftType)
    assert isinstance(member, str)
    assert member.value == name and member.name == name
    assert member == name
    # Every lookup path of the enum finds the same member.
    assert PeftType(name) is member
    assert PeftType[name] is member
    assert member in list(PeftType)
    assert name in PeftType.__members__
    assert PeftType._member_names_.count(name) == 1
    # Existing members are untouched.
    assert PeftType("LORA") is PeftType.LORA
    # Registered through PEFT's own mappings.
    assert peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[member] is config_cls
    assert peft.mapping.PEFT_TYPE_TO_TUNER_MAPPING[member] is model_cls
    assert peft.mapping.PEFT_TYPE_TO_PREFIX_MAPPING[member] == model_cls.prefix == "lora_"  # LoRA's model class
    # PEFT looks configs up by the JSON string, which must hit the same entry.
    assert peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[name] is config_cls
    assert config_cls().peft_type is member
    # The public API of the package.
    assert getattr(peft_slim, config_cls.__name__) is config_cls
    assert callable(peft_slim.save_pretrained)
    # get_peft_model routes the type to our tuner through PEFT's mappings.
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    assert type(get_peft_model(build("llama"), config_cls(lora=lora)).base_model) is model_cls


def test_import_twice_reload_and_reregister_are_harmless():
    before = _mapping_snapshot()
    member = PeftType.TOKENTUNE

    again = importlib.import_module("peft_slim")
    assert again is peft_slim
    reloaded = importlib.reload(peft_slim.registry)
    assert reloaded.register_method("tokentune", TokenTuneConfig, TokenTuneModel) is member
    assert reloaded.add_peft_type("TOKENTUNE") is member
    # The already-imported tokentune subpackage re-running its registration (same classes) is also a no-op.
    importlib.reload(importlib.import_module("peft_slim.tokentune"))
    assert peft_slim.registry.register_method("tokentune", TokenTuneConfig, TokenTuneModel) is member

    after = _mapping_snapshot()
    assert after["members"] == before["members"]
    assert after["value_map"] == before["value_map"]
    assert PeftType.TOKENTUNE is member
    for key in ("config", "tuner", "prefix", "mixed"):
        assert after[key].keys() == before[key].keys(), key
        for peft_type, value in before[key].items():
            assert after[key][peft_type] is value, (key, peft_type)
    assert peft.mapping.PEFT_TYPE_TO_CONFIG_MAPPING[member] is TokenTuneConfig

    # TokenTune still works end to end after all that.
    model = get_peft_model(build("llama"), TokenTuneConfig(token_ratio=0.5, seed=0, lora=LoraConfig(r=2)))
    assert isinstance(model.base_model, TokenTuneModel)
    model.train()
    model(**make_batch("llama")).loss.backward()
    assert model.base_model.last_token_mask is not None


def test_plain_peft_register_of_the_same_name_still_rejected():
    """The idempotence guard is ours; PEFT's own double registration keeps raising (so the guard matters)."""
    from peft.utils import register_peft_method

    with pytest.raises(KeyError):
        register_peft_method(name="tokentune", config_cls=TokenTuneConfig, model_cls=TokenTuneModel)


_LATE_IMPORT_CHILD = textwrap.dedent(
    """
    import copy, importlib, json, os, sys
    sys.path.insert(0, {tests!r})
    import torch
    import peft
    from peft import LoraConfig, PeftConfig, PeftModel, get_peft_model
    from peft.utils.peft_types import PeftType

    out = {{}}
    tmp = {tmp!r}
    out["slim_loaded_early"] = "peft_slim" in sys.modules
    out["tokentune_before"] = "TOKENTUNE" in PeftType.__members__
    # PEFT loads and saves configs before peft_slim exists.
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM")
    lora.save_pretrained(os.path.join(tmp, "plain_lora"))
    loaded = PeftConfig.from_pretrained(os.path.join(tmp, "plain_lora"))
    out["lora_loaded_before"] = type(loaded).__name__
    from helpers.tiny_models import build, make_batch
    vanilla = get_peft_model(build("llama"), copy.deepcopy(lora))
    vanilla.eval()
    batch = make_batch("llama")
    with torch.no_grad():
        logits_before = vanilla(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    # A TokenTune adapter written by the parent is unknown until peft_slim is imported.
    try:
        PeftConfig.from_pretrained(os.path.join(tmp, "tokentune_adapter"))
        out["unknown_before"] = False
    except Exception:
        out["unknown_before"] = True
    members_before = list(PeftType._member_names_)

    import peft_slim
    import peft_slim  # noqa: F811  (twice)
    importlib.reload(peft_slim.registry)
    peft_slim.registry.register_method("tokentune", peft_slim.TokenTuneConfig, peft_slim.TokenTuneModel)
    importlib.reload(peft_slim.tokentune)
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING, PEFT_TYPE_TO_TUNER_MAPPING

    out["added_members"] = [m for m in PeftType._member_names_ if m not in members_before]
    out["config_cls"] = PEFT_TYPE_TO_CONFIG_MAPPING[PeftType.TOKENTUNE] is peft_slim.TokenTuneConfig
    out["tuner_cls"] = PEFT_TYPE_TO_TUNER_MAPPING[PeftType.TOKENTUNE] is peft_slim.TokenTuneModel
    # The earlier LoRA model and configs are unaffected.
    with torch.no_grad():
        logits_after = vanilla(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    out["vanilla_unchanged"] = torch.equal(logits_before, logits_after)
    relo = PeftConfig.from_pretrained(os.path.join(tmp, "plain_lora"))
    out["lora_reload_equal"] = relo.to_dict() == loaded.to_dict() and type(relo) is LoraConfig
    # TokenTune works: config from disk, a training step, a model from disk.
    tt = PeftConfig.from_pretrained(os.path.join(tmp, "tokentune_adapter"))
    out["tokentune_config_cls"] = type(tt).__name__
    out["tokentune_config"] = tt.to_dict()
    model = get_peft_model(build("llama"), peft_slim.TokenTuneConfig(token_ratio=0.5, seed=0, lora=LoraConfig(r=2)))
    model.train()
    loss = model(**batch).loss
    loss.backward()
    out["train_loss_finite"] = bool(torch.isfinite(loss))
    out["lora_grads"] = sum(
        int(p.grad is not None and bool(p.grad.abs().sum() > 0))
        for n, p in model.named_parameters() if "lora_B" in n
    )
    base = build("llama", seed=0)
    loaded_model = PeftModel.from_pretrained(base, os.path.join(tmp, "tokentune_adapter"))
    out["loaded_tuner"] = type(loaded_model.base_model).__name__
    print("RESULT=" + json.dumps(out))
    """
)


def test_import_after_peft_loaded_configs_in_fresh_process(tmp_path):
    adapter_dir = tmp_path / "tokentune_adapter"
    # An adapter_config.json of PEFT type TOKENTUNE (a saved adapter's is plain LoRA, which PEFT always knows; the
    # whole TokenTune config, its LoRA included, takes its place).
    lora = LoraConfig(r=2, target_modules=["q_proj"])
    config = TokenTuneConfig(num_tokens=3, seed=7, task_type="CAUSAL_LM", lora=lora)
    model = get_peft_model(build("llama"), copy.deepcopy(config))
    model.save_pretrained(adapter_dir)
    whole = peft_slim.load_config(str(adapter_dir)).to_dict()
    os.remove(adapter_dir / "peft_slim_config.json")
    (adapter_dir / "adapter_config.json").write_text(json.dumps(whole))
    expected = PeftConfig.from_pretrained(adapter_dir).to_dict()

    script = _LATE_IMPORT_CHILD.format(tests=HERE, tmp=str(tmp_path))
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd=REPO, timeout=240, check=False
    )
    assert result.returncode == 0, result.stderr[-4000:]
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    out = json.loads(line.removeprefix("RESULT="))

    assert out["slim_loaded_early"] is False
    assert out["tokentune_before"] is False
    assert out["lora_loaded_before"] == "LoraConfig"
    assert out["unknown_before"] is True
    assert sorted(out["added_members"]) == ["SLIMFIT", "TOKENTUNE"]
    assert out["config_cls"] and out["tuner_cls"]
    assert out["vanilla_unchanged"] is True
    assert out["lora_reload_equal"] is True
    assert out["tokentune_config_cls"] == "TokenTuneConfig"
    assert out["tokentune_config"] == json.loads(json.dumps(expected))
    assert out["train_loss_finite"] is True
    assert out["lora_grads"] > 0
    assert out["loaded_tuner"] == "TokenTuneModel"


# ---------------------------------------------------------------------------------------------- config round trip

_CONFIGS = {
    "defaults": lambda: TokenTuneConfig(lora=LoraConfig(target_modules=["q_proj"])),
    "lora_causal": lambda: TokenTuneConfig(
        token_ratio=0.2,
        seed=11,
        task_type="CAUSAL_LM",
        lora=LoraConfig(r=4, lora_alpha=16, target_modules={"v_proj", "q_proj", "down_proj"}, lora_dropout=0.05),
    ),
    "lora_seq_cls": lambda: TokenTuneConfig(
        num_tokens=5,
        selection="answer",
        task_type="SEQ_CLS",
        modules_to_save=["classifier"],
        lora=LoraConfig(
            r=8,
            target_modules={"query", "value"},
            modules_to_save={"pooler"},
            layers_to_transform=[0],
            rank_pattern={"query": 2},
            task_type="SEQ_CLS",
        ),
    ),
}


@pytest.mark.parametrize("name", sorted(_CONFIGS))
def test_config_round_trip(tmp_path, name):
    config = _CONFIGS[name]()
    config.save_pretrained(tmp_path)
    # adapter_config.json is the plain LoraConfig and the method's own fields are in peft_slim_config.json.
    record_name = "peft_slim_config.json"
    with open(tmp_path / record_name) as handle:
        raw = json.load(handle)  # valid JSON
    assert raw["peft_type"] == "TOKENTUNE"
    assert raw["token_ratio"] == config.token_ratio and raw["num_tokens"] == config.num_tokens
    assert raw["selection"] == config.selection and raw["seed"] == config.seed
    assert "lora" not in raw and "task_type" not in raw  # written once, in adapter_config.json

    via_peft = PeftConfig.from_pretrained(tmp_path)
    direct = TokenTuneConfig.from_pretrained(tmp_path)
    explicit = peft_slim.load_config(str(tmp_path))
    assert type(via_peft) is LoraConfig  # what vanilla PEFT reads: the nested LoRA, with the owner's fields
    assert via_peft.r == config.lora.r and via_peft.task_type == config.task_type
    assert set(via_peft.target_modules) == set(config.lora.target_modules)
    via_peft = explicit
    for loaded in (via_peft, direct, explicit):
        assert type(loaded) is TokenTuneConfig
        assert loaded.peft_type is PeftType.TOKENTUNE
        assert loaded.method_dict() == config.method_dict() == raw
        assert isinstance(loaded.lora, LoraConfig)
        assert set(loaded.lora.target_modules) == set(config.lora.target_modules)
        # the same adapter_config.json when saved again
        assert loaded.lora_export_config().to_dict() == config.lora_export_config().to_dict()
    # Saving the loaded config again writes the same file.
    direct.save_pretrained(tmp_path / "again")
    with open(tmp_path / "again" / record_name) as handle:
        assert json.load(handle) == raw
