"""The package's own refusals, fix first, where PyTorch or PEFT would fail late or train the wrong thing:

* training an adapter loaded for inference (``peft_slim.from_pretrained`` or, given the method's config, PEFT's
  ``PeftModel.from_pretrained``, without ``is_trainable=True``) is refused at its first training forward, naming
  ``is_trainable=True``, not in backward by PyTorch; eval-mode and no-grad forwards and ``generate`` run;
* a nested LoRA's ``target_modules`` list with a name that matches no module while others match is refused, naming
  it and the closest module names; plain PEFT LoRA is left as PEFT has it.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from helpers.tiny_models import build, make_batch
from peft import LoraConfig, PeftModel, get_peft_model

import peft_slim
from peft_slim import SlimFitConfig, TokenTuneConfig

METHODS = {
    "tokentune": lambda lora: TokenTuneConfig(token_ratio=0.5, lora=lora),
    "slimfit": lambda lora: SlimFitConfig(freeze_ratio=0.5, lora=lora),
}


def _load_for_inference(loader: str, folder):
    """``peft_slim.from_pretrained``; or PEFT's own loader given the method's whole config as ``adapter_config.json``
    (a saved adapter's is plain LoRA, which PEFT loads as LoRA without peft_slim)."""
    if loader == "peft_slim":
        return peft_slim.from_pretrained(build("llama"), folder)
    whole = peft_slim.load_config(folder).to_dict()  # the method's fields and its LoRA, as one PEFT config
    os.remove(folder / "peft_slim_config.json")
    (folder / "adapter_config.json").write_text(json.dumps(whole))
    return PeftModel.from_pretrained(build("llama"), folder)


@pytest.mark.parametrize("loader", ["peft_slim", "peft"])
@pytest.mark.parametrize("method", METHODS)
def test_training_an_adapter_loaded_for_inference_is_refused_with_the_fix_first(method, loader, tmp_path):
    lora = LoraConfig(r=2, target_modules=["q_proj", "v_proj"])
    get_peft_model(build("llama"), METHODS[method](lora)).save_pretrained(tmp_path)
    model = _load_for_inference(loader, tmp_path)  # is_trainable=False
    assert type(model.base_model).__name__ != "LoraModel"
    batch = make_batch("llama")
    model.eval()
    with torch.no_grad():
        expected = model(**batch).logits
    assert torch.equal(model(**batch).logits, expected)  # eval mode with grad enabled: inference, allowed
    model.train()
    with pytest.raises(ValueError, match=r"^To train adapter 'default', load it with is_trainable=True") as refused:
        model(**batch)
    assert str(refused.value).count(". ") <= 1  # at most two sentences
    with torch.no_grad():  # no grad, even in train mode: inference
        assert torch.equal(model(**batch).logits, expected)
    generated = model.generate(input_ids=batch["input_ids"][:1, :4], max_new_tokens=2, do_sample=False)
    assert generated.shape == (1, 6)


@pytest.mark.parametrize("method", METHODS)
def test_a_misspelt_target_module_beside_matching_ones_is_refused_naming_the_closest(method):
    model = build("llama")
    before = {name for name, _ in model.named_modules()}
    config = METHODS[method](LoraConfig(r=2, target_modules=["q_proj", "v_prj"]))
    with pytest.raises(ValueError, match=r"^Correct or remove 'v_prj' in lora.target_modules") as refused:
        get_peft_model(model, config)
    assert "(the closest module names: 'v_proj'" in str(refused.value)
    assert str(refused.value).count(". ") <= 1
    assert {name for name, _ in model.named_modules()} == before  # refused before any LoRA layer went in
    get_peft_model(model, METHODS[method](LoraConfig(r=2, target_modules=["q_proj", "v_proj"])))


def test_target_modules_that_peft_checks_are_left_to_peft():
    """A regex string is PEFT's to match; plain PEFT LoRA keeps PEFT's behaviour (only the matching names train)."""
    get_peft_model(
        build("llama"), TokenTuneConfig(token_ratio=0.5, lora=LoraConfig(r=2, target_modules=r".*\.q_proj"))
    )
    plain = get_peft_model(build("llama"), LoraConfig(r=2, target_modules=["q_proj", "v_prj"]))
    assert any("q_proj.lora_A" in name for name, _ in plain.named_parameters())
    with pytest.raises(ValueError, match="v_prj|q_prj|target modules"):  # none matching: PEFT's own error
        get_peft_model(
            build("llama"), TokenTuneConfig(token_ratio=0.5, lora=LoraConfig(r=2, target_modules=["q_prj", "v_prj"]))
        )
