"""benchmarks.selection_probes: the masks keep the answer rule's budget and tiers, and the attention score is the
mean attention the labelled positions pay to each key, as the eager attention weights give it."""

from __future__ import annotations

import math
from unittest.mock import patch

import pytest
import torch
from helpers.tiny_models import LORA_TARGETS, build
from hypothesis import given, settings
from hypothesis import strategies as st
from peft import LoraConfig, get_peft_model

from benchmarks import selection_probes

IGNORE = selection_probes.IGNORE_INDEX


def tiny_lora_llama():
    return get_peft_model(build("llama"), LoraConfig(r=4, target_modules=LORA_TARGETS["llama"]))


def a_batch(lengths: list[int], answers: list[int], width: int) -> dict:
    """Right-padded rows: ``lengths[b]`` real tokens, the last ``answers[b]`` of them labelled."""
    ids = torch.randint(1, 64, (len(lengths), width))
    mask = torch.zeros(len(lengths), width, dtype=torch.long)
    labels = torch.full((len(lengths), width), IGNORE)
    for row, (n, a) in enumerate(zip(lengths, answers)):
        mask[row, :n] = 1
        labels[row, n - a : n] = ids[row, n - a : n]
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}


def test_attention_score_is_the_mean_attention_of_labelled_queries():
    model = tiny_lora_llama()
    batch = a_batch([10, 7], [3, 2], 10)
    score = selection_probes.attention_received(model, batch)
    assert model.training and model.get_base_model().config._attn_implementation == "sdpa"  # restored
    # Independently: eager weights per layer, averaged by hand over layers, heads and the labelled queries.
    model.eval()
    model.get_base_model().config._attn_implementation = "eager"
    with torch.no_grad():
        weights = model(
            input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True
        ).attentions
    model.get_base_model().config._attn_implementation = "sdpa"
    for row, (n, a) in enumerate([(10, 3), (7, 2)]):
        queries = list(range(n - a - 1, n - 1))  # position t predicts t + 1: the last a labels
        expected = sum(w[row, h, q] for w in weights for h in range(4) for q in queries) / (len(weights) * 4 * a)
        assert torch.allclose(score[row], expected, atol=1e-6)


@settings(max_examples=40, deadline=None)
@given(
    rows=st.lists(st.tuples(st.integers(2, 12), st.integers(1, 11)), min_size=1, max_size=4),
    ratio=st.floats(0.05, 1.0),
    probe=st.sampled_from(["recent", "scored"]),
)
def test_probe_masks_keep_the_answer_rules_budget_and_tiers(rows, ratio, probe):
    lengths = [n for n, _ in rows]
    answers = [min(a, n - 1) for n, a in rows]
    batch = a_batch(lengths, answers, 12)
    score = torch.rand(len(rows), 12)
    if probe == "scored":  # the attention probe's ordering, with a known score in place of the forward
        with patch.object(selection_probes, "attention_received", lambda model, batch: score):
            mask = selection_probes.probe_mask("attention", None, batch, ratio, torch.Generator().manual_seed(0))
    else:
        mask = selection_probes.probe_mask("recent", None, batch, ratio, torch.Generator().manual_seed(0))
    labelled = selection_probes.labelled_positions(batch["labels"])
    for row, n in enumerate(lengths):
        chosen = set(mask[row].nonzero().flatten().tolist())
        wanted = min(max(math.ceil(n * ratio), 2), n)
        assert len(chosen) == wanted and max(chosen) < n  # the budget, never padding
        assert {0, n - 1} <= chosen  # first and last real token
        answer = set(labelled[row].nonzero().flatten().tolist())
        if len(answer | {0, n - 1}) <= wanted:
            assert answer <= chosen  # every labelled position while the budget holds them
        prompt = sorted(set(range(n)) - answer - {0, n - 1})
        picked = [p for p in prompt if p in chosen]
        rest = [p for p in prompt if p not in chosen]
        if picked and rest:  # the prompt positions taken are the best-scored ones
            value = torch.arange(12.0) if probe == "recent" else score[row]
            assert min(value[picked]) >= max(value[rest])


def test_unknown_probe_is_refused_by_name():
    with pytest.raises(ValueError, match="probe must be one of"):
        selection_probes.probe_mask("loss", None, a_batch([4], [1], 4), 0.5, torch.Generator())
