"""One training context: what a training forward turns on is turned off again however the forward ends.

A KeyboardInterrupt (a notebook's stop button) or a SystemExit inside a training forward is not an ``Exception``:
torch's ``always_call`` forward hooks do not run for it. Afterwards the next step must be the step it would have been,
another model's gradients untouched, and the model's config as it was.
"""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build, make_batch
from peft import LoraConfig, get_peft_model

from peft_slim import ActivationCompressionConfig, SlimFitConfig, TokenSelectionConfig, TokenTuneConfig
from peft_slim.compat import active_saved_tensors_pack, get_attn_implementation
from peft_slim.training_context import TrainingContext

COMPRESSION = ActivationCompressionConfig(bits=8, min_numel=0)


def _lora() -> LoraConfig:
    return LoraConfig(r=4, target_modules=LORA_TARGETS["llama"], init_lora_weights=False)


def _slimfit(**fields) -> SlimFitConfig:
    return SlimFitConfig(task_type="CAUSAL_LM", lora=_lora(), freeze_ratio=0.5, seed=0, **fields)


CASES = {
    "tokentune": lambda: TokenTuneConfig(task_type="CAUSAL_LM", lora=_lora(), token_ratio=0.5, seed=0),
    "tokentune+compression": lambda: TokenTuneConfig(
        task_type="CAUSAL_LM", lora=_lora(), token_ratio=0.5, seed=0, activation_compression=COMPRESSION
    ),
    "slimfit": lambda: _slimfit(activation_compression=None),
    "slimfit+compression": lambda: _slimfit(activation_compression=COMPRESSION),
    "slimfit+tokentune+compression": lambda: _slimfit(
        activation_compression=COMPRESSION, token_selection=TokenSelectionConfig(token_ratio=0.5, seed=0)
    ),
}


def _batch() -> dict:
    batch = make_batch("llama")
    generator = torch.Generator().manual_seed(1)
    mask = (torch.rand(batch["input_ids"].shape, generator=generator) < 0.5) & batch["attention_mask"].bool()
    mask[:, -1] = True
    return batch, mask


def _step(model, case: str) -> tuple[float, dict]:
    """One training step's loss and gradients (a fixed token mask where tokens are selected: no draw)."""
    batch, mask = _batch()
    model.train()
    extra = {"token_mask": mask} if "tokentune" in case else {}
    loss = model(**batch, **extra).loss
    loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.item(), grads


def _plain_grads(model) -> dict:
    model.train()
    model(**make_batch("llama", seed=3)).loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return grads


class _Interrupt:
    """Raise ``error`` from inside the model's next training forward: from a forward hook of a block, or from the LM
    head (a module the forward calls after the blocks, while the selected-token state is live)."""

    def __init__(self, model, where: str, error: type[BaseException]):
        inner = model.get_base_model()
        self.module = inner.model.layers[1] if where == "block" else inner.lm_head
        self.error = error

    def __enter__(self):
        def hook(module, args, output):
            raise self.error("stop")

        self.handle = self.module.register_forward_hook(hook)
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _same(actual: dict, expected: dict) -> None:
    assert actual.keys() == expected.keys()
    different = [name for name in expected if not torch.equal(actual[name], expected[name])]
    assert not different, f"{len(different)} gradient(s) differ, e.g. {different[:3]}"


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
@pytest.mark.parametrize("where", ["block", "head"])
@pytest.mark.parametrize("case", list(CASES))
def test_an_interrupted_training_forward_leaves_nothing_behind(case, where, error):
    plain = build("llama", seed=5)
    plain_before = _plain_grads(plain)
    untouched = get_peft_model(build("llama"), CASES[case]())
    model = get_peft_model(build("llama"), CASES[case]())
    implementation = get_attn_implementation(model.config)

    batch, mask = _batch()
    extra = {"token_mask": mask} if "tokentune" in case else {}
    model.train()
    with _Interrupt(model, where, error), pytest.raises(error):
        model(**batch, **extra)
    model.zero_grad(set_to_none=True)

    assert get_attn_implementation(model.config) == implementation
    assert active_saved_tensors_pack() is None
    _same(_plain_grads(plain), plain_before)
    expected_loss, expected = _step(untouched, case)
    loss, grads = _step(model, case)
    assert loss == expected_loss
    _same(grads, expected)


@pytest.mark.parametrize("error", [KeyboardInterrupt, SystemExit])
def test_compression_alone_is_left_on_an_interrupt(error):
    """The context on a plain model (no tuner), as a transform would put it: left on any BaseException."""
    plain = build("llama", seed=5)
    plain_before = _plain_grads(plain)
    model = build("llama")
    context = TrainingContext(model, COMPRESSION)
    model.train()

    def hook(module, args, output):
        raise error("stop")

    handle = model.model.layers[1].register_forward_hook(hook)
    with pytest.raises(error):
        model(**make_batch("llama"))
    handle.remove()

    assert active_saved_tensors_pack() is None
    _same(_plain_grads(plain), plain_before)
    model(**make_batch("llama")).loss.backward()  # not refused for "another saved-tensor hook"
    assert context.last_stats.compressed > 0
    context.detach()


