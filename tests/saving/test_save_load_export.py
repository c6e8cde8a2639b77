"""save_pretrained / from_pretrained (fresh processes), the plain LoRA save, merge/unload, is_trainable. (push_to_hub:
tests/saving/test_lora_artifacts.py.)

One module-scoped fixture trains and saves every case once and runs two child processes over all of
them: one that imports peft_slim and loads the adapters (with the method, through peft_slim.from_pretrained,
and with PEFT's own loaders), one that never imports peft_slim and loads what save_pretrained wrote (also with
plain_lora=True) for the LoRA cases with vanilla PEFT, recording every warning. The tests then compare what came back.
"""

from __future__ import annotations

import copy
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from helpers.vanilla_child import IMPORT_BITSANDBYTES
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.tuners_utils import BaseTunerLayer
from peft.utils.other import AuxiliaryTrainingWrapper
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, PreTrainedModel

import peft_slim
from peft_slim import TokenTuneConfig, TokenTuneModel

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the helpers package is
PREFIX = "base_model.model."

# name -> (arch, task_type, modules_to_save)
CASES = {
    "llama_lora": ("llama", "CAUSAL_LM", None),
    "llama_lora_notask": ("llama", None, None),
    "bert_lora": ("bert", "SEQ_CLS", ["classifier"]),
}
AUTO_CLASS = {"llama": AutoModelForCausalLM, "bert": AutoModelForSequenceClassification}


def _lora_config(arch, task_type):
    return LoraConfig(r=4, lora_alpha=8, target_modules=set(LORA_TARGETS[arch]), task_type=task_type)


def _tokentune_config(name):
    arch, task_type, to_save = CASES[name]
    return TokenTuneConfig(
        token_ratio=0.5, seed=0, task_type=task_type, lora=_lora_config(arch, task_type), modules_to_save=to_save
    )


def _inputs(batch):
    return {k: v for k, v in batch.items() if k != "labels"}


def _eval_logits(model, batch):
    model.eval()
    with torch.no_grad():
        return model(**_inputs(batch)).logits


