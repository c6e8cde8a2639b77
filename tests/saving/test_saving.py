"""Saving and loading peft_slim adapters: peft_slim.save_pretrained's atomic saves, missing and unexpected keys, the
nested LoraConfig honoured as vanilla LoRA honours it, the model card, resuming, and the refusal of an earlier
version's adapters without LoRA (full fine-tuning is a transform now). (Plain LoRA files and crash consistency under
SIGKILL: tests/saving/test_lora_artifacts.py.)
"""

from __future__ import annotations

import json
import os
import re
import textwrap
import warnings

import huggingface_hub
import peft
import peft.peft_model
import pytest
import safetensors.torch
import torch
from helpers.adapter_cases import eval_logits, vanilla_loads, without_peft_slim
from helpers.slimfit_cases import slimfit_model
from helpers.slimfit_cases import train as slimfit_train
from helpers.tiny_models import TEXT_SIZES, build, make_batch
from helpers.trainer_cases import selection_trainer
from peft import LoraConfig, PeftModel, get_peft_model
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, LlamaForCausalLM

import peft_slim
import peft_slim.tuner.config
from peft_slim import SlimFitConfig, SlimFitModel, TokenTuneConfig
from peft_slim.tuner.card import CARD_END, CARD_START

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the helpers package is
ROOT = os.path.dirname(HERE)
PREFIX = "base_model.model."
LLAMA_LORA = dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"])

# name -> (architecture, a function building the wrapped model)
MODELS = {
    "tokentune_lora": (
        "llama",
        lambda: get_peft_model(
            build("llama"), TokenTuneConfig(task_type="CAUSAL_LM", lora=LoraConfig(**LLAMA_LORA), seed=0)
        ),
    ),
    "slimfit_lora": ("llama", lambda: slimfit_model("llama", lora=True, freeze_ratio=0.5)),
}