def test_a_call_below_the_tuner_is_guarded_too():
    """The transformers model called directly (TRL and others may): its forward runs inside the guard."""
    plain = build("llama", seed=5)
    plain_before = _plain_grads(plain)
    model = get_peft_model(build("llama"), CASES["tokentune+compression"]())
    untouched = get_peft_model(build("llama"), CASES["tokentune+compression"]())
    batch, mask = _batch()
    model.train()
    with _Interrupt(model, "block", KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        model.get_base_model()(**batch, token_mask=mask)
    model.zero_grad(set_to_none=True)
    assert active_saved_tensors_pack() is None
    _same(_plain_grads(plain), plain_before)
    expected_loss, expected = _step(untouched, "tokentune")
    loss, grads = _step(model, "tokentune")
    assert loss == expected_loss
    _same(grads, expected)


def test_an_entry_left_behind_by_another_hook_is_left_at_the_next_forward():
    """An interrupt in another pre-hook of the model, after the context's (outside every guard): the next forward
    starts clean."""
    model = get_peft_model(build("llama"), CASES["tokentune+compression"]())
    untouched = get_peft_model(build("llama"), CASES["tokentune+compression"]())
    batch, mask = _batch()
    inner = model.get_base_model()

    def interrupt(module, args):
        raise KeyboardInterrupt

    handle = inner.register_forward_pre_hook(interrupt)
    model.train()
    with pytest.raises(KeyboardInterrupt):
        inner(**batch, token_mask=mask)
    handle.remove()
    model.zero_grad(set_to_none=True)
    loss, grads = _step(model, "tokentune")  # first: until then the thread's saved-tensor hooks are its
    expected_loss, expected = _step(untouched, "tokentune")
    assert loss == expected_loss
    _same(grads, expected)


def test_the_guarded_forward_keeps_the_signature_and_goes_on_detach():
    base = build("llama")
    signature = inspect.signature(base.forward)
    model = get_peft_model(base, CASES["tokentune"]())
    assert inspect.signature(base.forward) == signature  # what Trainer and generate() read
    assert "forward" in base.__dict__
    copy.deepcopy(model).train()(**_batch()[0]).loss.backward()  # a copy's wrapper is the copy's
    model.unload()
    assert "forward" not in base.__dict__


# ---------------------------------------------------------------------------------------------- the attention name


@pytest.fixture
def attention_writes(monkeypatch) -> list:
    """Every value written to any model config's ``_attn_implementation`` while the test runs."""
    from transformers import PretrainedConfig

    writes = []
    name = PretrainedConfig._attn_implementation

    def record(config, value):
        writes.append(value)
        name.fset(config, value)

    monkeypatch.setattr(PretrainedConfig, "_attn_implementation", property(name.fget, record))
    return writes


def test_the_attention_name_is_written_at_attach_and_detach_only(attention_writes):
    base = build("llama")
    attention_writes.clear()  # (building it wrote the name too)
    model = get_peft_model(base, CASES["tokentune+compression"]())
    assert attention_writes == ["peft_slim_tokentune_sdpa"]
    batch, mask = _batch()
    _step(model, "tokentune")
    model.eval()
    with torch.no_grad():
        model(**batch)
        model.generate(input_ids=batch["input_ids"][:1], max_new_tokens=3, do_sample=False)
    model.train()
    with pytest.raises(ValueError, match="token_mask"):
        model(**batch, token_mask=torch.zeros_like(mask))
    with _Interrupt(model, "block", KeyboardInterrupt), pytest.raises(KeyboardInterrupt):
        model(**batch, token_mask=mask)
    _step(model, "tokentune")
    assert attention_writes == ["peft_slim_tokentune_sdpa"]
    assert model.unload() is base
    assert attention_writes == ["peft_slim_tokentune_sdpa", "sdpa"]
    assert get_attn_implementation(base.config) == "sdpa"


def test_a_saved_config_json_names_no_attention_implementation(tmp_path):
    model = get_peft_model(build("llama"), CASES["tokentune"]())
    _step(model, "tokentune")
    model.get_base_model().save_pretrained(tmp_path / "base")
    model.save_pretrained(tmp_path / "adapter")
    for path in tmp_path.rglob("*.json"):
        text = path.read_text()
        assert "peft_slim_tokentune" not in text and "attn_implementation" not in text, path


def test_a_config_shared_by_two_attached_models_keeps_the_name_until_both_detach():
    first = build("llama")
    second = type(first)(first.config)  # built from the same config object
    assert second.config is first.config
    first_model = get_peft_model(first, CASES["tokentune"]())
    second_model = get_peft_model(second, CASES["tokentune"]())
    first_model.unload()
    assert get_attn_implementation(first.config) == "peft_slim_tokentune_sdpa"
    _step(second_model, "tokentune")  # still TokenTune's forward: not refused for a changed name
    second_model.unload()
    assert get_attn_implementation(first.config) == "sdpa"