def _train(model, batch, steps=3):
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    assert params
    optimizer = torch.optim.AdamW(params, lr=1e-2)
    for _ in range(steps):
        loss = model(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _trainable_names(model):
    return {n for n, p in model.named_parameters() if p.requires_grad}


# ---------------------------------------------------------------------------------------------- child scripts

_SLIM_CHILD = textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {tests!r})
    import torch
    import peft_slim  # registers TOKENTUNE
    from peft import AutoPeftModelForCausalLM, AutoPeftModelForSequenceClassification, PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    jobs = json.load(open({jobs!r}))
    report = {{}}
    for job in jobs:
        batch = torch.load(job["batch"])
        inputs = {{k: v for k, v in batch.items() if k != "labels"}}
        causal = job["kind"] == "causal"
        base_cls = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
        base = base_cls.from_pretrained(job["base_dir"], attn_implementation="sdpa")
        model = peft_slim.from_pretrained(base, job["adapter_dir"])
        model.eval()
        with torch.no_grad():
            torch.save(model(**inputs).logits, job["out"] + ".peft.pt")
        plain = PeftModel.from_pretrained(base_cls.from_pretrained(job["base_dir"], attn_implementation="sdpa"),
                                          job["adapter_dir"])
        plain.eval()
        with torch.no_grad():
            torch.save(plain(**inputs).logits, job["out"] + ".plain.pt")
        auto_cls = AutoPeftModelForCausalLM if causal else AutoPeftModelForSequenceClassification
        auto = auto_cls.from_pretrained(job["adapter_dir"], attn_implementation="sdpa")
        auto.eval()
        with torch.no_grad():
            torch.save(auto(**inputs).logits, job["out"] + ".auto.pt")
        report[job["name"]] = {{
            "peft_cls": type(model).__name__,
            "tuner_cls": type(model.base_model).__name__,
            "plain_tuner_cls": type(plain.base_model).__name__,
            "auto_cls": type(auto).__name__,
            "auto_tuner_cls": type(auto.base_model).__name__,
            "auto_base_cls": type(auto.get_base_model()).__name__,
            "trainable": sum(p.requires_grad for p in model.parameters()),
        }}
    print("RESULT=" + json.dumps(report))
    """
)

_VANILLA_CHILD = IMPORT_BITSANDBYTES + textwrap.dedent(
    """
    import json, sys, warnings
    import torch
    from peft import AutoPeftModelForCausalLM, PeftConfig, PeftModel
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    jobs = json.load(open({jobs!r}))
    report = {{}}
    for job in jobs:
        batch = torch.load(job["batch"])
        inputs = {{k: v for k, v in batch.items() if k != "labels"}}
        causal = job["kind"] == "causal"
        base_cls = AutoModelForCausalLM if causal else AutoModelForSequenceClassification
        for kind in ("adapter", "export"):  # what save_pretrained wrote, with plain_lora=True
            folder = job[kind + "_dir"]
            base = base_cls.from_pretrained(job["base_dir"], attn_implementation="sdpa")
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                config_cls = type(PeftConfig.from_pretrained(folder)).__name__
                model = PeftModel.from_pretrained(base, folder)
            model.eval()
            with torch.no_grad():
                torch.save(model(**inputs).logits, job["out"] + f".vanilla_{{kind}}.pt")
            entry = {{
                "config_cls": config_cls,
                "peft_type": model.peft_config["default"].peft_type.value,
                "tuner_cls": type(model.base_model).__name__,
                # Not ours: PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing` for every
                # adapter, a LoRA adapter PEFT saved itself included.
                "warnings": [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)],
            }}
            if causal:
                auto = AutoPeftModelForCausalLM.from_pretrained(folder, attn_implementation="sdpa")
                auto.eval()
                with torch.no_grad():
                    torch.save(auto(**inputs).logits, job["out"] + f".vanilla_auto_{{kind}}.pt")
            report[job["name"] + ":" + kind] = entry
    report["__slim_imported__"] = any(m.startswith("peft_slim") for m in sys.modules)
    print("RESULT=" + json.dumps(report))
    """
)


def _run_child(script):
    # cwd is outside the repo so that peft_slim could only come in through an explicit import.
    result = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, cwd="/", timeout=300, check=False
    )
    assert result.returncode == 0, result.stderr[-6000:]
    line = [ln for ln in result.stdout.splitlines() if ln.startswith("RESULT=")][-1]
    return json.loads(line.removeprefix("RESULT="))


# ---------------------------------------------------------------------------------------------- the shared run


class Case:
    """Everything one trained-and-saved adapter needs for the checks."""

    def __init__(self, name, root):
        self.name = name
        self.arch, self.task_type, self.to_save = CASES[name]
        self.dir = os.path.join(root, name)
        self.base_dir = os.path.join(self.dir, "base")
        self.adapter_dir = os.path.join(self.dir, "adapter")
        self.export_dir = os.path.join(self.dir, "export")
        self.out = os.path.join(self.dir, "logits")
        self.batch_path = os.path.join(self.dir, "batch.pt")
        self.batch = make_batch(self.arch, seed=1)

        build(self.arch, seed=0).save_pretrained(self.base_dir)
        # The base is loaded from disk, as the child will: identical weights, name_or_path set.
        base = self.load_base()
        self.initial = {n: p.detach().clone() for n, p in base.named_parameters()}
        self.base_logits = _eval_logits(base, self.batch)
        self.vanilla_base = copy.deepcopy(base)
        self.model = get_peft_model(base, _tokentune_config(name))
        self.trainable_before = _trainable_names(self.model)
        _train(self.model, make_batch(self.arch, seed=2))
        self.logits = _eval_logits(self.model, self.batch)
        self.model.save_pretrained(self.adapter_dir)
        torch.save(self.batch, self.batch_path)
        peft_slim.save_pretrained(self.model, self.export_dir, plain_lora=True)

    def load_base(self):
        return AUTO_CLASS[self.arch].from_pretrained(self.base_dir, attn_implementation="sdpa")

    def job(self):
        return {
            "name": self.name,
            "kind": "causal" if self.arch == "llama" else "seq_cls",
            "base_dir": self.base_dir,
            "adapter_dir": self.adapter_dir,
            "export_dir": self.export_dir,
            "batch": self.batch_path,
            "out": self.out,
        }


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    root = str(tmp_path_factory.mktemp("save_load_export"))
    cases = {name: Case(name, root) for name in CASES}
    jobs_path = os.path.join(root, "jobs.json")
    with open(jobs_path, "w") as handle:
        json.dump([case.job() for case in cases.values()], handle)
    slim = _run_child(_SLIM_CHILD.format(tests=HERE, jobs=jobs_path))
    return {"cases": cases, "slim": slim, "jobs": jobs_path}


@pytest.fixture(scope="module")
def vanilla(run):
    """Loads every exported adapter in a process that never imports peft_slim."""
    return _run_child(_VANILLA_CHILD.format(jobs=run["jobs"]))


# ---------------------------------------------------------------------------------------------- what is saved


def _saved(case):
    """Files, config and tensors of the case's adapter."""
    files = set(os.listdir(case.adapter_dir))
    with open(os.path.join(case.adapter_dir, "adapter_config.json")) as handle:
        config = json.load(handle)
    tensors = load_file(os.path.join(case.adapter_dir, "adapter_model.safetensors"))
    return files, config, tensors


