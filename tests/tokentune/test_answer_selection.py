"""selection="answer": every position whose prediction carries a loss label and `prompt_ratio` of the others, within
the budget; the labelled ones first where it is short.

Definition (docs/methods.md, TokenTune): a causal LM's position t carries a loss label when labels[t + 1] != -100
(the logit at t is scored against the next token), so the answer positions of a prompt-completion example run from
the last prompt token to the last-but-one completion token. A row of n real tokens, f of them labelled or forced
(first and last real token), trains min(budget, f + ceil(prompt_ratio * (n - f))) positions (at least its forced
ones). Forced positions are taken first; when what is left is smaller than the answer, a uniformly random subset of
the answer is taken; when it is larger, every answer position and a uniformly random subset of the other real
positions.
"""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from peft_slim import TokenTuneConfig
from peft_slim.token_selection.selection import draw_selection, forced_positions


def _bools(batch, length):
    row = st.lists(st.booleans(), min_size=length, max_size=length)
    return st.lists(row, min_size=batch, max_size=batch).map(torch.tensor)


@st.composite
def _case(draw):
    batch, length = draw(st.integers(1, 4)), draw(st.integers(2, 14))
    real = draw(_bools(batch, length))
    answer = draw(_bools(batch, length))
    budget = draw(st.integers(1, 16))
    prompt_ratio = draw(st.sampled_from([0.0, 0.1, 0.3, 0.5, 1.0]) | st.floats(0.0, 1.0))
    return real, answer, budget, prompt_ratio, draw(st.booleans()), draw(st.integers(0, 2**31))


@settings(max_examples=80, deadline=None)
@given(_case())
def test_answer_rule_against_its_definition(case):
    real, answer, budget, prompt_ratio, keep_last, seed = case
    forced = forced_positions(real, keep_first=True, keep_last=keep_last)
    config = TokenTuneConfig(num_tokens=budget, selection="answer", prompt_ratio=prompt_ratio)
    mask = draw_selection(config, real, forced, answer, torch.Generator().manual_seed(seed))
    for row in range(real.shape[0]):
        n_real, n_forced = int(real[row].sum()), int((forced[row] & real[row]).sum())
        first = int(((answer[row] | forced[row]) & real[row]).sum())
        share = first + math.ceil(prompt_ratio * (n_real - first))
        wanted = max(min(budget, n_real, share), n_forced)
        assert int(mask[row].sum()) == wanted
        assert not (mask[row] & ~real[row]).any() and not (forced[row] & ~mask[row]).any()
        free_answer = answer[row] & real[row] & ~forced[row]
        room = wanted - n_forced
        taken = mask[row] & ~forced[row]
        if room >= int(free_answer.sum()):  # the whole answer fits: all of it, the rest from other real tokens
            assert not (free_answer & ~mask[row]).any()
        else:  # the answer does not fit: nothing outside it
            assert not (taken & ~free_answer).any()


def _frequencies(config, real, forced, answer, draws=4000):
    generator = torch.Generator().manual_seed(0)
    counts = torch.zeros(real.shape, dtype=torch.float64)
    for _ in range(draws):
        counts += draw_selection(config, real, forced, answer, generator).double()
    return counts / draws


def test_budget_smaller_than_the_answer_is_uniform_among_answer_positions():
    real = torch.ones(1, 20, dtype=torch.bool)
    answer = torch.zeros_like(real)
    answer[0, 8:18] = True  # 10 answer positions
    forced = forced_positions(real, keep_first=True, keep_last=True)  # positions 0 and 19
    freq = _frequencies(TokenTuneConfig(num_tokens=6, selection="answer"), real, forced, answer)
    assert torch.equal(freq[0, [0, 19]], torch.ones(2, dtype=torch.float64))
    assert freq[0, 1:8].sum() == 0 and freq[0, 18] == 0  # never the prompt
    # 4 of 10 answer positions each draw: p = 0.4; 5 standard deviations of the mean of 4000 draws.
    assert (freq[0, 8:18] - 0.4).abs().max() < 5 * (0.4 * 0.6 / 4000) ** 0.5


