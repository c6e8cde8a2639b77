"""TokenTune semantics besides the gradient: inactive outside training, generate(), and which tokens are selected."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.tiny_models import CAUSAL_LM, build, make_batch
from helpers.tokentune_cases import (
    ARCHS,
    IMPLEMENTATIONS,
    TASK_TYPES,
    tokentune_config,
    tokentune_model,
    vanilla_lora_model,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import get_peft_model

from peft_slim import TokenTuneConfig
from peft_slim.token_selection.attention import REGISTERED_NAMES
from peft_slim.token_selection.blocks import find_blocks
from peft_slim.token_selection.selection import TokenSelection, draw_selection, forced_positions


def _inputs(batch: dict) -> dict:
    return {key: value for key, value in batch.items() if key != "labels"}


def _real(batch: dict, mask: torch.Tensor) -> torch.Tensor:
    return batch.get("attention_mask", torch.ones(mask.shape, dtype=torch.long)).bool()


# ---------------------------------------------------------------------------------------------- inactive


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("arch", ARCHS)
def test_eval_and_no_grad_outputs_equal_vanilla_lora(arch, implementation):
    """Eval mode, and train mode under no_grad: bit-identical to a plain PEFT LoRA model with the same weights."""
    model = tokentune_model(arch, implementation, lora=True)
    vanilla = vanilla_lora_model(arch, implementation, model)
    batch = make_batch(arch)
    # A training step first, so the eval check also covers a model that has been trained with TokenTune.
    model.train()
    model(**batch).loss.backward()
    mask_after_training = model.base_model.last_token_mask.clone()

    model.eval()
    vanilla.eval()
    with torch.no_grad():
        expected = vanilla(**batch)
    actual = model(**batch)  # eval mode with grad enabled: still inactive
    assert torch.equal(actual.logits, expected.logits)
    assert torch.equal(actual.loss, expected.loss)

    model.train()
    vanilla.train()
    with torch.no_grad():
        actual = model(**batch)
        expected = vanilla(**batch)
    assert torch.equal(actual.logits, expected.logits)  # full [B, L, ...] logits, not the selected slots
    assert torch.equal(actual.loss, expected.loss)  # the ordinary full-token loss
    # Inactive forwards draw nothing.
    assert torch.equal(model.base_model.last_token_mask, mask_after_training)
    assert model.get_base_model().config._attn_implementation == REGISTERED_NAMES[implementation]  # while attached


@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_standalone_eval_outputs_equal_base_model(arch):
    """Without LoRA, the eval-mode model is exactly the base model."""
    model = tokentune_model(arch, lora=False)
    base = build(arch)  # same seed: same weights
    batch = make_batch(arch)
    model.eval()
    base.eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, base(**batch).logits)


@pytest.mark.parametrize("arch", ["llama", "bert", "vit"])
def test_attn_implementation_is_tokentunes_from_attach_to_detach(arch):
    model = tokentune_model(arch, "eager")
    config = model.get_base_model().config
    batch = make_batch(arch)
    seen = []
    # Chosen at attach: TokenTune's registered function, which runs eager outside TokenTune's pass.
    assert config._attn_implementation == REGISTERED_NAMES["eager"]
    _, blocks = find_blocks(model.get_base_model())
    handle = blocks[0].register_forward_hook(lambda *a: seen.append(config._attn_implementation))
    model.train()
    model(**batch).loss.backward()
    handle.remove()
    assert seen == [REGISTERED_NAMES["eager"]]
    assert config._attn_implementation == REGISTERED_NAMES["eager"]
    assert model.unload().config._attn_implementation == "eager"  # restored at detach


def test_attn_implementation_restored_after_forward_that_raises():
    model = tokentune_model("llama")
    config = model.get_base_model().config
    batch = make_batch("llama")
    model.train()
    with pytest.raises(ValueError, match="token_mask"):
        model(**batch, token_mask=torch.ones(2, 3, dtype=torch.bool))
    assert config._attn_implementation == REGISTERED_NAMES["sdpa"]  # as attached
    # ... and the model still works, in training and in eval.
    model(**batch).loss.backward()
    assert config._attn_implementation == REGISTERED_NAMES["sdpa"]
    model.eval()
    vanilla = vanilla_lora_model("llama", "sdpa", model).eval()
    with torch.no_grad():
        assert torch.equal(model(**batch).logits, vanilla(**batch).logits)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
@pytest.mark.parametrize("second_training", [False, True], ids=["second in eval", "second training"])
def test_a_model_sharing_the_config_is_unaffected(implementation, second_training):
    """TokenTune routes attention through the model config's attention implementation while attached. Another model
    holding the same config object (TRL's reference model can) computes what it computes without TokenTune: before
    and after a training forward, and also run in the middle of it (its attention calls carry no TokenTune pass, so
    TokenTune's registered entry runs the original implementation), and after the detach."""
    base = build("llama", implementation)
    second = type(base)(base.config)
    second.load_state_dict(base.state_dict())
    assert second.config is base.config
    second.train(second_training)
    batch = make_batch("llama")

    def run_second():
        torch.manual_seed(0)
        with torch.no_grad():
            return second(**batch).logits

    expected = run_second()
    model = get_peft_model(base, tokentune_config("llama"))
    assert base.config._attn_implementation == REGISTERED_NAMES[implementation]
    assert torch.equal(run_second(), expected)
    during, names = [], []

    def in_the_middle(*args):
        if not during:
            names.append(base.config._attn_implementation)
            during.append(run_second())

    _, blocks = find_blocks(model.get_base_model())
    handle = blocks[0].register_forward_hook(in_the_middle)
    model.train()
    model(**batch).loss.backward()
    handle.remove()
    assert names == [REGISTERED_NAMES[implementation]]  # the shared config routes to TokenTune's entry meanwhile
    assert torch.equal(during[0], expected)
    assert torch.equal(run_second(), expected)
    model.unload()
    assert base.config._attn_implementation == implementation
    assert torch.equal(run_second(), expected)


# ---------------------------------------------------------------------------------------------- generate


@pytest.mark.parametrize("mode", ["eval", "train"])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_generate_equals_vanilla_lora(arch, mode):
    model = tokentune_model(arch, lora=True)
    vanilla = vanilla_lora_model(arch, "sdpa", model)
    batch = make_batch(arch)  # left-padded
    model.train(mode == "train")
    vanilla.train(mode == "train")
    kwargs = dict(max_new_tokens=5, do_sample=False, pad_token_id=0)
    out = model.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    expected = vanilla.generate(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], **kwargs)
    assert out.shape == (3, 10 + 5)
    assert torch.equal(out, expected)
    # Training still works afterwards.
    model.train()
    model(**batch).loss.backward()
    assert model.base_model.last_token_mask is not None


# ---------------------------------------------------------------------------------------------- selection


def _masks(model, batch: dict, n: int, **kwargs) -> list[torch.Tensor]:
    model.train()
    masks = []
    for _ in range(n):
        model(**batch, **kwargs)
        masks.append(model.base_model.last_token_mask.clone())
    return masks


def _first_last(real: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    positions = torch.arange(real.shape[1])
    first = torch.where(real, positions, real.shape[1]).min(dim=1).values
    last = torch.where(real, positions, -1).max(dim=1).values
    return first, last


@pytest.mark.parametrize("arch", ARCHS)
def test_selection_respects_padding_and_forced_positions(arch):
    model = tokentune_model(arch, token_ratio=0.25, seed=None)
    batch = make_batch(arch, batch=4, length=16)
    if arch != "vit":
        batch["attention_mask"][3] = 0  # a fourth row with a different amount of padding
        if arch in CAUSAL_LM:
            batch["attention_mask"][3, 9:] = 1
        else:
            batch["attention_mask"][3, :9] = 1
        batch["input_ids"] = batch["input_ids"].masked_fill(
            batch["attention_mask"] == 0, 1 if arch == "roberta" else 0
        )
        if arch in CAUSAL_LM:
            batch["labels"] = batch["input_ids"].masked_fill(batch["attention_mask"] == 0, -100)
    for mask in _masks(model, batch, 4):
        real = _real(batch, mask)
        assert not (mask & ~real).any(), "padding selected"
        first, last = _first_last(real)
        rows = torch.arange(mask.shape[0])
        assert mask[rows, first].all(), "first real token ([CLS]/BOS) not selected"
        if arch in CAUSAL_LM:
            assert mask[rows, last].all(), "last real token not selected"
        else:
            assert mask[:, 0].all()  # [CLS] is position 0 (right padding, or ViT)
        # token_ratio: ceil(ratio * n_real) per row, forced positions included (never fewer than the forced ones)
        n_real = real.sum(dim=1)
        n_forced = 2 if arch in CAUSAL_LM else 1
        expected = [max(math.ceil(0.25 * n), n_forced) for n in n_real.tolist()]
        assert mask.sum(dim=1).tolist() == expected


@pytest.mark.parametrize("ratio", [0.1, 0.3, 0.5, 1.0])
def test_token_ratio_counts(ratio):
    model = tokentune_model("llama", token_ratio=ratio)
    batch = make_batch("llama", length=20)
    (mask,) = _masks(model, batch, 1)
    n_real = batch["attention_mask"].sum(dim=1).tolist()
    assert mask.sum(dim=1).tolist() == [max(math.ceil(ratio * n), 2) for n in n_real]
    if ratio == 1.0:
        assert torch.equal(mask, batch["attention_mask"].bool())


@pytest.mark.parametrize("num_tokens", [1, 5, 17, 100])
@pytest.mark.parametrize("arch", ["llama", "bert"])
def test_num_tokens_counts(arch, num_tokens):
    model = tokentune_model(arch, num_tokens=num_tokens)
    batch = make_batch(arch, length=20)
    (mask,) = _masks(model, batch, 1)
    n_real = batch["attention_mask"].sum(dim=1).tolist()
    n_forced = 2 if arch in CAUSAL_LM else 1
    assert mask.sum(dim=1).tolist() == [max(min(num_tokens, n), n_forced) for n in n_real]


def test_answer_selection_picks_labelled_positions_first():
    """Causal LM: position i is labelled when labels[i+1] != -100; those are drawn before the others."""
    batch = make_batch("llama", batch=3, length=20)
    labels = batch["labels"].clone()
    labels[:, :12] = -100  # prompt: positions 0..10 carry no loss; 11..18 are labelled (8 per row)
    batch["labels"] = labels
    labelled = torch.zeros_like(labels, dtype=torch.bool)
    labelled[:, :-1] = labels[:, 1:] != -100
    real = batch["attention_mask"].bool()
    first, last = _first_last(real)
    forced = torch.zeros_like(real)
    forced[torch.arange(3), first] = True
    forced[torch.arange(3), last] = True

    answer = tokentune_model("llama", num_tokens=6, selection="answer")
    random = tokentune_model("llama", num_tokens=6, selection="random")
    for mask in _masks(answer, batch, 5):
        assert not (mask & ~forced & ~labelled).any(), "an unlabelled position was drawn before labelled ones"
        assert (mask & labelled).sum() >= 3 * 4
    # With more tokens than labelled positions (and prompt_ratio 1), every labelled position is taken, the rest
    # filled randomly.
    big = tokentune_model("llama", num_tokens=14, selection="answer", prompt_ratio=1.0)
    for mask in _masks(big, batch, 3):
        assert not (labelled & real & ~mask).any()
        assert mask.sum(dim=1).tolist() == [14, min(14, int(real[1].sum())), 14]
    # Control: random selection does pick unlabelled positions on this batch.
    assert any((mask & ~forced & ~labelled).any() for mask in _masks(random, batch, 5))


def test_seed_reproducible_and_redrawn_every_forward():
    batch = make_batch("llama", length=24)
    first = _masks(tokentune_model("llama", seed=1234), batch, 3)
    second = _masks(tokentune_model("llama", seed=1234), batch, 3)
    other = _masks(tokentune_model("llama", seed=4321), batch, 3)
    for a, b in zip(first, second):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], first[1]) and not torch.equal(first[1], first[2])
    assert any(not torch.equal(a, b) for a, b in zip(first, other))