def _train(model, arch: str, steps: int = 2, seed: int = 0) -> None:
    """``steps`` more training steps, with the model's one optimizer (built on the first call)."""
    optimizer = model.__dict__.get("_test_optimizer")
    if isinstance(model.base_model, SlimFitModel):
        model.__dict__["_test_optimizer"] = slimfit_train(model, arch, steps, optimizer=optimizer)
        return
    if optimizer is None:
        optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
        model.__dict__["_test_optimizer"] = optimizer
    model.train()
    for step in range(steps):
        model(**make_batch(arch, seed=seed + step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()


def _trained(name: str, steps: int = 2):
    arch, make = MODELS[name]
    model = make()
    _train(model, arch, steps)
    return model


def _logits(model, arch: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in make_batch(arch, seed=5).items() if k != "labels"}).logits


def _snapshot(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones and sub-folders included) with its bytes."""
    files = {}
    for root, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as handle:
                files[os.path.relpath(path, folder)] = handle.read()
    return files


def _model_key(saved_key: str, adapter_name: str = "default") -> str:
    """The model's key of a saved LoRA key (PEFT puts the adapter name back), or the saved key itself."""
    match = re.fullmatch(r"(.*\.lora_[A-Za-z_]+)\.(weight|bias)", saved_key)
    return f"{match[1]}.{adapter_name}.{match[2]}" if match else saved_key


# ---------------------------------------------------------------------------------------------- 1. atomic saves


def _half_then_fail(path: str, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data[: len(data) // 2])
    raise OSError(28, "No space left on device (simulated, half-way through the file)")


def _fail_weights(monkeypatch) -> None:
    def save_file_half(tensors, filename, metadata=None):
        _half_then_fail(filename, safetensors.torch.save(tensors, metadata=metadata))

    monkeypatch.setattr(peft.peft_model, "safe_save_file", save_file_half)


def _fail_config(monkeypatch) -> None:
    def write_half(path, text):
        _half_then_fail(path, text.encode())

    monkeypatch.setattr(peft_slim.tuner.config, "atomic_write_text", write_half)


def _fail_card(monkeypatch) -> None:
    def save_half(card, filepath):
        _half_then_fail(str(filepath), str(card).encode())

    monkeypatch.setattr(huggingface_hub.ModelCard, "save", save_half)


FAILED_SAVES = [(name, fail, "") for name in MODELS for fail in (_fail_weights, _fail_config, _fail_card)]
FAILED_SAVES += [("tokentune_lora", _fail_weights, "plain_lora"), ("tokentune_lora", _fail_weights, "subfolder")]


@pytest.mark.parametrize(
    ("name", "fail", "how"), FAILED_SAVES, ids=[f"{n}-{f.__name__[6:]}-{h}" for n, f, h in FAILED_SAVES]
)
def test_a_failed_save_leaves_the_adapter_on_disk_byte_identical(name, fail, how, tmp_path, monkeypatch):
    """Also a plain LoRA save, and an adapter not named "default" (saved in its subfolder)."""
    arch, make = MODELS[name]
    if how == "subfolder":
        lora = LoraConfig(**LLAMA_LORA)
        model = get_peft_model(build(arch), TokenTuneConfig(task_type="CAUSAL_LM", lora=lora), adapter_name="mine")
    else:
        model = make()
    _train(model, arch)
    folder, kwargs = ("adapter/mine" if how == "subfolder" else "adapter"), {"plain_lora": how == "plain_lora"}
    peft_slim.save_pretrained(model, tmp_path / "adapter", **kwargs)
    (tmp_path / "adapter" / "tokenizer.json").write_text("{}")  # another file of the folder: kept
    before = _snapshot(tmp_path)
    assert {f"{folder}/adapter_model.safetensors", f"{folder}/adapter_config.json", "adapter/README.md"} <= set(before)
    assert (f"{folder}/peft_slim_config.json" in before) == (how != "plain_lora")
    _train(model, arch, steps=1, seed=7)  # other weights, so that a save would change the files

    with monkeypatch.context() as patch:
        fail(patch)
        with pytest.raises(OSError, match="simulated"):
            peft_slim.save_pretrained(model, tmp_path / "adapter", **kwargs)
    assert _snapshot(tmp_path) == before  # every file byte-identical, and no temporary folder left behind

    peft_slim.save_pretrained(model, tmp_path / "adapter", **kwargs)  # a save that succeeds replaces them only
    after = _snapshot(tmp_path)
    assert set(after) == set(before)
    assert after[f"{folder}/adapter_model.safetensors"] != before[f"{folder}/adapter_model.safetensors"]
    assert after["adapter/tokenizer.json"] == b"{}"


class _Wrapper(torch.nn.Module):
    """Stands in for DDP's wrapper: the model as `.module`, no `save_pretrained`."""

    def __init__(self, module):
        super().__init__()
        self.module = module


def test_distributed_save_in_one_process_writes_what_a_plain_save_writes(tmp_path):
    """`distributed=True` unwraps the model and, without a process group, saves its own state dict; a wrapped model
    saved without it is refused, naming it."""
    model = _trained("slimfit_lora")
    peft_slim.save_pretrained(model, tmp_path / "plain")
    peft_slim.save_pretrained(_Wrapper(model), tmp_path / "distributed", distributed=True)
    assert _snapshot(tmp_path / "distributed") == _snapshot(tmp_path / "plain")
    with pytest.raises(ValueError, match="got _Wrapper: for a model wrapped by DDP or FSDP pass distributed=True"):
        peft_slim.save_pretrained(_Wrapper(model), tmp_path / "refused")
    assert not (tmp_path / "refused").exists()


def test_save_pretrained_refuses_the_pissa_conversion_argument(tmp_path):
    model = _trained("tokentune_lora", steps=1)
    with pytest.raises(ValueError, match="path_initial_model_for_weight_conversion"):
        model.save_pretrained(tmp_path / "a", path_initial_model_for_weight_conversion=str(tmp_path / "init"))
    assert not (tmp_path / "a" / "adapter_model.safetensors").exists()


# ---------------------------------------------------------------------------------------------- 2. missing keys


@pytest.mark.parametrize("name", list(MODELS))
def test_missing_and_unexpected_keys_are_reported_as_peft_reports_them_for_lora(name, tmp_path):
    model = _trained(name)
    model.save_pretrained(tmp_path)
    path = tmp_path / "adapter_model.safetensors"

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # an intact adapter loads without a word
        warnings.filterwarnings("ignore", category=FutureWarning)
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        intact = peft_slim.from_pretrained(build(MODELS[name][0]), tmp_path)
        result = intact.load_adapter(tmp_path, "default")
    assert result.missing_keys == [] and result.unexpected_keys == []

    tensors = load_file(path)
    removed = sorted(key for key in tensors if ".modules_to_save." not in key)[0]
    del tensors[removed]
    tensors[PREFIX + "bogus.weight"] = torch.zeros(2)
    save_file(tensors, path, metadata={"format": "pt"})

    expected = f"Found missing adapter keys while loading the checkpoint: {[_model_key(removed)]}."  # PEFT's words
    with pytest.warns(UserWarning) as record:
        loaded = peft_slim.from_pretrained(build(MODELS[name][0]), tmp_path)
    messages = [str(w.message) for w in record]
    assert [m for m in messages if m.startswith("Found missing adapter keys")] == [expected]
    assert any("unexpected keys" in m and PREFIX + "bogus.weight" in m for m in messages), messages

    with pytest.warns(UserWarning) as record:  # a Trainer's resume_from_checkpoint loads this way
        result = loaded.load_adapter(tmp_path, "default")
    messages = [str(w.message) for w in record]
    assert expected in messages
    assert any("unexpected keys" in m for m in messages)
    assert result.unexpected_keys == [PREFIX + "bogus.weight"]


# ---------------------------------------------------------------------------------------------- 3. nested LoraConfig

# variant -> (architecture, task type, LoraConfig keywords): each as vanilla PEFT LoRA honours it
LORA_VARIANTS = {
    "bias_all": ("bert", "SEQ_CLS", dict(bias="all")),
    "bias_lora_only": ("bert", "SEQ_CLS", dict(bias="lora_only")),
    "bias_all_gpt2": ("gpt2", "CAUSAL_LM", dict(bias="all", target_modules=["c_attn"], fan_in_fan_out=True)),
    "modules_to_save": ("bert", "SEQ_CLS", dict(modules_to_save=["pooler"])),
    "modules_to_save_llama": ("llama", "CAUSAL_LM", dict(modules_to_save=["lm_head"])),
    "dora": ("llama", "CAUSAL_LM", dict(use_dora=True)),
    "embedding_target": ("llama", "CAUSAL_LM", dict(target_modules=["embed_tokens", "q_proj"])),
    "trainable_tokens": ("llama", "CAUSAL_LM", dict(trainable_token_indices=[3, 5])),
}
TARGETS = {"llama": ["q_proj", "v_proj"], "bert": ["query", "value"]}


def _lora(variant: str) -> LoraConfig:
    arch, _, fields = LORA_VARIANTS[variant]
    fields = json.loads(json.dumps(fields))  # fresh lists: PEFT extends modules_to_save in place
    if "target_modules" not in fields:
        fields["target_modules"] = TARGETS[arch]
    return LoraConfig(r=4, lora_alpha=8, **fields)


def _ours(variant: str, method: str):
    arch, task, _ = LORA_VARIANTS[variant]
    if method == "tokentune":
        config = TokenTuneConfig(task_type=task, lora=_lora(variant), token_ratio=0.5, seed=0)
    else:
        config = SlimFitConfig(task_type=task, lora=_lora(variant), freeze_ratio=0.5, activation_compression=None)
    return get_peft_model(build(arch), config)


def _vanilla(variant: str):
    arch, task, _ = LORA_VARIANTS[variant]
    lora = _lora(variant)
    lora.task_type = task
    return get_peft_model(build(arch), lora)


def _trainable(model) -> set[str]:
    return {name for name, param in model.named_parameters() if param.requires_grad}


def _saved_shapes(model, folder) -> dict[str, tuple]:
    model.save_pretrained(folder)
    return {
        key: tuple(value.shape) for key, value in load_file(os.path.join(folder, "adapter_model.safetensors")).items()
    }


@pytest.mark.filterwarnings("ignore:Setting `save_embedding_layers`")
@pytest.mark.parametrize("method", ["tokentune", "slimfit"])
@pytest.mark.parametrize("variant", list(LORA_VARIANTS))
def test_nested_lora_trains_and_saves_what_vanilla_lora_does(variant, method, tmp_path):
    ours, vanilla = _ours(variant, method), _vanilla(variant)
    assert _trainable(ours) == _trainable(vanilla)
    assert _saved_shapes(ours, tmp_path / "ours") == _saved_shapes(vanilla, tmp_path / "vanilla")


@pytest.mark.parametrize(
    "variant", ["bias_all", "bias_lora_only", "bias_all_gpt2", "modules_to_save", "modules_to_save_llama", "dora"]
)
def test_plain_lora_save_and_save_pretrained_round_trip_the_lora_fields(variant, tmp_path):
    arch, _, fields = LORA_VARIANTS[variant]
    model = _ours(variant, "tokentune")
    _train(model, arch, steps=2)
    expected = _logits(model, arch)
    assert not torch.equal(expected, _logits(_vanilla(variant), arch))  # training changed what the fields train

    peft_slim.save_pretrained(model, tmp_path / "export", plain_lora=True)
    exported = PeftModel.from_pretrained(build(arch), tmp_path / "export")
    config = exported.peft_config["default"]
    assert type(config) is LoraConfig
    assert config.bias == fields.get("bias", "none") and config.use_dora == fields.get("use_dora", False)
    assert set(fields.get("modules_to_save", [])) <= set(config.modules_to_save or [])
    assert torch.equal(_logits(exported, arch), expected)

    model.save_pretrained(tmp_path / "adapter")
    assert torch.equal(_logits(PeftModel.from_pretrained(build(arch), tmp_path / "adapter"), arch), expected)


def test_export_with_trained_biases_loads_in_a_process_without_peft_slim(tmp_path):
    model = _ours("bias_all_gpt2", "tokentune")
    _train(model, "gpt2", steps=2)
    peft_slim.save_pretrained(model, tmp_path / "export", plain_lora=True)
    report = vanilla_loads({"export": str(tmp_path / "export")}, tmp_path, arch="gpt2")
    assert report == {"export": {"config": "LoraConfig", "tuner": "LoraModel", "warnings": []}, "imported": False}
    assert torch.equal(torch.load(tmp_path / "export.vanilla.pt"), eval_logits(model, "gpt2"))


def test_a_bias_missing_from_a_lora_adapter_with_trained_biases_is_reported(tmp_path):
    model = _ours("bias_all", "tokentune")
    model.save_pretrained(tmp_path)
    tensors = load_file(tmp_path / "adapter_model.safetensors")
    removed = PREFIX + "bert.encoder.layer.0.output.dense.bias"
    del tensors[removed]
    save_file(tensors, tmp_path / "adapter_model.safetensors", metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=re.escape(f"checkpoint: {[removed]}")):
        loaded = peft_slim.from_pretrained(build("bert"), tmp_path)
    with pytest.warns(UserWarning, match=re.escape(f"checkpoint: {[removed]}")):
        loaded.load_adapter(tmp_path, "default")


def _lora_with(**fields) -> LoraConfig:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # LoraConfig's own warnings about these fields
        return LoraConfig(r=4, target_modules=["q_proj", "v_proj"], **fields)


@pytest.mark.parametrize("cls", [TokenTuneConfig, SlimFitConfig])
@pytest.mark.parametrize(
    "field, value",
    [
        ("arrow_config", peft.ArrowConfig()),
        ("init_lora_weights", "eva"),
    ],
)
def test_lora_fields_a_peft_slim_model_cannot_honour_are_refused(cls, field, value):
    with pytest.raises(ValueError, match=rf"{cls.__name__}\.lora\.{field}=.* is not supported: "):
        cls(lora=_lora_with(**{field: value}))


@pytest.mark.parametrize("field", ["monteclora_config", "kasa_config"])
def test_loras_own_model_class_runs_loras_variants_and_their_loss_terms(field):
    """The tuner is LoRA's model class, and PEFT's LoRA code reads the LoRA settings through the method's config:
    MonteCLoRA's and KaSA's layers and loss terms (LoraModel._get_monteclora_loss / _get_kasa_loss) work."""
    value = peft.MontecloraConfig() if field == "monteclora_config" else peft.KasaConfig()
    model = get_peft_model(build("llama"), SlimFitConfig(task_type="CAUSAL_LM", lora=_lora_with(**{field: value})))
    model.train()
    term = (
        model.base_model._get_monteclora_loss() if field == "monteclora_config" else model.base_model._get_kasa_loss()
    )
    (model(**make_batch("llama")).loss + term).backward()
    assert isinstance(model.base_model, peft.LoraModel) and torch.is_tensor(term) and term.requires_grad
    with pytest.raises(ValueError, match="add_weighted_adapter is not supported"):
        model.add_weighted_adapter(["default"], [1.0], "merged")


def test_alora_acts_from_its_invocation_tokens_on_and_token_selection_refuses_it_and_monteclora():
    lora = _lora_with(alora_invocation_tokens=[5, 6], init_lora_weights=False)
    model = get_peft_model(build("llama"), SlimFitConfig(task_type="CAUSAL_LM", lora=lora)).eval()
    input_ids = torch.tensor([[9, 10, 11, 12, 5, 6, 13, 14]])
    with torch.no_grad():
        adapted = model(input_ids=input_ids).logits
        with model.disable_adapter():
            plain = model(input_ids=input_ids).logits
    torch.testing.assert_close(adapted[0, :4], plain[0, :4])  # before the invocation tokens: the base model
    assert not torch.allclose(adapted[0, 5:], plain[0, 5:])
    for field, bad in (
        ("alora_invocation_tokens", lora),
        ("monteclora_config", _lora_with(monteclora_config=peft.MontecloraConfig())),
    ):
        with pytest.raises(ValueError, match=rf"TokenTuneConfig\.lora\.{field} is not supported with token selection"):
            get_peft_model(build("llama"), TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5, lora=bad))


def test_nested_modules_to_save_joins_the_configs_own_and_a_string_is_one_name():
    config = TokenTuneConfig(lora=LoraConfig(r=4, target_modules=["q_proj"], modules_to_save="pooler"))
    assert config.modules_to_save == ["pooler"]
    config = SlimFitConfig(
        modules_to_save=["classifier"],
        lora=LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["classifier", "pooler"]),
    )
    assert config.modules_to_save == ["classifier", "pooler"]
    assert config.bias == "none" and config.target_modules == {"q_proj"}
    without = SlimFitConfig()  # a config for the full fine-tuning transform
    assert without.bias == "none" and without.target_modules is None
    assert not hasattr(without, "runtime_config")


# ---------------------------------------------------------------------------------------------- 4. the model card

_CARD_CHILD = """
import json, re, sys
from huggingface_hub import ModelCard
card = ModelCard.load({card!r})
block = re.search(r"```python\\n(.*?)```", card.text, re.DOTALL)[1]
try:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {adapter!r})
    error = None
except Exception as exc:
    error = repr(exc)
print("RESULT=" + json.dumps({{
    "tags": card.data.tags, "library_name": card.data.library_name, "text": card.text, "block": block,
    "error": error, "imported": any(m.startswith("peft_slim") for m in sys.modules),
}}))
"""


def test_the_model_card_names_peft_slim_and_the_import_and_its_snippet_loads(tmp_path):
    base_dir, adapter_dir = str(tmp_path / "base"), str(tmp_path / "adapter")
    build("llama").save_pretrained(base_dir)
    model = get_peft_model(
        AutoModelForCausalLM.from_pretrained(base_dir),
        TokenTuneConfig(task_type="CAUSAL_LM", lora=LoraConfig(**LLAMA_LORA), seed=0),
    )
    _train(model, "llama", steps=1)
    peft_slim.save_pretrained(model, adapter_dir)
    torch.save(_logits(model, "llama"), tmp_path / "expected.pt")

    # A fresh process that never imports peft_slim reads the card and loads the adapter (a plain LoRA adapter).
    card = os.path.join(adapter_dir, "README.md")
    report = without_peft_slim(_CARD_CHILD.format(card=card, base=base_dir, adapter=adapter_dir))
    assert report["imported"] is False
    assert report["error"] is None
    assert {"lora", "peft_slim", "tokentune"} <= set(report["tags"]) and report["library_name"] == "peft"
    assert "plain PEFT **LoRA** adapter" in report["text"] and "peft_slim_config.json" in report["text"]
    assert "peft_slim.from_pretrained(base, " in report["text"]
    block = report["block"]
    assert block.startswith("from peft import PeftModel") and "peft_slim" not in block
    assert f'LlamaForCausalLM.from_pretrained("{base_dir}")' in block

    # The card's snippet, with this folder for the adapter, loads it in another fresh process without peft_slim.
    snippet = block.replace("<the folder or Hub id of this adapter>", adapter_dir)
    snippet += textwrap.dedent(f"""
        import sys, torch
        sys.path.insert(0, {HERE!r})
        from helpers.tiny_models import make_batch
        model.eval()
        batch = make_batch("llama", seed=5)
        with torch.no_grad():
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        equal = torch.equal(logits, torch.load({str(tmp_path / "expected.pt")!r}))
        print("RESULT=" + str([equal, any(m.startswith("peft_slim") for m in sys.modules)]).lower())
    """)
    assert without_peft_slim(snippet) == [True, False]  # the trained logits, and peft_slim never imported


def test_the_card_keeps_the_users_text_and_holds_one_section(tmp_path):
    model = _trained("slimfit_lora", steps=1)
    (tmp_path / "README.md").write_text("---\nlicense: mit\n---\n# My adapter\n\nMy own notes.\n")
    peft_slim.save_pretrained(model, tmp_path)
    peft_slim.save_pretrained(model, tmp_path)
    card = huggingface_hub.ModelCard.load(tmp_path / "README.md")
    assert card.data.license == "mit" and "My own notes." in card.text
    assert card.text.count(CARD_START) == 1 and card.text.count(CARD_END) == 1
    assert card.text.index("# My adapter") < card.text.index(CARD_START)
    assert "trained with peft_slim's **SlimFit**" in card.text
    assert {"peft_slim", "slimfit"} <= set(card.data.tags)


def test_push_to_hub_of_vanilla_lora_is_transformers_own(offline_hub):
    model = get_peft_model(build("llama"), LoraConfig(task_type="CAUSAL_LM", **LLAMA_LORA))
    model.push_to_hub("someone/tiny-lora", private=True)
    assert "peft_slim" not in offline_hub["uploaded"]["README.md"].decode()


# ---------------------------------------------------------------------------------------------- 5. resuming


def test_resume_from_checkpoint_loads_without_missing_keys(tmp_path):
    """Trainer's resume_from_checkpoint calls model.load_adapter(checkpoint, 'default', is_trainable=True) on a model
    that already has the adapter (its own config, not the checkpoint's): no missing keys, as for LoRA; a LoRA
    adapter applies to any base model of its shapes, as with PEFT; a tensor missing from it is reported."""
    make = MODELS["tokentune_lora"][1]
    selection_trainer(tmp_path / "run", make(), max_steps=2, save_strategy="steps", save_steps=2).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        warnings.filterwarnings("ignore", category=FutureWarning)
        result = make().load_adapter(checkpoint, "default", is_trainable=True)
        assert result.missing_keys == [] and result.unexpected_keys == []
        selection_trainer(tmp_path / "run", make(), max_steps=3).train(resume_from_checkpoint=checkpoint)
    other = get_peft_model(build("llama", seed=3), make().peft_config["default"])
    selection_trainer(tmp_path / "run", other, max_steps=3).train(resume_from_checkpoint=checkpoint)
    tensors = load_file(os.path.join(checkpoint, "adapter_model.safetensors"))
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, os.path.join(checkpoint, "adapter_model.safetensors"), metadata={"format": "pt"})
    with pytest.warns(UserWarning, match=rf"Found missing adapter keys.*{re.escape(_model_key(dropped))}"):
        make().load_adapter(checkpoint, "default", is_trainable=True)


