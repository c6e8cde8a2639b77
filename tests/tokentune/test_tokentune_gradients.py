"""TokenTune gradients equal the "equivalent definition" of methods.md, on every supported architecture.

The equivalent definition (implemented independently in tests/helpers/reference.py): the gradient of the
selected-position loss in an ordinary forward in which, at every block input, hidden states at unselected
positions are detached, and inside attention, keys and values at unselected positions are detached.
Every batch is padded (one row has 3 padding positions) and has batch size 3, so the selection rows have
different widths and exercise the padded-index form.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from helpers.reference import reference_forward
from helpers.tiny_models import CAUSAL_LM, TEXT_SIZES, VOCAB, FullFineTuned, build, decoder_config, make_batch
from helpers.tokentune_cases import (
    ARCHS,
    IMPLEMENTATIONS,
    assert_grads_match,
    build_decoder_classifier,
    grads_of_trainable,
    lora_config,
    max_grad_error,
    reference_loss_and_grads,
    tokentune_config,
    tokentune_model,
    training_step,
)
from peft import LoraConfig, get_peft_model
from transformers import CLIPTextConfig, CLIPTextModel, LlamaModel

from peft_slim import TokenTuneConfig, tokentune_
from peft_slim.token_selection.blocks import find_blocks


def _eval_logits(model, batch: dict) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k != "labels"}).logits
    model.train()
    return logits


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_gradient_and_loss_match_equivalent_definition(arch, implementation, lora):
    model = tokentune_model(arch, implementation, lora=lora)
    batch = make_batch(arch)
    output, mask, grads = training_step(model, batch)

    # The mask is a genuine subset (otherwise TokenTune would equal full training and prove nothing).
    real = batch.get("attention_mask", torch.ones(mask.shape, dtype=torch.long)).bool()
    assert mask.dtype == torch.bool and mask.shape == real.shape
    assert 0 < mask.sum() < real.sum()
    assert not (mask & ~real).any()

    ref_loss, ref_grads = reference_loss_and_grads(model, arch, batch, mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)
    # Every trainable tensor that the reference gradient reaches is reached by TokenTune too.
    for name, grad in ref_grads.items():
        if grad.abs().max() > 0:
            assert grads[name].abs().max() > 0, name

    # The forward itself is exact: the logits of the training forward equal an ordinary forward's.
    eval_logits = _eval_logits(model, batch)
    if arch in CAUSAL_LM:
        # With labels, the chunked loss runs the head itself and the forward returns no logits; without labels,
        # the LM head runs only on the selection's slots [B, width, V], and valid slots are exact.
        assert output.logits is None
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        logits = model(**inputs, token_mask=mask).logits
        width = int(mask.sum(dim=1).max())
        assert logits.shape == (mask.shape[0], width, eval_logits.shape[-1])
        for row in range(mask.shape[0]):
            positions = mask[row].nonzero().flatten()
            torch.testing.assert_close(
                logits[row, : len(positions)].detach(), eval_logits[row, positions], rtol=1e-5, atol=1e-5
            )
    else:
        torch.testing.assert_close(output.logits.detach(), eval_logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_decoder_sequence_classification_gradient(arch, implementation):
    """Decoder + classification head (reads the last real token; the KV cache must stay off in training)."""
    base = build_decoder_classifier(arch, implementation)
    config = tokentune_config(arch, task_type="SEQ_CLS")
    model = get_peft_model(base, config)
    batch = make_batch(arch)  # left padding
    batch["labels"] = torch.tensor([0, 1, 2])
    output, mask, grads = training_step(model, batch)
    assert mask[:, -1].all() and (mask.sum(dim=1) < batch["attention_mask"].sum(dim=1)).all()
    ref_loss, ref_grads = reference_loss_and_grads(model, "seq_cls", batch, mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)
    torch.testing.assert_close(output.logits.detach(), _eval_logits(model, batch), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("head", ["BertForTokenClassification", "BertForMaskedLM"])
def test_per_position_head_gradient(head):
    """Per-position heads: loss = mean CE over selected positions with a valid label (no shift)."""
    import transformers

    torch.manual_seed(0)
    base = getattr(transformers, head)._from_config(build("bert").config, attn_implementation="eager")
    model = get_peft_model(base, tokentune_config("bert", task_type=None))
    batch = make_batch("bert")
    n_classes = 3 if head == "BertForTokenClassification" else base.config.vocab_size
    labels = torch.randint(0, n_classes, batch["input_ids"].shape, generator=torch.Generator().manual_seed(1))
    labels = labels.masked_fill(batch["attention_mask"] == 0, -100)
    labels[:, 4] = -100
    batch["labels"] = labels
    output, mask, grads = training_step(model, batch)

    model.zero_grad(set_to_none=True)
    model.eval()
    _, blocks = find_blocks(model.get_base_model())
    with reference_forward(model.get_base_model(), blocks, mask):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        targets = labels.masked_fill(~mask, -100)
        ref_loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100)
    ref_loss.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    torch.testing.assert_close(output.loss.detach(), ref_loss.detach(), rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)


def test_full_token_training_would_fail_the_reference_check():
    """Sanity check of the check: plain LoRA training (all tokens) differs from the reference gradient."""
    model = tokentune_model("llama", lora=True)
    batch = make_batch("llama")
    _, mask, _ = training_step(model, batch)
    # Full-token gradient of the same selected-position loss: ordinary forward, no detaching.
    model.eval()
    logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    targets = torch.full_like(batch["labels"], -100)
    targets[:, :-1] = torch.where(mask[:, :-1], batch["labels"][:, 1:], -100)
    F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=-100).backward()
    full = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
    model.zero_grad(set_to_none=True)
    _, ref = reference_loss_and_grads(model, "llama", batch, mask)
    error, scale = max_grad_error(full, ref)
    assert error > 1e-3 * scale


@pytest.mark.parametrize("arch", ["llama", "bert"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
def test_task_type_none_with_explicit_token_mask(arch, lora):
    """Plain PeftModel (task_type=None) bypasses the tuner's forward; an explicit token_mask overrides the draw."""
    model = tokentune_model(arch, lora=lora, task_type=None)
    assert type(model).__name__ == ("PeftModel" if lora else "FullFineTuned")
    batch = make_batch(arch, length=12)
    real = batch["attention_mask"].bool()
    token_mask = torch.zeros_like(real)
    for row in range(real.shape[0]):
        positions = real[row].nonzero().flatten()
        # first real token ([CLS] for BERT) + every third real token
        token_mask[row, positions[0]] = True
        token_mask[row, positions[::3]] = True
    # What the seeded draw would have chosen: must differ, so the override is observable.
    drawn = tokentune_model(arch, lora=lora, task_type=None)
    training_step(drawn, batch)
    assert not torch.equal(drawn.base_model.last_token_mask, token_mask)

    output, mask, grads = training_step(model, batch, token_mask=token_mask)
    assert torch.equal(mask, token_mask)
    ref_loss, ref_grads = reference_loss_and_grads(model, arch, batch, token_mask)
    torch.testing.assert_close(output.loss.detach(), ref_loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)


