"""PEFT's adapter API on peft_slim's types, as it works for LoRA, each checked against a definition:

* several adapters on one model (add / set / delete / load a second one): training them in turns equals training each
  alone on its own model (weights, token selections, SlimFit schedule); each loaded adapter computes what it computes
  loaded alone; after ``delete_adapter`` the model is bit-identical to one that never had it and trains like it;
  TRL's reference adapter ('ref', a copy of 'default') leaves the training of 'default' unchanged;
* what cannot be exact is refused by name (two active adapters, two biased ones);
* ``low_cpu_mem_usage=True`` loads give the logits and the training of a normal load;
* ``peft.inject_adapter_in_model`` + ``get_peft_model_state_dict`` on a bare model: TokenTune + LoRA works as
  ``get_peft_model`` does; SlimFit (its schedule lives on the tuner) and a config without LoRA are refused.
"""

from __future__ import annotations

import os

import pytest
import torch
from helpers.adapter_cases import METHODS, eval_inputs, eval_logits, method_config, vanilla_loads
from helpers.tiny_models import build, make_batch
from peft import (
    PeftModel,
    get_peft_model,
    get_peft_model_state_dict,
    inject_adapter_in_model,
    set_peft_model_state_dict,
)
from trl.trainer.utils import use_adapter

import peft_slim
from peft_slim import TokenTuneConfig


def _step(model, optimizer, seed: int, between=None) -> torch.Tensor | None:
    """One training step (``between()`` runs between its forward and its backward); returns the token selection it
    used (None without)."""
    model.train()
    loss = model(**make_batch("llama", seed=seed)).loss
    if between is not None:
        between()
    loss.backward()
    tuner = model.base_model
    if hasattr(tuner, "slimfit_attach"):
        tuner.slimfit_attach(optimizer)  # (again for an attached one: nothing)
    optimizer.step()
    optimizer.zero_grad()
    if hasattr(tuner, "slimfit_step"):
        tuner.slimfit_step()
    mask = tuner.last_token_mask
    return None if mask is None else mask.clone()


def _optimizer(model, adapter_name: str):
    params = [p for n, p in model.named_parameters() if f".{adapter_name}." in n and "lora_" in n]
    return torch.optim.AdamW(params, lr=1e-2)


def _lora_weights(model, adapter_name: str) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items() if f".{adapter_name}." in k and "lora_" in k}


def _schedule(model):
    tuner = model.base_model
    return tuner.slimfit_history() if hasattr(tuner, "slimfit_history") else None


def _alone(name: str, adapter_name: str, seed: int, init_seed: int):
    base = build("llama")
    torch.manual_seed(init_seed)  # LoRA's initialisation draws
    return get_peft_model(base, method_config(name, seed), adapter_name=adapter_name)


def _two(name: str):
    """'default' (selection/schedule seed 0) and 'b' (seed 5), each LoRA initialised from its own seed."""
    base = build("llama")
    torch.manual_seed(1)
    model = get_peft_model(base, method_config(name, 0))
    torch.manual_seed(2)
    model.add_adapter("b", method_config(name, 5))
    return model


# ---------------------------------------------------------------------------------------------- several adapters


@pytest.mark.parametrize("name", METHODS)
def test_two_adapters_trained_in_turns_equal_each_trained_alone(name):
    model = _two(name)
    assert model.active_adapters == ["default"]
    assert not any(p.requires_grad for n, p in model.named_parameters() if ".b." in n)  # frozen, as PEFT's LoRA
    a, b = _alone(name, "default", 0, 1), _alone(name, "b", 5, 2)
    optimizers = {"default": _optimizer(model, "default"), "b": _optimizer(model, "b")}
    alone_optimizers = {"default": _optimizer(a, "default"), "b": _optimizer(b, "b")}
    for step in range(3):
        for adapter_name, alone, seed in (("default", a, step), ("b", b, 10 + step)):
            model.set_adapter(adapter_name)
            together = _step(model, optimizers[adapter_name], seed)
            by_itself = _step(alone, alone_optimizers[adapter_name], seed)
            assert (together is None) == (by_itself is None)
            if together is not None:
                assert torch.equal(together, by_itself)  # each adapter draws from its own selection generator
            assert _schedule(model) == _schedule(alone)
    for adapter_name, alone in (("default", a), ("b", b)):
        ours, theirs = _lora_weights(model, adapter_name), _lora_weights(alone, adapter_name)
        assert ours.keys() == theirs.keys() and ours
        assert all(torch.equal(ours[k], theirs[k]) for k in ours), adapter_name
        model.set_adapter(adapter_name)
        assert torch.equal(eval_logits(model), eval_logits(alone))