def test_task_type_is_as_documented():
    # guards the test matrix itself: ViT goes through the plain PeftModel (forward bypasses the tuner)
    assert TASK_TYPES["vit"] is None
    assert type(tokentune_model("vit")).__name__ == "PeftModel"


# ---------------------------------------------------------------------------------------------- properties


def _bool_matrix(batch: int, length: int):
    row = st.lists(st.booleans(), min_size=length, max_size=length)
    return st.lists(row, min_size=batch, max_size=batch).map(torch.tensor)


@st.composite
def _selection_case(draw):
    batch, length = draw(st.integers(1, 4)), draw(st.integers(1, 12))
    real, labelled = draw(_bool_matrix(batch, length)), draw(_bool_matrix(batch, length))
    selection = draw(st.sampled_from(["random", "answer"]))
    # the whole budget; other prompt ratios: test_answer_selection.py
    fill = {"prompt_ratio": 1.0} if selection == "answer" else {}
    if draw(st.booleans()):
        config = TokenTuneConfig(token_ratio=draw(st.floats(0.01, 1.0)), selection=selection, **fill)
    else:
        config = TokenTuneConfig(num_tokens=draw(st.integers(1, 15)), selection=selection, **fill)
    keep_first, keep_last = draw(st.booleans()), draw(st.booleans())
    return config, real, labelled, keep_first, keep_last, draw(st.integers(0, 2**31))