@pytest.mark.parametrize("name", list(CASES))
def test_save_pretrained_writes_config_and_safetensors(run, name):
    case = run["cases"][name]
    files, config, tensors = _saved(case)
    assert {"adapter_config.json", "adapter_model.safetensors"} <= files
    assert "adapter_model.bin" not in files
    assert config["base_model_name_or_path"] == case.base_dir
    assert config["inference_mode"] is True
    assert config["peft_type"] == "LORA"  # a plain LoRA adapter, the method's settings beside it
    with open(os.path.join(case.adapter_dir, "peft_slim_config.json")) as handle:
        record = json.load(handle)
    assert record["peft_type"] == "TOKENTUNE" and record["token_ratio"] == 0.5
    assert "lora" not in record and "base_model_name_or_path" not in record  # in adapter_config.json only
    assert tensors, "saved an empty adapter"
    # The in-memory config is not left in inference mode by saving.
    assert case.model.peft_config["default"].inference_mode is False


@pytest.mark.parametrize("name", list(CASES))
def test_lora_state_dict_keys_match_plain_lora(run, name, tmp_path):
    case = run["cases"][name]
    _, _, tensors = _saved(case)
    vanilla = get_peft_model(copy.deepcopy(case.vanilla_base), _lora_config(case.arch, case.task_type))
    vanilla.save_pretrained(tmp_path)
    vanilla_keys = set(load_file(os.path.join(tmp_path, "adapter_model.safetensors")))
    assert set(tensors) == vanilla_keys
    # adapter_config.json is the one vanilla PEFT writes for the same LoraConfig.
    with open(tmp_path / "adapter_config.json") as handle:
        vanilla_config = json.load(handle)
    _, config, _ = _saved(case)
    as_sets = {
        "target_modules": set(config["target_modules"]),
        "modules_to_save": set(config["modules_to_save"] or []),
    }
    assert config | as_sets == vanilla_config | {
        "target_modules": set(vanilla_config["target_modules"]),
        "modules_to_save": set(vanilla_config["modules_to_save"] or []),
    }
    lora_keys = {k for k in tensors if ".lora_A." in k or ".lora_B." in k}
    extra = set(tensors) - lora_keys
    n_targets = sum(
        1
        for module_name, _ in case.vanilla_base.named_modules()
        if any(module_name.endswith("." + t) for t in LORA_TARGETS[case.arch])
    )
    assert len(lora_keys) == 2 * n_targets
    if case.task_type == "SEQ_CLS":
        assert extra == {PREFIX + "classifier.weight", PREFIX + "classifier.bias"}
    else:
        assert extra == set()
    # The saved values are the trained ones, and training moved LoRA B off its zero init.
    state = case.model.state_dict()
    for key, value in tensors.items():
        if ".lora_" in key:
            module_key = key.replace(".weight", ".default.weight")
        else:
            module_key = key.replace("classifier.", "classifier.modules_to_save.default.")
        assert torch.equal(value, state[module_key]), key
        if ".lora_B." in key:
            assert value.abs().sum() > 0, key
    classifier = {k: v for k, v in tensors.items() if "classifier" in k}
    for key, value in classifier.items():
        assert not torch.equal(value, case.initial[key.removeprefix(PREFIX)]), f"{key} was not trained"


def test_trainable_before_training_matches_saved_set(run):
    """What TokenTune trains is what it saves (lora_A/B + heads)."""
    for case in run["cases"].values():
        _, _, tensors = _saved(case)
        trained = {
            n.removeprefix(PREFIX).replace(".modules_to_save.default", "").replace(".default", "")
            for n in case.trainable_before
        }
        assert trained == {k.removeprefix(PREFIX) for k in tensors}, case.name


# ---------------------------------------------------------------------------------------------- fresh processes


@pytest.mark.parametrize("name", list(CASES))
def test_fresh_process_from_pretrained_gives_identical_logits(run, name):
    case = run["cases"][name]
    report = run["slim"][name]
    assert report["tuner_cls"] == "TokenTuneModel"  # peft_slim.from_pretrained: the method
    assert report["plain_tuner_cls"] == "LoraModel"  # PEFT's own loader
    assert report["trainable"] == 0
    assert torch.equal(torch.load(case.out + ".peft.pt"), case.logits)
    assert torch.equal(torch.load(case.out + ".plain.pt"), case.logits)
    # Training changed the outputs, so the comparison above is not trivially satisfied by the base.
    assert not torch.allclose(case.logits, case.base_logits, atol=1e-4)