def _causality_by_argument(kind: str, implementation: str) -> torch.nn.Module:
    """A bare model whose layers are told by their `is_causal` argument, not their module's attribute, whether to
    attend causally when no mask reaches them (no padding): a Llama with a bidirectional config (`is_causal=False`
    passed to causal modules) or CLIP's text model (`is_causal=True` passed to non-causal ones)."""
    torch.manual_seed(0)
    if kind == "bidirectional_llama":
        return LlamaModel._from_config(decoder_config(is_causal=False), attn_implementation=implementation)
    config = CLIPTextConfig(**TEXT_SIZES, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    return CLIPTextModel._from_config(config, attn_implementation=implementation)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("kind", ["bidirectional_llama", "clip_text"])
def test_causality_given_to_the_attention_call_is_kept(kind, implementation):
    """The selected pass attends with the causality of the full pass: from the layer's `is_causal` argument under
    sdpa (it once read the module's attribute: a bidirectional Llama's selected queries attended causally, CLIP's
    text model's to later tokens), none without a mask under eager."""
    lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    model = get_peft_model(_causality_by_argument(kind, implementation), TokenTuneConfig(lora=lora, seed=0))
    input_ids = torch.randint(3, VOCAB, (2, 10), generator=torch.Generator().manual_seed(0))
    weights = torch.randn(2, 10, TEXT_SIZES["hidden_size"], generator=torch.Generator().manual_seed(1))
    model.train()
    hidden = model(input_ids=input_ids).last_hidden_state
    mask = model.base_model.last_token_mask.clone()
    assert 0 < mask.sum() < mask.numel()
    loss = (hidden * weights * mask[..., None]).sum()
    loss.backward()
    grads = grads_of_trainable(model)

    model.zero_grad(set_to_none=True)
    model.eval()
    inner = model.get_base_model()
    with reference_forward(inner, find_blocks(inner)[1], mask):
        ref_hidden = model(input_ids=input_ids, use_cache=False).last_hidden_state
        ref_loss = (ref_hidden * weights * mask[..., None]).sum()
    ref_loss.backward()
    torch.testing.assert_close(loss.detach(), ref_loss.detach())
    assert_grads_match(grads, grads_of_trainable(model))


def _embedding_module(model, arch: str) -> torch.nn.Module:
    inner = model.get_base_model()
    if arch in CAUSAL_LM:
        return inner.get_input_embeddings()
    return getattr(inner, arch).embeddings  # bert.embeddings / roberta.embeddings / vit.embeddings


def _embedding_grad(model, arch: str, batch: dict, **kwargs) -> torch.Tensor:
    """Gradient of the loss w.r.t. the embedding output [B, L, H] (made a leaf by a forward hook)."""
    captured = []

    def make_leaf(module, args, output):
        leaf = output.detach().requires_grad_(True)
        captured.append(leaf)
        return leaf

    handle = _embedding_module(model, arch).register_forward_hook(make_leaf)
    try:
        model.train()
        model.zero_grad(set_to_none=True)
        model(**batch, **kwargs).loss.backward()
    finally:
        handle.remove()
    assert len(captured) == 1
    return captured[0].grad


@pytest.mark.parametrize("arch", ["llama", "gpt2", "qwen3", "bert", "vit"])
def test_gradient_reaches_only_selected_positions(arch):
    """Nothing flows back into unselected positions; plain LoRA training (control) does send gradient there."""
    model = tokentune_model(arch, lora=True)
    batch = make_batch(arch, length=12)
    grad = _embedding_grad(model, arch, batch)
    mask = model.base_model.last_token_mask
    assert grad is not None and grad.shape[:2] == mask.shape
    per_position = grad.abs().amax(dim=-1)
    assert torch.all(per_position[~mask] == 0), "gradient leaked into unselected positions"
    assert (per_position[mask] > 0).sum() >= mask.shape[0], "no gradient reached the selected positions"

    # Control: the same weights under vanilla LoRA (every token trains) do send gradient to unselected tokens.
    base = build(arch)
    vanilla = get_peft_model(base, lora_config(arch))
    vanilla.load_state_dict(model.state_dict())
    control = _embedding_grad(vanilla, arch, batch).abs().amax(dim=-1)
    real = batch.get("attention_mask", torch.ones(mask.shape, dtype=torch.long)).bool()
    assert (control[~mask & real] > 0).any()


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_causal_lm_loss_is_selected_next_token_mean(arch):
    """The training loss = mean over selected i with a valid label at i+1 of CE(logits[i], labels[i+1]).

    Computed by hand from the full logits of an eval-mode forward with the same weights. (The logits
    returned by a training forward cover only the selection's slots, so they cannot be used directly.)
    """
    # `random`: the answer rule would select labelled positions first, and this case needs selected ones without
    model = tokentune_model(arch, lora=True, token_ratio=0.6, selection="random")
    batch = make_batch(arch, length=12)
    labels = batch["labels"].clone()
    labels[:, 5:7] = -100  # a masked span in the middle: some selected positions have no valid target
    batch["labels"] = labels
    model.train()
    loss = model(**batch).loss
    mask = model.base_model.last_token_mask

    logits = _eval_logits(model, batch)
    terms = []
    for row in range(labels.shape[0]):
        for i in range(labels.shape[1] - 1):
            if mask[row, i] and labels[row, i + 1] != -100:
                terms.append(F.cross_entropy(logits[row, i][None].float(), labels[row, i + 1][None]))
    # the case is not degenerate: some selected positions are dropped for lack of a label
    n_selected_with_next = int(mask[:, :-1].sum())
    assert 0 < len(terms) < n_selected_with_next
    expected = torch.stack(terms).mean()
    torch.testing.assert_close(loss.detach(), expected, rtol=1e-5, atol=1e-6)

    # ... and it is not the full-token loss of the same batch.
    full = F.cross_entropy(logits[:, :-1].flatten(0, 1), labels[:, 1:].flatten(), ignore_index=-100)
    assert abs(full.item() - loss.item()) > 1e-4


def _attention_call_counter(model):
    _, blocks = find_blocks(model.get_base_model())
    attention = next(
        m for n, m in blocks[0].named_modules() if n.endswith(("self_attn", "attention.self")) or n == "attn"
    )
    calls = []
    handle = attention.register_forward_hook(lambda *args: calls.append(1))
    return calls, handle


def _counted_step(model, batch: dict):
    """A training step with the attention calls of the first block counted: (in the forward, in all), output, mask,
    gradients. After a first step: that one also runs each block's selected pass once more, to check it
    (test_tokentune_invariant.py)."""
    model.train()
    model(**batch).loss.backward()
    model.zero_grad(set_to_none=True)
    calls, handle = _attention_call_counter(model)
    output = model(**batch)
    in_forward = len(calls)
    mask = model.base_model.last_token_mask.clone()
    output.loss.backward()
    handle.remove()
    grads = grads_of_trainable(model)
    model.zero_grad(set_to_none=True)
    return (in_forward, len(calls)), output, mask, grads


def _random_draw_in_first_block(model):
    """A forward hook that draws a random number in the first block and changes nothing: the block is then run as a
    block with dropout is (the selected pass with grad in the forward)."""
    _, blocks = find_blocks(model.get_base_model())
    feed_forward = getattr(blocks[0], "mlp", None) or blocks[0].intermediate  # decoders / BERT
    return feed_forward.register_forward_hook(lambda module, args, output: torch.rand(1) * 0 + output)


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ["llama", "bert", "gpt2"])
def test_selected_tokens_run_once_in_the_forward(arch, implementation, lora):
    """Each block runs once in the forward (every token, no grad) and once in backward (the selected tokens); the
    gradients equal those of the selected pass run with grad in the forward (the path a block with dropout takes)."""
    batch = make_batch(arch, length=12)
    model = tokentune_model(arch, implementation, lora=lora)
    calls, output, mask, grads = _counted_step(model, batch)
    assert calls == (1, 2)

    two_pass = tokentune_model(arch, implementation, lora=lora)
    handle = _random_draw_in_first_block(two_pass)
    with pytest.warns(UserWarning, match="draws random numbers in training"):
        two_calls, two_output, two_mask, two_grads = _counted_step(two_pass, batch)
    handle.remove()
    assert two_calls == (2, 2)  # the first block: no-grad pass + selected pass with grad, nothing in backward
    assert torch.equal(two_mask, mask)
    torch.testing.assert_close(output.loss, two_output.loss, rtol=1e-6, atol=1e-6)
    assert_grads_match(grads, two_grads, rtol=1e-6)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_gradient_checkpointing_gives_same_gradients(arch, implementation, lora, reentrant):
    """With checkpointing on, the step is the same: the recomputation in backward already is a checkpoint, and is
    not checkpointed again."""
    batch = make_batch(arch, length=12)
    calls, output, mask, grads = _counted_step(tokentune_model(arch, implementation, lora=lora), batch)
    assert calls == (1, 2)

    base = build(arch, implementation)
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    config = tokentune_config(arch, lora=lora)
    checkpointed = get_peft_model(base, config) if lora else FullFineTuned(base, tokentune_(base, config))
    assert checkpointed.get_base_model().is_activation_checkpointing
    calls_ckpt, output_ckpt, mask_ckpt, grads_ckpt = _counted_step(checkpointed, batch)
    assert calls_ckpt == (1, 2)
    assert torch.equal(mask_ckpt, mask)  # same seed, same draw
    torch.testing.assert_close(output_ckpt.loss, output.loss)
    assert_grads_match(grads_ckpt, grads, rtol=1e-6)
    _, ref_grads = reference_loss_and_grads(checkpointed, arch, batch, mask)
    assert_grads_match(grads_ckpt, ref_grads)


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_gradient_checkpointing_replays_a_block_that_draws_random_numbers(reentrant):
    """A block with dropout runs the selected pass with grad in the forward; checkpointing replays it in backward."""
    batch = make_batch("llama", length=12)
    base = build("llama")
    base.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": reentrant})
    model = get_peft_model(base, tokentune_config("llama"))
    handle = _random_draw_in_first_block(model)
    with pytest.warns(UserWarning, match="draws random numbers in training"):
        calls, _, mask, grads = _counted_step(model, batch)
    handle.remove()
    assert calls == (2, 3)
    _, ref_grads = reference_loss_and_grads(model, "llama", batch, mask)
    assert_grads_match(grads, ref_grads)


