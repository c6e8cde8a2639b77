"""TokenTune's chunked LM-head loss: the same loss and gradients as materialised logits, without keeping them.

References are written here independently: the full logits of the selected rows, ``F.cross_entropy`` over them,
ordinary autograd.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from helpers.reference import reference_forward, selected_causal_lm_loss
from helpers.tiny_models import VOCAB, FullFineTuned, decoder_config, make_batch
from helpers.tokentune_cases import assert_grads_match, grads_of_trainable, training_step
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model
from transformers import LlamaConfig, LlamaForCausalLM

from peft_slim import TokenTuneConfig, tokentune_
from peft_slim.token_selection import chunked_loss
from peft_slim.token_selection.blocks import find_blocks
from peft_slim.token_selection.chunked_loss import chunked_head_loss

HIDDEN = 32


# ------------------------------------------------------------------------------------------ the function itself


def _materialised(head: torch.nn.Module, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(head(hidden).float(), targets, ignore_index=-100, reduction="sum")


def _grads(loss: torch.Tensor, tensors: list[torch.Tensor]) -> list[torch.Tensor]:
    return list(torch.autograd.grad(loss, tensors))


@settings(max_examples=25, deadline=None)
@given(
    rows=st.integers(1, 23),
    chunk=st.integers(1, 9),
    ignored=st.floats(0.0, 1.0),
    dtype=st.sampled_from([torch.float32, torch.bfloat16]),
    bias=st.booleans(),
    seed=st.integers(0, 2**16),
)
def test_chunked_equals_materialised(rows, chunk, ignored, dtype, bias, seed):
    torch.manual_seed(seed)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=bias).to(dtype)
    hidden = torch.randn(rows, HIDDEN, dtype=dtype, requires_grad=True)
    targets = torch.randint(0, VOCAB, (rows,))
    targets[torch.rand(rows) < ignored] = -100
    params = list(head.parameters())

    expected = _materialised(head, hidden, targets)
    expected_grads = _grads(expected, [hidden, *params])
    total = chunked_head_loss(head, params, hidden, targets, chunk)
    grads = _grads(total, [hidden, *params])

    exact = dtype == torch.float32
    torch.testing.assert_close(total, expected, rtol=1e-6 if exact else 1e-3, atol=1e-5)
    if exact:  # rows are computed alone in both: gradients match to fp32 rounding
        for grad, want in zip(grads, expected_grads):
            assert grad.dtype == want.dtype and grad.shape == want.shape
            torch.testing.assert_close(grad, want, rtol=1e-5, atol=1e-6)
        return
    # bf16: both paths round, at different places (the materialised one rounds the logits' gradient and the
    # one-matmul sum; the chunked one sums chunks in fp32 and rounds once), so neither is the reference: both are
    # compared with the same computation in float64 and the chunked one must be about as close as the materialised.
    head64 = copy.deepcopy(head).double()
    hidden64 = hidden.detach().double().requires_grad_(True)
    truth = _grads(_materialised(head64, hidden64, targets), [hidden64, *head64.parameters()])
    for grad, want, true in zip(grads, expected_grads, truth):
        assert grad.dtype == want.dtype and grad.shape == want.shape
        scale = true.abs().max().item() + 1e-12
        chunked_error = (grad.double() - true).abs().max().item() / scale
        materialised_error = (want.double() - true).abs().max().item() / scale
        assert chunked_error <= 2 * materialised_error + 2**-7, (chunked_error, materialised_error)


def test_only_requested_gradients_and_frozen_head():
    head = torch.nn.Linear(HIDDEN, VOCAB)
    head.requires_grad_(False)
    hidden = torch.randn(7, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (7,))
    (grad,) = _grads(chunked_head_loss(head, [], hidden, targets, 3), [hidden])
    (want,) = _grads(_materialised(head, hidden, targets), [hidden])
    torch.testing.assert_close(grad, want)


def test_dropout_in_the_head_draws_the_forward_masks_again():
    """The backward recomputes each chunk under the forward's RNG state: the gradient is that of the loss returned."""
    torch.manual_seed(0)
    linear = torch.nn.Linear(HIDDEN, VOCAB)
    head = torch.nn.Sequential(torch.nn.Dropout(0.5), linear)
    hidden = torch.randn(10, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (10,))
    params = list(linear.parameters())

    torch.manual_seed(1)  # reference: the same chunks with ordinary autograd, graphs kept
    expected = sum(_materialised(head, hidden[i : i + 4], targets[i : i + 4]) for i in range(0, 10, 4))
    expected_grads = _grads(expected, [hidden, *params])
    torch.manual_seed(1)
    total = chunked_head_loss(head, params, hidden, targets, 4)
    after_forward = torch.get_rng_state()
    grads = _grads(total, [hidden, *params])
    torch.testing.assert_close(total, expected)
    for grad, want in zip(grads, expected_grads):
        torch.testing.assert_close(grad, want)
    assert torch.equal(torch.get_rng_state(), after_forward)  # the backward leaves the global RNG as it was