@settings(max_examples=30, deadline=None)
@given(_selection_case())
def test_draw_selection_properties(case):
    config, real, labelled, keep_first, keep_last, seed = case
    forced = forced_positions(real, keep_first=keep_first, keep_last=keep_last)
    mask = draw_selection(config, real, forced, labelled, torch.Generator().manual_seed(seed))
    assert mask.dtype == torch.bool and mask.shape == real.shape
    assert not (mask & ~real).any()
    assert not (forced & ~mask).any()
    for row in range(real.shape[0]):
        n_real = int(real[row].sum())
        if config.num_tokens is not None:
            wanted = min(config.num_tokens, n_real)
        else:
            wanted = min(max(math.ceil(config.token_ratio * n_real), 1), n_real)
        assert int(mask[row].sum()) == max(wanted, int(forced[row].sum()))
        if config.selection == "answer":
            free = real[row] & ~forced[row]
            skipped_labelled = (free & labelled[row] & ~mask[row]).any()
            took_unlabelled = (free & ~labelled[row] & mask[row]).any()
            assert not (skipped_labelled and took_unlabelled)
    # The same generator state gives the same draw.
    again = draw_selection(config, real, forced, labelled, torch.Generator().manual_seed(seed))
    assert torch.equal(mask, again)


@settings(max_examples=30, deadline=None)
@given(st.integers(1, 4).flatmap(lambda b: st.integers(1, 10).flatmap(lambda n: _bool_matrix(b, n))))
def test_token_selection_from_mask_properties(mask):
    selection = TokenSelection.from_mask(mask)
    batch, length = mask.shape
    counts = mask.sum(dim=1)
    width = max(int(counts.max()), 1)
    assert selection.index.shape == selection.valid.shape == (batch, width)
    assert torch.equal(selection.valid.sum(dim=1), counts)
    for row in range(batch):
        index = selection.index[row].tolist()
        assert len(set(index)) == len(index)  # distinct positions
        n = int(counts[row])
        assert index[:n] == mask[row].nonzero().flatten().tolist()  # selected positions first, in order
        assert selection.valid[row, :n].all() and not selection.valid[row, n:].any()
        assert not mask[row, index[n:]].any()  # padding slots hold unselected positions

    # gather/scatter along the sequence dim and along dim 2 (the attention layout [B, H, L, D])
    full = torch.randn(batch, length, 3)
    part = torch.randn(batch, width, 3, requires_grad=True)
    merged = selection.scatter(full, part, dim=1)
    expected = full.clone()
    for row in range(batch):
        for slot in range(width):
            if selection.valid[row, slot]:
                expected[row, selection.index[row, slot]] = part[row, slot].detach()
    assert torch.equal(merged.detach(), expected)
    merged.sum().backward()
    assert torch.equal(part.grad[..., 0], selection.valid.float())  # no gradient into invalid slots
    assert torch.equal(selection.gather(expected, 1)[selection.valid], part.detach()[selection.valid])

    full4 = torch.randn(batch, 2, length, 3)
    part4 = selection.gather(full4, 2) + 1.0
    merged4 = selection.scatter(full4, part4, dim=2)
    assert torch.equal(merged4.transpose(1, 2)[mask], (full4 + 1.0).transpose(1, 2)[mask])
    assert torch.equal(merged4.transpose(1, 2)[~mask], full4.transpose(1, 2)[~mask])