def test_dropout_takes_the_two_pass_step_with_one_notice():
    """LoRA dropout draws random numbers: the step is the two-pass one, said once, and the loss is finite."""
    base = build("llama")
    config = tokentune_config("llama")
    config.lora.lora_dropout = 0.1
    model = get_peft_model(base, config)
    batch = make_batch("llama", length=12)
    with pytest.warns(UserWarning, match="draws random numbers in training") as record:
        for _ in range(2):
            calls, output, _, _ = _counted_step(model, batch)
    assert calls == (2, 2)
    assert sum("draws random numbers" in str(w.message) for w in record) == 1
    assert torch.isfinite(output.loss)


def test_gradient_checkpointing_enabled_on_peft_model():
    batch = make_batch("llama", length=12)
    _, _, mask, grads = _counted_step(tokentune_model("llama", lora=True), batch)
    model = tokentune_model("llama", lora=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.get_base_model().is_activation_checkpointing
    calls, _, mask_ckpt, grads_ckpt = _counted_step(model, batch)
    assert calls == (1, 2)
    assert torch.equal(mask_ckpt, mask)
    assert_grads_match(grads_ckpt, grads, rtol=1e-6)


@pytest.mark.parametrize("targets", [["q_proj"], r"model\.layers\.0\.self_attn\.q_proj"], ids=["names", "regex"])
def test_standalone_trainable_modules(targets):
    model = tokentune_model("llama", lora=False, trainable_modules=targets)
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    expected = {name for name, _ in model.named_parameters() if ".q_proj." in name}
    if isinstance(targets, str):
        expected = {name for name in expected if ".layers.0." in name}
    assert trainable == expected and expected

    batch = make_batch("llama")
    model.train()
    model(**batch).loss.backward()
    mask = model.base_model.last_token_mask
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == expected  # frozen parameters receive no gradient at all
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.requires_grad}
    _, ref_grads = reference_loss_and_grads(model, "llama", batch, mask)
    assert_grads_match(grads, ref_grads)


def test_standalone_default_trains_every_base_parameter():
    model = tokentune_model("llama", lora=False)
    params = dict(model.named_parameters())
    assert params and all(p.requires_grad for p in params.values())
    assert not any("lora" in name for name in params)