def test_autocast_is_entered_again_for_the_recomputation():
    torch.manual_seed(0)
    head = torch.nn.Linear(HIDDEN, VOCAB)
    hidden = torch.randn(9, HIDDEN, requires_grad=True)
    targets = torch.randint(0, VOCAB, (9,))
    params = list(head.parameters())
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _materialised(head, hidden, targets)
        total = chunked_head_loss(head, params, hidden, targets, 4)
    expected_grads = _grads(expected, [hidden, *params])
    grads = _grads(total, [hidden, *params])
    torch.testing.assert_close(total, expected, rtol=1e-6, atol=1e-6)
    # rows alone: the same bf16 operations, the same hidden gradient (an fp32 recomputation is ~5e-3 off)
    torch.testing.assert_close(grads[0], expected_grads[0], rtol=1e-6, atol=1e-7)
    for grad, want in zip(grads[1:], expected_grads[1:]):  # sums over rows: bf16 products summed in another order
        torch.testing.assert_close(grad, want, rtol=2e-2, atol=2e-3)


def test_shapes_are_checked():
    head = torch.nn.Linear(HIDDEN, VOCAB)
    with pytest.raises(ValueError, match="hidden must be"):
        chunked_head_loss(head, [], torch.randn(2, 3, HIDDEN), torch.zeros(2, dtype=torch.long), 4)


# ------------------------------------------------------------------------------------------ in TokenTune


def _llama(tied: bool, dtype=torch.float32, **extra) -> LlamaForCausalLM:
    config = decoder_config(tie_word_embeddings=tied, **extra)
    torch.manual_seed(0)
    return LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=dtype)


def _model(tied: bool, lora_head: bool, chunked: bool, dtype=torch.float32, lora: bool = True, **extra):
    targets = ["q_proj", "v_proj", "down_proj"] + (["lm_head"] if lora_head else [])
    nested = LoraConfig(r=4, target_modules=targets, init_lora_weights=False) if lora else None
    config = TokenTuneConfig(task_type="CAUSAL_LM", lora=nested, token_ratio=0.4, seed=0, chunked_loss=chunked)
    base = _llama(tied, dtype, **extra)
    return get_peft_model(base, config) if lora else FullFineTuned(base, tokentune_(base, config))


def _batch() -> dict:
    batch = make_batch("llama", length=12)
    batch["labels"][0, 4:7] = -100  # ignored labels inside a row, besides the padding
    return batch