@pytest.mark.parametrize("name", list(CASES))
def test_fresh_process_auto_peft_model(run, name):
    case = run["cases"][name]
    report = run["slim"][name]
    causal = case.arch == "llama"
    assert report["auto_cls"] == ("PeftModelForCausalLM" if causal else "PeftModelForSequenceClassification")
    assert report["auto_tuner_cls"] == "LoraModel"
    assert report["auto_base_cls"] == type(case.vanilla_base).__name__
    assert torch.equal(torch.load(case.out + ".auto.pt"), case.logits)


# ---------------------------------------------------------------------------------------------- export


@pytest.mark.parametrize("name", list(CASES))
def test_plain_lora_save_is_a_plain_lora_adapter(run, name, tmp_path):
    case = run["cases"][name]
    with open(os.path.join(case.export_dir, "adapter_config.json")) as handle:
        config = json.load(handle)
    assert config["peft_type"] == "LORA"
    assert "lora" not in config and "token_ratio" not in config
    assert config["base_model_name_or_path"] == case.base_dir
    assert config["task_type"] == case.task_type
    assert set(config["target_modules"]) == set(LORA_TARGETS[case.arch])
    assert config["r"] == 4 and config["lora_alpha"] == 8
    exported = load_file(os.path.join(case.export_dir, "adapter_model.safetensors"))
    _, saved_config, saved = _saved(case)
    assert config == saved_config  # save_pretrained already writes the plain LoRA adapter
    assert not os.path.exists(os.path.join(case.export_dir, "peft_slim_config.json"))
    assert exported.keys() == saved.keys()
    for key in saved:
        assert torch.equal(exported[key], saved[key]), key
    if case.task_type == "SEQ_CLS":
        assert "classifier" in config["modules_to_save"]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("kind", ["adapter", "export"])
def test_saved_and_exported_lora_load_in_vanilla_peft_without_peft_slim_or_a_warning(run, vanilla, name, kind):
    case = run["cases"][name]
    assert vanilla["__slim_imported__"] is False
    entry = vanilla[f"{name}:{kind}"]
    assert entry["config_cls"] == "LoraConfig"
    assert entry["peft_type"] == "LORA"
    assert entry["tuner_cls"] == "LoraModel"
    assert entry["warnings"] == []
    assert torch.equal(torch.load(case.out + f".vanilla_{kind}.pt"), case.logits)
    if case.arch != "bert":
        assert torch.equal(torch.load(case.out + f".vanilla_auto_{kind}.pt"), case.logits)


def test_plain_lora_save_refuses_a_model_without_the_method_and_an_unknown_adapter(run, tmp_path):
    case = run["cases"]["llama_lora"]
    with pytest.raises(ValueError, match="plain_lora=True leaves peft_slim_config.json out"):
        peft_slim.save_pretrained(case.vanilla_base, str(tmp_path / "a"), plain_lora=True)
    with pytest.raises(ValueError, match="nope"):
        peft_slim.save_pretrained(case.model, str(tmp_path / "b"), plain_lora=True, selected_adapters=["nope"])
    assert not os.path.exists(tmp_path / "a") and not os.path.exists(tmp_path / "b")


# ---------------------------------------------------------------------------------------------- merge / unload


def _assert_plain_transformers(model, reference, attn_implementation="sdpa"):
    assert type(model) is type(reference)
    assert isinstance(model, PreTrainedModel)
    assert not isinstance(model, PeftModel)
    for module_name, module in model.named_modules():
        assert not isinstance(module, (BaseTunerLayer, AuxiliaryTrainingWrapper)), module_name
        assert not module._forward_hooks, module_name
        assert not module._forward_pre_hooks, module_name
        assert not module._backward_hooks, module_name
    assert not any(
        "lora_" in n or "modules_to_save" in n or "original_module" in n for n, _ in model.named_parameters()
    )
    assert model.config._attn_implementation == attn_implementation
    assert set(model.state_dict()) == set(reference.state_dict())


@pytest.mark.parametrize("name", ["llama_lora", "bert_lora"])
def test_merge_and_unload_returns_plain_transformers_model(run, name):
    case = run["cases"][name]
    model = peft_slim.from_pretrained(case.load_base(), case.adapter_dir, is_trainable=True)
    model.train()
    model(**make_batch(case.arch, seed=3)).loss.backward()  # a training forward first: hooks and attn swap ran
    peft_logits = _eval_logits(model, case.batch)
    assert torch.equal(peft_logits, case.logits)
    merged = model.merge_and_unload()
    _assert_plain_transformers(merged, case.vanilla_base)
    merged_logits = _eval_logits(merged, case.batch)
    assert torch.allclose(merged_logits, peft_logits, atol=1e-5, rtol=0)
    # A merged model trains as a plain model: no token selection left behind.
    merged.train()
    out = merged(**make_batch(case.arch, seed=3))
    assert out.loss is not None and torch.isfinite(out.loss)