@pytest.fixture(scope="module")
def two_saved(tmp_path_factory):
    """For each method: adapters 'default' and 'b' trained on one model, saved by save_pretrained (b in b/)."""
    root = tmp_path_factory.mktemp("adapters")
    out = {}
    for name in METHODS:
        model = _two(name)
        optimizers = {"default": _optimizer(model, "default"), "b": _optimizer(model, "b")}
        for step in range(2):
            for adapter_name in ("default", "b"):
                model.set_adapter(adapter_name)
                _step(model, optimizers[adapter_name], 20 + step)
        model.set_adapter("default")
        model.save_pretrained(root / name)
        out[name] = {"folder": root / name, "logits": {}}
        for adapter_name in ("default", "b"):
            model.set_adapter(adapter_name)
            out[name]["logits"][adapter_name] = eval_logits(model)
    return out


@pytest.mark.parametrize("name", METHODS)
def test_each_loaded_adapter_computes_what_it_computes_loaded_alone(two_saved, name):
    folder = two_saved[name]["folder"]
    assert sorted(os.listdir(folder / "b")) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "peft_slim_config.json",
    ]
    model = peft_slim.from_pretrained(build("llama"), folder)
    result = peft_slim.load_adapter(model, folder / "b", "b")
    # PEFT's report keeps the missing keys with LoRA's prefix that contain the adapter's name, "b" of "base_model"
    # too (as for a LoRA adapter named "b"): none of adapter b's own is missing.
    assert not [key for key in result.missing_keys if ".b." in key] and result.unexpected_keys == []
    assert type(model.peft_config["b"]) is type(model.peft_config["default"])
    alone = {
        "default": peft_slim.from_pretrained(build("llama"), folder),
        "b": peft_slim.from_pretrained(build("llama"), folder / "b"),
    }
    for adapter_name in ("default", "b", "default"):
        model.set_adapter(adapter_name)
        expected = two_saved[name]["logits"][adapter_name]
        assert torch.equal(eval_logits(alone[adapter_name]), expected)
        assert torch.equal(eval_logits(model), expected)
    assert not torch.equal(two_saved[name]["logits"]["default"], two_saved[name]["logits"]["b"])
    # PEFT's own load_adapter reads the LoRA config and refuses it beside a TokenTune / SlimFit adapter.
    with pytest.raises(ValueError, match="Cannot combine adapters with different peft types"):
        model.load_adapter(folder / "b", "other")
    assert "other" not in model.peft_config


def test_vanilla_peft_loads_both_saved_adapters_without_peft_slim(two_saved, tmp_path):
    folders = {}
    for name in METHODS:
        folders[f"{name}/default"] = str(two_saved[name]["folder"])
        folders[f"{name}/b"] = str(two_saved[name]["folder"] / "b")
    report = vanilla_loads(folders, tmp_path)
    assert report.pop("imported") is False
    for key, folder in folders.items():
        name, adapter_name = key.split("/")
        assert report[key] == {"config": "LoraConfig", "tuner": "LoraModel", "warnings": []}
        assert torch.equal(torch.load(folder + ".vanilla.pt"), two_saved[name]["logits"][adapter_name])


def test_a_trainable_second_adapter_continues_training_as_loaded_alone(two_saved):
    folder = two_saved["full_stack"]["folder"]
    model = peft_slim.from_pretrained(build("llama"), folder, is_trainable=True)
    peft_slim.load_adapter(model, folder / "b", "b", is_trainable=True)
    model.set_adapter("b")
    alone = peft_slim.from_pretrained(build("llama"), folder / "b", is_trainable=True, adapter_name="b")
    ours, theirs = _optimizer(model, "b"), _optimizer(alone, "b")
    for step in range(2):
        assert torch.equal(_step(model, ours, 40 + step), _step(alone, theirs, 40 + step))
        assert _schedule(model) == _schedule(alone)
    assert torch.equal(eval_logits(model), eval_logits(alone))


def _hooks(module: torch.nn.Module) -> list[int]:
    return [len(m._forward_hooks) + len(m._forward_pre_hooks) for m in module.modules()]