def _standalone_folder(folder, config) -> None:
    """What an earlier peft_slim saved for a method without `lora` (base tensors trained in place): its whole config as
    ``adapter_config.json`` (PEFT type TOKENTUNE or SLIMFIT) and the tensors training changed."""
    folder.mkdir(exist_ok=True)
    (folder / "adapter_config.json").write_text(json.dumps(config.to_dict()))
    weights = {PREFIX + "model.norm.weight": torch.ones(TEXT_SIZES["hidden_size"])}
    save_file(weights, folder / "adapter_model.safetensors", metadata={"format": "pt"})


@pytest.mark.parametrize(
    ("config", "transform"),
    [(TokenTuneConfig(task_type="CAUSAL_LM", token_ratio=0.5), "tokentune_"), (SlimFitConfig(), "slimfit_")],
    ids=["tokentune", "slimfit"],
)
def test_an_old_standalone_adapter_is_refused_naming_the_transform(config, transform, tmp_path):
    _standalone_folder(tmp_path, config)
    model = build("llama")
    given = {name: p.detach().clone() for name, p in model.named_parameters()}
    expected = rf"without LoRA .*peft_slim\.{transform}\(model, config\).*model\.save_pretrained"
    for load in (PeftModel.from_pretrained, peft_slim.from_pretrained):
        with pytest.raises(ValueError, match=expected):
            load(model, str(tmp_path))
    with pytest.raises(ValueError, match=expected):
        peft_slim.load_config(str(tmp_path))
    assert type(model) is LlamaForCausalLM and not hasattr(model, "peft_config")
    assert all(torch.equal(p, given[name]) for name, p in model.named_parameters())


@pytest.mark.parametrize("config", [TokenTuneConfig(token_ratio=0.5), SlimFitConfig()], ids=["tokentune", "slimfit"])
def test_a_config_without_lora_is_refused_by_get_peft_model_naming_the_transform(config):
    model = build("llama")
    transform = "slimfit_" if isinstance(config, SlimFitConfig) else "tokentune_"
    with pytest.raises(ValueError, match=rf"\.lora is None: set lora=peft\.LoraConfig.*peft_slim\.{transform}"):
        get_peft_model(model, config)
    assert not any(module._forward_pre_hooks or module._forward_hooks for module in model.modules())
    assert all(p.requires_grad for p in model.parameters())
