"""Forward inputs TokenTune training must handle or refuse: labels of another shape, a KV cache (use_cache=True)."""

from __future__ import annotations

import re
import warnings

import pytest
import torch
import transformers
from helpers.tiny_models import build, make_batch
from helpers.tokentune_cases import (
    assert_grads_match,
    reference_loss_and_grads,
    tokentune_config,
    tokentune_model,
    training_step,
)
from peft import get_peft_model
from transformers import DynamicCache

CACHE_WARNING = r"`use_cache=True`.* incompatible with TokenTune training.*setting `use_cache=False`"

# ---------------------------------------------------------------------------------------------- labels


def _token_classifier():
    torch.manual_seed(0)
    base = transformers.BertForTokenClassification._from_config(build("bert").config, attn_implementation="sdpa")
    return get_peft_model(base, tokentune_config("bert", task_type="TOKEN_CLS"))


def _labels_like(labels: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    return labels.flatten()[: int(torch.Size(shape).numel())].reshape(shape).clone()


@pytest.mark.parametrize(
    "shape_of",
    [lambda b, n: (b, n - 1), lambda b, n: (b, n + 1), lambda b, n: (b,), lambda b, n: (b * n,), lambda b, n: (1, n)],
    ids=["shorter", "longer", "per_row", "flat", "one_row"],
)
@pytest.mark.parametrize("head", ["causal_lm", "token_classification"])
def test_labels_of_another_shape_are_refused(head, shape_of):
    model = tokentune_model("llama") if head == "causal_lm" else _token_classifier()
    batch = make_batch("llama" if head == "causal_lm" else "bert")
    batch.pop("labels")
    sequence = tuple(batch["input_ids"].shape)
    long_labels = torch.randint(0, 3, (sequence[0] * (sequence[1] + 1),))
    labels = _labels_like(long_labels, shape_of(*sequence))
    model.train()
    expected = rf"labels has shape {re.escape(str(tuple(labels.shape)))}.*input_ids.*{re.escape(str(sequence))}"
    with pytest.raises(ValueError, match=expected):
        model(**batch, labels=labels)
    assert all(p.grad is None for p in model.parameters())
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_sdpa"
    model(**batch, labels=_labels_like(long_labels, sequence)).loss.backward()  # the right shape trains


def test_labels_of_another_shape_with_inputs_embeds():
    model = tokentune_model("llama")
    batch = make_batch("llama")
    embeds = model.get_base_model().get_input_embeddings()(batch["input_ids"]).detach()
    model.train()
    with pytest.raises(ValueError, match=r"labels has shape \(3, 9\).*inputs_embeds.*\(3, 10\)"):
        model(inputs_embeds=embeds, attention_mask=batch["attention_mask"], labels=batch["labels"][:, 1:])


def test_pre_shifted_labels_are_refused():
    """A causal LM's loss reads `shift_labels` in place of `labels` shifted; the selected-token loss read `labels`
    and ignored them, silently."""
    model = tokentune_model("llama")
    batch = make_batch("llama")
    shift_labels = torch.full_like(batch["labels"], -100)
    shift_labels[:, :5] = batch["labels"][:, 1:6]
    model.train()
    with pytest.raises(ValueError, match="pre-shifted `shift_labels`.*pass `labels` of shape"):
        model(**batch, shift_labels=shift_labels)
    assert model.get_base_model().config._attn_implementation == "peft_slim_tokentune_sdpa"


@pytest.mark.parametrize("implementation", ["sdpa", "eager"])
def test_a_mask_with_one_row_for_every_query_position(implementation):
    """A 4D mask [batch, 1, 1, seq] (one row that every query position shares, the extended mask of BERT-style
    code) holds for any subset of queries: it once failed with an index error in the selected pass."""
    model = tokentune_model("bert", implementation)
    batch = make_batch("bert")
    padding = batch["attention_mask"].bool()[:, None, None, :]
    batch["attention_mask"] = torch.zeros(padding.shape).masked_fill(~padding, torch.finfo(torch.float32).min)
    output, mask, grads = training_step(model, batch)
    ref_loss, ref_grads = reference_loss_and_grads(model, "bert", batch, mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)


# ---------------------------------------------------------------------------------------------- KV cache


def _cache_kwargs(kind: str, model) -> dict:
    if kind == "use_cache":
        return {"use_cache": True}
    return {"use_cache": True, kind: DynamicCache(config=model.get_base_model().config)}


@pytest.mark.parametrize("checkpointing", [False, True], ids=["plain", "checkpointing"])
@pytest.mark.parametrize("kind", ["use_cache", "cache", "past_key_values"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_use_cache_in_training_warns_once_and_gives_the_same_gradient(arch, kind, checkpointing):
    batch = make_batch(arch)
    plain = tokentune_model(arch)
    output, mask, grads = training_step(plain, batch)

    model = tokentune_model(arch)
    if checkpointing:
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    model.zero_grad(set_to_none=True)
    with pytest.warns(UserWarning, match=CACHE_WARNING):
        cached = model(**batch, **_cache_kwargs(kind, model))
    cached.loss.backward()
    cached_grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    assert torch.equal(model.base_model.last_token_mask, mask)  # same seed, same draw
    torch.testing.assert_close(cached.loss, output.loss)
    assert_grads_match(cached_grads, grads, rtol=1e-6)
    _, ref_grads = reference_loss_and_grads(model, arch, batch, mask)
    assert_grads_match(cached_grads, ref_grads)

    with warnings.catch_warnings():  # once per model
        warnings.simplefilter("error")
        model(**batch, **_cache_kwargs(kind, model)).loss.backward()


def test_decoder_classifier_with_use_cache():
    from helpers.tokentune_cases import build_decoder_classifier

    model = get_peft_model(build_decoder_classifier("llama"), tokentune_config("llama", task_type="SEQ_CLS"))
    batch = make_batch("llama")
    batch["labels"] = torch.tensor([0, 1, 2])
    model.train()
    with pytest.warns(UserWarning, match=CACHE_WARNING):
        output = model(**batch, use_cache=True)
    output.loss.backward()
    mask = model.base_model.last_token_mask.clone()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    _, ref_grads = reference_loss_and_grads(model, "seq_cls", batch, mask)
    assert_grads_match(grads, ref_grads)


def _cache_of(output):
    """The KV cache a forward returned: ``cache`` since transformers 5.24, ``past_key_values`` before."""
    cache = getattr(output, "cache", None)
    return cache if cache is not None else output.past_key_values


def test_a_cache_holding_positions_is_refused():
    model = tokentune_model("llama")
    batch = make_batch("llama")
    model.eval()
    with torch.no_grad():  # a cache filled by an ordinary forward over 4 positions
        cache = _cache_of(model(input_ids=batch["input_ids"][:, :4], use_cache=True))
    assert cache.get_seq_length() == 4
    model.train()
    with pytest.raises(ValueError, match=r"KV cache.*`cache` holds 4 positions"):
        model(**batch, cache=cache)
    assert all(p.grad is None for p in model.parameters())


def test_eval_and_generate_still_use_the_cache():
    model = tokentune_model("llama")
    batch = make_batch("llama", batch=1)
    model.train()
    model(**batch, use_cache=True).loss.backward()
    model.eval()
    with torch.no_grad():
        output = model(input_ids=batch["input_ids"], use_cache=True)
    cache = _cache_of(output)
    assert cache is not None and cache.get_seq_length() == batch["input_ids"].shape[1]


def test_an_empty_cache_reaching_the_blocks_is_dropped(monkeypatch):
    """The blocks' own handling (behind the model-level one; a model whose forward takes no `use_cache` and whose
    config defaults it to True, as GraniteMoE's, makes one itself): an empty cache is dropped, the gradients are the
    reference's; one holding positions is refused, naming the block."""
    import peft_slim.token_selection.selector as selector

    monkeypatch.setattr(selector, "CACHE_ARGUMENTS", ())  # the model-level handling no longer drops the cache
    model = tokentune_model("llama")
    batch = make_batch("llama")
    model.train()
    config = model.get_base_model().config
    cache = DynamicCache(config=config)
    with pytest.warns(UserWarning, match="empty KV cache to LlamaDecoderLayer"):
        model(**batch, cache=cache).loss.backward()
    assert cache.get_seq_length() == 0
    mask = model.base_model.last_token_mask.clone()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    _, ref_grads = reference_loss_and_grads(model, "llama", batch, mask)
    assert_grads_match(grads, ref_grads)

    model.eval()
    with torch.no_grad():
        cache = _cache_of(model(input_ids=batch["input_ids"][:, :4], use_cache=True))
    model.train()
    with pytest.raises(ValueError, match=r"LlamaDecoderLayer on top of a KV cache.*`cache` holds 4 positions"):
        model(**batch, cache=cache)