def test_budget_larger_than_the_answer_fills_the_rest_uniformly_from_the_prompt():
    real = torch.ones(1, 20, dtype=torch.bool)
    real[0, 18:] = False  # padding is never taken
    answer = torch.zeros_like(real)
    answer[0, 12:17] = True  # 5 answer positions
    forced = forced_positions(real, keep_first=True, keep_last=True)  # positions 0 and 17
    freq = _frequencies(TokenTuneConfig(num_tokens=10, selection="answer"), real, forced, answer)
    assert torch.equal(freq[0, 12:17], torch.ones(5, dtype=torch.float64))
    assert freq[0, 18:].sum() == 0
    # 3 of the 11 other positions (1..11) each draw: p = 3/11.
    p = 3 / 11
    assert (freq[0, 1:12] - p).abs().max() < 5 * (p * (1 - p) / 4000) ** 0.5


def test_the_default_trains_every_answer_position_and_a_share_of_the_prompt():
    """The defaults (token_ratio 0.5, prompt_ratio 0.3) on a 40-token row with a 4-position answer: the answer, the
    forced first and last token and ceil(0.3 * 34) = 11 prompt positions, fewer than the budget's 20; a row whose
    answer is longer than the budget trains 20, answer first."""
    real = torch.ones(2, 40, dtype=torch.bool)
    answer = torch.zeros_like(real)
    answer[0, 30:34] = True
    answer[1, 5:35] = True  # 30 answer positions: more than ceil(0.5 * 40) = 20
    forced = forced_positions(real, keep_first=True, keep_last=True)
    config = TokenTuneConfig()
    assert (config.token_ratio, config.prompt_ratio) == (0.5, 0.3)
    for seed in range(20):
        mask = draw_selection(config, real, forced, answer, torch.Generator().manual_seed(seed))
        assert mask.sum(dim=1).tolist() == [2 + 4 + 11, 20]
        assert mask[0, 30:34].all() and not (mask[1] & ~answer[1] & ~forced[1]).any()


def test_prompt_ratio_one_fills_the_budget_as_before_the_field():
    real = torch.ones(1, 40, dtype=torch.bool)
    answer = torch.zeros_like(real)
    answer[0, 30:34] = True
    forced = forced_positions(real, keep_first=True, keep_last=True)
    for ratio, wanted in ((0.3, 12), (0.5, 20)):
        config = TokenTuneConfig(token_ratio=ratio, prompt_ratio=1.0)
        mask = draw_selection(config, real, forced, answer, torch.Generator().manual_seed(0))
        assert int(mask.sum()) == wanted and mask[0, 30:34].all()


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"prompt_ratio": 1.5}, r"TokenTuneConfig\.prompt_ratio.*\[0, 1\].*1\.5"),
        ({"prompt_ratio": -0.1}, r"TokenTuneConfig\.prompt_ratio.*-0\.1"),
        ({"prompt_ratio": 0.3, "selection": "random"}, r"prompt_ratio applies to selection='answer' only"),
    ],
)
def test_prompt_ratio_refusals_name_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        TokenTuneConfig(**fields)


def test_unknown_selection_names_the_field_and_the_rules():
    with pytest.raises(ValueError, match=r"selection.*\('random', 'answer'\)"):
        TokenTuneConfig(selection="answers_first")


def test_the_default_rule_keeps_every_answer_position_a_training_forward_can():
    """`TokenTuneConfig(lora=...)` as the README writes it selects answer tokens first: on a completion-only batch
    whose answers fit the default budget, every labelled position is selected (with `random`, most would not be)."""
    from helpers.tiny_models import build, make_batch
    from peft import LoraConfig, get_peft_model

    assert TokenTuneConfig().selection == "answer"
    model = get_peft_model(
        build("llama"), TokenTuneConfig(task_type="CAUSAL_LM", lora=LoraConfig(r=2, target_modules=["q_proj"]))
    ).train()
    batch = make_batch("llama", batch=3, length=40)
    batch["labels"][:, :-4] = -100  # the last 4 tokens of each row are the answer: 3 scored positions, 10% of 40
    model(**batch).loss.backward()
    scored = torch.zeros_like(batch["labels"], dtype=torch.bool)
    scored[:, :-1] = batch["labels"][:, 1:] != -100
    assert (model.base_model.last_token_mask[scored]).all()