@pytest.mark.parametrize("name", ["tokentune_lora", "full_stack"])
@pytest.mark.parametrize("active", ["default", "b"])
def test_after_delete_adapter_the_model_is_one_that_never_had_it(name, active):
    model = _two(name)
    model.set_adapter("b")
    _step(model, _optimizer(model, "b"), 30)  # b trains (and draws selections) before it goes
    model.set_adapter(active)
    if active == "b":
        with pytest.warns(UserWarning, match="Adapter b was active which is now deleted"):  # PEFT's
            model.delete_adapter("b")
    else:
        model.delete_adapter("b")
    assert model.active_adapters == ["default"] and list(model.peft_config) == ["default"]
    never = _alone(name, "default", 0, 1)
    ours, theirs = model.state_dict(), never.state_dict()
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert {n for n, p in model.named_parameters() if p.requires_grad} == {
        n for n, p in never.named_parameters() if p.requires_grad
    }
    assert _hooks(model) == _hooks(never)
    optimizers = (_optimizer(model, "default"), _optimizer(never, "default"))
    for step in range(2):
        masks = [_step(m, o, step) for m, o in zip((model, never), optimizers)]
        assert torch.equal(masks[0], masks[1])
        assert _schedule(model) == _schedule(never)
    assert torch.equal(eval_logits(model), eval_logits(never))


@pytest.mark.parametrize("name", METHODS)
def test_trl_reference_adapter_leaves_the_training_of_default_unchanged(name):
    """TRL's DPO/GRPO/KTO/RLOO trainers add 'ref' with the default adapter's config and a copy of its weights, and
    compute the reference outputs under ``use_adapter(model, 'ref')``, between the policy's forward and backward:
    with gradient checkpointing the backward recomputes the forward, which must see the same frozen units."""
    model, without = _alone(name, "default", 0, 1), _alone(name, "default", 0, 1)
    for m in (model, without):
        m.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.add_adapter("ref", model.peft_config["default"])
    for param_name, param in model.named_parameters():
        if ".default." in param_name:
            model.get_parameter(param_name.replace(".default.", ".ref.")).data.copy_(param.data)
    initial = eval_logits(model)
    optimizers = [torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for m in (model, without)]

    def reference():
        with use_adapter(model, "ref"), torch.no_grad():
            assert torch.equal(model(**eval_inputs()).logits, initial)

    for step in range(3):
        masks = [_step(model, optimizers[0], step, reference), _step(without, optimizers[1], step)]
        assert (masks[0] is None and masks[1] is None) or torch.equal(masks[0], masks[1])
        assert _schedule(model) == _schedule(without)
    ours, theirs = _lora_weights(model, "default"), _lora_weights(without, "default")
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    assert not torch.equal(eval_logits(model), initial)


def test_the_prefix_of_a_lora_stacked_adapter_marks_its_parameters():
    """PEFT's `prefix` is how PEFT's checks and TRL (its vLLM weight sync skips `model.prefix in name`) tell adapter
    parameters from base ones: for a LoRA-stacked adapter exactly the LoRA weights."""
    model = _two("full_stack")
    marked = {n for n, _ in model.named_parameters() if model.prefix in n}
    assert marked and marked == {n for n, _ in model.named_parameters() if ".lora_A." in n or ".lora_B." in n}
    assert type(model.base_model).prefix == "lora_"  # LoRA's model class, registered with its prefix


def test_a_batch_mixing_adapters_computes_each_row_with_its_adapter():
    """LoRA's own model class runs PEFT's mixed-batch inference (`adapter_names`, one per row, "__base__" for none)."""
    base = build("llama")
    model = get_peft_model(base, method_config("tokentune_lora", 0, init_lora_weights=False))
    model.add_adapter("b", method_config("tokentune_lora", 5, init_lora_weights=False))
    model.eval()
    inputs = eval_inputs()
    rows = ["default", "b", "__base__"][: inputs["input_ids"].shape[0]]
    with torch.no_grad():
        mixed = model(**inputs, adapter_names=rows).logits
        for row, adapter_name in enumerate(rows):
            if adapter_name == "__base__":
                with model.disable_adapter():
                    alone = model(**inputs).logits
            else:
                model.set_adapter(adapter_name)
                alone = model(**inputs).logits
            torch.testing.assert_close(mixed[row], alone[row])
    assert not torch.allclose(mixed[0], mixed[1])


# ---------------------------------------------------------------------------------------------- refused by name


def test_two_active_adapters_and_two_biased_adapters_are_refused():
    model = _two("full_stack")
    with pytest.raises(ValueError, match=r"set_adapter\(\['default', 'b'\]\): a peft_slim model runs one adapter"):
        model.base_model.set_adapter(["default", "b"])
    assert model.active_adapters == ["default"]
    biased = get_peft_model(build("llama"), method_config("tokentune_lora", bias="lora_only"))
    with pytest.raises(ValueError, match=r"supports only 1 adapter with bias"):
        biased.add_adapter("second", method_config("tokentune_lora", bias="all"))