def _reference(model, batch: dict, mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """The selected-token loss from the full logits of an ordinary forward (tests/helpers/reference.py), and its
    gradients."""
    model.zero_grad(set_to_none=True)
    model.eval()
    inner = model.get_base_model()
    with reference_forward(inner, find_blocks(inner)[1], mask):
        inputs = {key: value for key, value in batch.items() if key != "labels"}
        loss = selected_causal_lm_loss(model(**inputs).logits, batch["labels"], mask)
    loss.backward()
    model.train()
    grads = grads_of_trainable(model)
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads


@pytest.fixture
def small_chunks(monkeypatch):
    monkeypatch.setattr(chunked_loss, "MIN_CHUNK_ROWS", 1)  # rows / ceil(vocab / hidden) rows: several chunks a batch


@pytest.mark.parametrize("lora", [True, False], ids=["lora", "full"])
@pytest.mark.parametrize("lora_head", [False, True], ids=["head_frozen", "lora_head"])
@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_tokentune_gradients_exact(small_chunks, tied, lora_head, lora):
    if lora_head and not lora:
        pytest.skip("LoRA on lm_head needs LoRA")
    batch = _batch()
    model = _model(tied, lora_head, chunked=True, lora=lora)
    output, mask, grads = training_step(model, batch)
    assert output.logits is None  # the chunked loss never built them
    loss, ref_grads = _reference(model, batch, mask)
    torch.testing.assert_close(output.loss.detach(), loss, rtol=1e-5, atol=1e-6)
    assert_grads_match(grads, ref_grads)
    if lora_head:
        assert any("lm_head.lora_B" in name and grad.abs().max() > 0 for name, grad in grads.items())
    if tied and not lora:  # the tied weight gets the embedding's and the head's gradient
        assert grads["model.embed_tokens.weight"].abs().max() > 0

    materialised = _model(tied, lora_head, chunked=False, lora=lora)
    output_m, mask_m, grads_m = training_step(materialised, batch)
    assert torch.equal(mask_m, mask) and output_m.logits is not None
    torch.testing.assert_close(output.loss, output_m.loss, rtol=1e-6, atol=1e-7)
    assert_grads_match(grads, grads_m, rtol=1e-6)


def test_the_head_runs_only_on_labelled_selected_positions(small_chunks):
    """A selected position without a label adds nothing to the loss: the head (forward and its recomputation in
    backward) sees exactly the selected positions whose next token is labelled, none of the others."""
    batch = _batch()
    batch["labels"][1, :9] = -100  # a short answer: most selected positions in this row have no label
    model = _model(False, False, chunked=True)
    rows_seen = []
    hook = model.get_base_model().lm_head.register_forward_pre_hook(
        lambda m, args: rows_seen.append((torch.is_grad_enabled(), args[0][..., 0].numel()))
    )
    output, mask, _ = training_step(model, batch)
    hook.remove()
    labels = batch["labels"]
    scored = mask[:, :-1] & (labels[:, 1:] != -100)
    assert rows_seen[0] == (True, 0)  # the model's own call: no position (the loss runs the head itself)
    forward_rows = sum(rows for grad, rows in rows_seen[1:] if not grad)  # the loss's chunks run without grad
    backward_rows = sum(rows for grad, rows in rows_seen[1:] if grad)  # their recomputation with it
    assert forward_rows == backward_rows == int(scored.sum()) < int(mask.sum())


def test_tokentune_bf16(small_chunks):
    batch = _batch()
    chunked = _model(False, True, chunked=True, dtype=torch.bfloat16)
    materialised = _model(False, True, chunked=False, dtype=torch.bfloat16)
    output, mask, grads = training_step(chunked, batch)
    output_m, mask_m, grads_m = training_step(materialised, batch)
    assert torch.equal(mask, mask_m)
    torch.testing.assert_close(output.loss, output_m.loss, rtol=1e-3, atol=1e-3)
    error = max((grads[n].float() - grads_m[n].float()).abs().max().item() for n in grads)
    scale = max(grads_m[n].float().abs().max().item() for n in grads)
    assert scale > 0 and error <= 2e-2 * scale  # bf16: within a couple of roundings
    loss, ref_grads = _reference(chunked, batch, mask)
    torch.testing.assert_close(output.loss.detach(), loss, rtol=1e-3, atol=1e-3)


def test_num_items_in_batch_scaling_is_kept(small_chunks):
    batch = _batch()
    outputs = [
        training_step(_model(False, False, chunked=c), {**batch, "num_items_in_batch": 50})[0] for c in (True, False)
    ]
    torch.testing.assert_close(outputs[0].loss, outputs[1].loss, rtol=1e-6, atol=1e-7)


def test_no_vocabulary_wide_tensor_is_saved(small_chunks):
    """What backward keeps: nothing with the vocabulary as a dimension besides the weights (the materialised path
    keeps the [rows, vocab] log-softmax)."""

    def saved_shapes(chunked: bool) -> list[tuple]:
        model = _model(False, False, chunked=chunked)
        model.train()
        parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
        shapes = []

        def pack(tensor):
            if tensor.untyped_storage().data_ptr() not in parameters:
                shapes.append(tuple(tensor.shape))
            return tensor

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            model(**_batch())
        return shapes

    assert any(VOCAB in shape for shape in saved_shapes(False))
    assert not any(VOCAB in shape for shape in saved_shapes(True))


def test_gradient_checkpointing_with_chunked_loss(small_chunks):
    batch = _batch()
    _, mask, grads = training_step(_model(True, True, chunked=True), batch)
    model = _model(True, True, chunked=True)
    model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    assert model.get_base_model().is_activation_checkpointing
    output, mask_ckpt, grads_ckpt = training_step(model, batch)
    assert torch.equal(mask, mask_ckpt) and output.logits is None
    assert_grads_match(grads_ckpt, grads, rtol=1e-6)
    _, ref_grads = _reference(model, batch, mask)
    assert_grads_match(grads_ckpt, ref_grads)


def test_logit_softcapping_keeps_the_materialised_path():
    """A config that post-processes logits (Gemma's soft-capping) is not chunked: the forward still returns them."""
    config = TokenTuneConfig(task_type="CAUSAL_LM", lora=LoraConfig(r=4, target_modules=["q_proj"]), token_ratio=0.5)
    base = _llama(False)
    base.config.logits_scaling = 1.0  # a field the selector knows changes logits (Granite)
    model = get_peft_model(base, config)
    output = training_step(model, _batch())[0]
    assert output.logits is not None


class _ScaledLlama(LlamaForCausalLM):
    def forward(self, *args, **kwargs):
        output = super().forward(*args, **kwargs)
        output.logits = output.logits * 2
        return output


def test_a_forward_that_changes_the_logits_is_refused():
    config = LlamaConfig(
        hidden_size=HIDDEN, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64, use_cache=False
    )
    config.vocab_size = VOCAB
    base = _ScaledLlama._from_config(config, attn_implementation="sdpa")
    model = get_peft_model(base, TokenTuneConfig(task_type="CAUSAL_LM", lora=LoraConfig(r=4), token_ratio=0.5))
    model.train()
    with pytest.raises(ValueError, match="changes the LM head's logits.*chunked_loss=False"):
        model(**_batch())
    model = get_peft_model(
        _ScaledLlama._from_config(config, attn_implementation="sdpa"),
        TokenTuneConfig(task_type="CAUSAL_LM", lora=LoraConfig(r=4), token_ratio=0.5, chunked_loss=False),
    )
    assert model(**_batch()).loss.isfinite()


@pytest.mark.cuda
def test_on_cuda_gradients_match_and_the_peak_is_lower():
    """bf16 on a GPU, a 32k vocabulary: the chunked loss's gradients equal the materialised path's (to bf16
    rounding) and the step's peak allocation is lower (no [rows, vocab] fp32 logits, log-softmax or gradient)."""
    config = decoder_config(
        hidden_size=64, num_hidden_layers=1, intermediate_size=128, vocab_size=32000, use_cache=False
    )
    ids = torch.randint(1, 32000, (4, 512), device="cuda")
    results = {}
    for chunked in (True, False):
        torch.manual_seed(0)
        base = LlamaForCausalLM._from_config(config, attn_implementation="sdpa", dtype=torch.bfloat16).cuda()
        lora = LoraConfig(r=4, target_modules=["q_proj", "v_proj", "lm_head"], init_lora_weights=False)
        tuner = TokenTuneConfig(task_type="CAUSAL_LM", lora=lora, token_ratio=0.5, seed=0, chunked_loss=chunked)
        model = get_peft_model(base, tuner)
        model.train()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        model(input_ids=ids, labels=ids).loss.backward()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - before
        grads = {n: p.grad.float().cpu() for n, p in model.named_parameters() if p.requires_grad}
        results[chunked] = (peak, grads, model.base_model.last_token_mask.cpu())
    assert torch.equal(results[True][2], results[False][2])
    for name, grad in results[False][1].items():
        torch.testing.assert_close(results[True][1][name], grad, rtol=3e-2, atol=1e-3 * grad.abs().max().item())
    assert results[True][0] < results[False][0]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gradient_in_place_is_autograds_bit_for_bit(dtype):
    """The logits' gradient written over the log-probabilities is, bit for bit, what autograd computes through
    ``F.cross_entropy(logits.float(), ..., reduction="sum")`` (ignored rows included), and the logits are not
    needed after it."""
    torch.manual_seed(0)
    logits = (torch.randn(9, 301) * 4).to(dtype).requires_grad_(True)
    targets = torch.randint(0, 301, (9,))
    targets[[2, 5]] = -100
    grad_total = torch.tensor(0.0371)
    loss = F.cross_entropy(logits.float(), targets, ignore_index=-100, reduction="sum")
    (expected,) = torch.autograd.grad(loss, logits, grad_total)
    gradient = chunked_loss._chunk_logits_gradient(logits.detach().clone(), targets, grad_total)
    assert gradient.dtype == dtype and torch.equal(gradient, expected)
    assert torch.equal(chunked_loss._chunk_loss(torch.nn.Identity(), logits.detach().clone(), targets), loss.detach())