def test_merge_and_unload_restores_eager_attention_after_training_and_errors():
    base = build("llama", attn_implementation="eager")
    reference = copy.deepcopy(base)
    batch = make_batch("llama")
    config = TokenTuneConfig(token_ratio=0.5, seed=0, lora=_lora_config("llama", None))
    model = get_peft_model(base, config)
    model.train()
    model(**batch).loss.backward()
    assert model.base_model.last_token_mask is not None
    # TokenTune's attention (it runs eager outside TokenTune's pass) from the wrap to the merge, whatever raises.
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_eager"
    with pytest.raises(ValueError, match="token_mask"):
        model(**batch, token_mask=torch.zeros(batch["input_ids"].shape, dtype=torch.bool))
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_eager"
    model.eval()
    peft_logits = _eval_logits(model, batch)
    merged = model.merge_and_unload()
    _assert_plain_transformers(merged, reference, attn_implementation="eager")
    assert torch.allclose(_eval_logits(merged, batch), peft_logits, atol=1e-5, rtol=0)


@pytest.mark.parametrize("name", ["llama_lora", "bert_lora"])
def test_unload_gives_the_base_without_lora(run, name):
    case = run["cases"][name]
    model = peft_slim.from_pretrained(case.load_base(), case.adapter_dir)
    assert not torch.equal(_eval_logits(model, case.batch), case.base_logits)
    _, _, saved = _saved(case)
    base = model.unload()
    _assert_plain_transformers(base, case.vanilla_base)
    # unload() gives what vanilla PEFT's unload() gives for the same adapter: LoRA dropped, every base weight as it
    # was; a trained modules_to_save copy (the SEQ_CLS classifier) is kept or the base's own module restored, as the
    # installed PEFT decides (PEFT 0.22 restores it; merge_and_unload() keeps the trained copy).
    vanilla = PeftModel.from_pretrained(case.load_base(), case.adapter_dir).unload()
    vanilla_params = dict(vanilla.named_parameters())
    heads = {k.removeprefix(PREFIX): v for k, v in saved.items() if ".lora_" not in k}
    assert bool(heads) == (case.task_type == "SEQ_CLS")
    assert set(dict(base.named_parameters())) == set(vanilla_params)
    for param_name, value in base.named_parameters():
        assert torch.equal(value, vanilla_params[param_name]), param_name
        choices = [case.initial[param_name]] + ([heads[param_name]] if param_name in heads else [])
        assert any(torch.equal(value, choice) for choice in choices), param_name
    assert torch.equal(_eval_logits(base, case.batch), _eval_logits(vanilla, case.batch))
    # LoRA's effect is gone: the output differs from the adapted model's wherever LoRA changed it.
    assert not torch.allclose(_eval_logits(base, case.batch), case.logits, atol=1e-6)


# ---------------------------------------------------------------------------------------------- is_trainable


@pytest.mark.parametrize("name", list(CASES))
def test_is_trainable_flag(run, name):
    case = run["cases"][name]
    frozen = peft_slim.from_pretrained(case.load_base(), case.adapter_dir, is_trainable=False)
    assert isinstance(frozen.base_model, TokenTuneModel)
    assert _trainable_names(frozen) == set()
    assert frozen.peft_config["default"].inference_mode is True

    trainable = peft_slim.from_pretrained(case.load_base(), case.adapter_dir, is_trainable=True)
    assert trainable.peft_config["default"].inference_mode is False
    names = _trainable_names(trainable)
    assert names == case.trainable_before
    assert names and all(".lora_" in n or ".modules_to_save." in n for n in names)
    assert any(".lora_A." in n for n in names) and any(".lora_B." in n for n in names)
    # It trains: a step moves the trainable weights and the outputs (with TokenTune active).
    before = {n: p.detach().clone() for n, p in trainable.named_parameters() if p.requires_grad}
    _train(trainable, make_batch(case.arch, seed=4), steps=1)
    assert trainable.base_model.last_token_mask is not None
    moved = sum(not torch.equal(p.detach(), before[n]) for n, p in trainable.named_parameters() if n in before)
    assert moved >= 0.5 * len(before)
    assert not torch.equal(_eval_logits(trainable, case.batch), case.logits)