@pytest.mark.parametrize("name", ["tokentune_lora", "full_stack"])
def test_a_failed_add_adapter_leaves_the_model_as_it_was(name):
    model, never = _alone(name, "default", 0, 1), _alone(name, "default", 0, 1)
    with pytest.raises(ValueError, match="not found in the base model"):
        model.add_adapter("bad", method_config(name, target_modules=["no_such_module"]))
    assert list(model.peft_config) == ["default"] and model.active_adapters == ["default"]
    assert _hooks(model) == _hooks(never)
    optimizers = (_optimizer(model, "default"), _optimizer(never, "default"))
    masks = [_step(m, o, 0) for m, o in zip((model, never), optimizers)]
    assert torch.equal(masks[0], masks[1]) and _schedule(model) == _schedule(never)


def test_load_adapter_needs_a_peft_slim_model(two_saved):
    plain = PeftModel.from_pretrained(build("llama"), two_saved["tokentune_lora"]["folder"])
    with pytest.raises(
        ValueError, match=r"expects a PeftModel of a peft_slim method, got PeftModelForCausalLM of Lora"
    ):
        peft_slim.load_adapter(plain, two_saved["tokentune_lora"]["folder"] / "b", "b")


# ---------------------------------------------------------------------------------------------- low_cpu_mem_usage


@pytest.mark.parametrize("name", ["tokentune_lora", "full_stack"])
def test_low_cpu_mem_usage_load_equals_a_normal_load(tmp_path, name):
    config = method_config(name)
    trained = get_peft_model(build("llama"), config)
    optimizer = torch.optim.AdamW([p for p in trained.parameters() if p.requires_grad], lr=1e-2)
    _step(trained, optimizer, 0)
    trained.save_pretrained(tmp_path / "adapter")
    expected = eval_logits(trained)
    loads = {
        low: peft_slim.from_pretrained(build("llama"), tmp_path / "adapter", is_trainable=True, low_cpu_mem_usage=low)
        for low in (False, True)
    }
    for model in loads.values():
        assert torch.equal(eval_logits(model), expected)
    optimizers = {
        low: torch.optim.AdamW([p for p in m.parameters() if p.requires_grad], lr=1e-2) for low, m in loads.items()
    }
    for step in range(2):  # and it trains on exactly as the normal load
        masks = [_step(loads[low], optimizers[low], 50 + step) for low in (False, True)]
        assert (masks[0] is None and masks[1] is None) or torch.equal(masks[0], masks[1])
    assert torch.equal(eval_logits(loads[True]), eval_logits(loads[False]))
    # PEFT's own loader (a plain LoRA adapter to it).
    vanilla = PeftModel.from_pretrained(build("llama"), tmp_path / "adapter", low_cpu_mem_usage=True)
    assert torch.equal(eval_logits(vanilla), expected)


# ---------------------------------------------------------------------------------------------- direct injection


def test_inject_adapter_in_model_with_tokentune_lora_trains_and_saves_as_get_peft_model():
    config = method_config("tokentune_lora")
    base = build("llama")
    torch.manual_seed(3)  # LoRA's initialisation draws, as in _alone
    bare = inject_adapter_in_model(config, base)
    wrapped = _alone("tokentune_lora", "default", 0, 3)
    for model in (bare, wrapped):
        model.train()
        model(**make_batch("llama", seed=1)).loss.backward()
    grads = {n.removeprefix("base_model.model."): p.grad for n, p in wrapped.named_parameters() if p.grad is not None}
    assert grads and {n: p.grad for n, p in bare.named_parameters() if p.grad is not None}.keys() == grads.keys()
    assert all(torch.equal(p.grad, grads[n]) for n, p in bare.named_parameters() if p.grad is not None)
    saved = get_peft_model_state_dict(bare)
    theirs = {k.removeprefix("base_model.model."): v for k, v in get_peft_model_state_dict(wrapped).items()}
    assert saved.keys() == theirs.keys() and all(torch.equal(saved[k], theirs[k]) for k in saved)
    fresh = inject_adapter_in_model(config, build("llama"))
    result = set_peft_model_state_dict(fresh, saved)
    assert result.unexpected_keys == []
    with torch.no_grad():
        assert torch.equal(fresh.eval()(**eval_inputs()).logits, bare.eval()(**eval_inputs()).logits)


def test_inject_adapter_in_model_refuses_what_cannot_work_on_a_bare_model():
    with pytest.raises(ValueError, match=r"does not support \S*SLIMFIT because it uses shared state.*get_peft_model"):
        inject_adapter_in_model(method_config("slimfit_lora"), build("llama"))
    with pytest.raises(ValueError, match=r"lora is None.*peft_slim\.tokentune_"):
        inject_adapter_in_model(TokenTuneConfig(token_ratio=0.5), build("llama"))
