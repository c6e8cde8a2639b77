"""SlimFit's schedule: units per step, the first sweep, no starvation, scores by their definition, resume."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from helpers.slimfit_cases import loss_of, slimfit_model, train
from helpers.tiny_models import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from peft_slim.slimfit.scheduler import FreezeScheduler, finish_score, score_parts


@settings(max_examples=40, deadline=None)
@given(
    num_units=st.integers(1, 40),
    ratio=st.floats(0.0, 0.99),
    max_frozen=st.integers(1, 12),
    every=st.integers(1, 3),
    seed=st.integers(0, 2**31),
)
def test_scheduler_invariants(num_units, ratio, max_frozen, every, seed):
    """Fixed trained count, a first sweep that trains every unit once, and no unit frozen beyond the limit."""
    scheduler = FreezeScheduler(num_units, ratio, every, max_frozen, seed)
    k = scheduler.num_trained
    assert k == max(1, num_units - math.floor(ratio * num_units))
    generator = torch.Generator().manual_seed(seed)
    scores = torch.rand(num_units, generator=generator).tolist()  # fixed scores: the low ones would starve
    for _ in range(6 * num_units):
        trained = [u for u, t in enumerate(scheduler.trained) if t]
        assert len(trained) == k
        scheduler.advance({u: scores[u] for u in trained})
    history = scheduler.history
    sweep = -(-num_units // k)
    if every == 1:  # the first ceil(n / k) steps train every unit
        assert {u for row in history[:sweep] for u, t in enumerate(row) if t} == set(range(num_units))
    longest = 0
    for unit in range(num_units):
        run = 0
        for row in history:
            run = 0 if row[unit] else run + 1
            longest = max(longest, run)
    # a starving unit trains at the next re-ranking, if a slot is free (k slots for the most starved)
    assert longest <= max_frozen + every - 1 + math.ceil(num_units / k) * every


@pytest.mark.parametrize("max_frozen", [1, 2, 5])
def test_a_unit_frozen_max_frozen_steps_trains_at_the_next_step(max_frozen):
    """The exact starvation bound: frozen for `max_frozen_steps` consecutive steps, a unit trains at the next
    re-ranking (here every step), not one step later, however low its score."""
    scheduler = FreezeScheduler(2, 0.5, 1, max_frozen, seed=0)  # one of two units trains at each step
    scores = [1.0, 1e-6]  # unit 1 always ranks last: only the bound makes it train
    for _ in range(6 * (max_frozen + 1)):
        if scheduler.trained[1] and scheduler.step >= 2:  # after the first sweep (two steps)
            assert scheduler.frozen_for[1] == max_frozen, scheduler.frozen_for
        scheduler.advance({u: scores[u] for u, t in enumerate(scheduler.trained) if t})
    runs, run = [], 0
    for row in scheduler.history[2:]:  # after the sweep
        if row[1]:
            runs.append(run)
            run = 0
        else:
            run += 1
    assert len(runs) >= 4 and set(runs) == {max_frozen}, runs


def test_sweep_order_is_seeded():
    def sweep(seed: int) -> list[int]:
        """The order in which the first sweep trains 20 units, one per step."""
        scheduler = FreezeScheduler(20, 0.95, 1, 100, seed)
        order = []
        for _ in range(20):
            (unit,) = [u for u, t in enumerate(scheduler.trained) if t]
            order.append(unit)
            scheduler.advance({unit: 1.0})
        return order

    assert sorted(sweep(0)) == list(range(20))  # every unit once
    assert sweep(0) == sweep(0), "two schedulers with the same seed should sweep in the same order"
    assert len({tuple(sweep(seed)) for seed in range(4)}) == 4, "different seeds should sweep in different orders"


def test_lowest_scores_freeze_after_the_sweep():
    scheduler = FreezeScheduler(6, 0.5, 1, 100, seed=1)
    scores = [0.1, 0.9, 0.5, 0.3, 0.7, 0.2]
    while any(math.isinf(s) for s in scheduler.scores):
        scheduler.advance({u: scores[u] for u, t in enumerate(scheduler.trained) if t})
    assert [u for u, t in enumerate(scheduler.trained) if t] == [1, 2, 4]  # the three highest


def unit_score(metric: str, before: list[torch.Tensor], after: list[torch.Tensor], epsilon: float) -> float:
    """How much a unit changed in one step, from its tensors before and after (consumes ``before``)."""
    return finish_score(metric, score_parts(metric, before, after, epsilon), epsilon)


def test_unit_score_definitions():
    before = [torch.tensor([1.0, -2.0, 0.0]), torch.tensor([[4.0]])]
    after = [torch.tensor([1.5, -2.0, 0.001]), torch.tensor([[3.0]])]
    eps = 1e-3
    expected = (0.5 / (1 + eps) + 0 + 0.001 / eps + 1 / (4 + eps)) / 4
    assert unit_score("relative_change", [t.clone() for t in before], after, eps) == pytest.approx(expected)
    change = math.sqrt(0.25 + 0.001**2 + 1)
    size = math.sqrt(1 + 4 + 16)
    assert unit_score("update_norm", [t.clone() for t in before], after, eps) == pytest.approx(change / (size + eps))


@pytest.mark.parametrize("arch", ["bert", "vit", "gpt2", "llama"])
def test_units_trained_per_step_and_frozen_units_bit_identical(arch):
    """Under AdamW with weight decay, a frozen unit does not move at all; a trained one does."""
    model = slimfit_model(arch, freeze_ratio=0.8)
    tuner = model.base_model
    units = tuner._state.units
    assert all(p.requires_grad for unit in units for p in unit.params)  # until training starts
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    model.slimfit_attach(optimizer)
    model.train()
    for step in range(5):
        loss_of(model, make_batch(arch, seed=step)).backward()
        trained = list(tuner.scheduler.trained)
        assert sum(trained) == tuner.scheduler.num_trained
        for unit, t in zip(units, trained):
            assert all(p.requires_grad == t for p in unit.params)
            assert all((p.grad is not None) == t for p in unit.params), unit.name
        before = [[p.detach().clone() for p in unit.params] for unit in units]
        optimizer.step()
        # zero_grad(set_to_none=False) leaves zero gradients: the next freeze must still drop them
        optimizer.zero_grad(set_to_none=step % 2 == 0)
        for unit, t, old in zip(units, trained, before):
            same = all(torch.equal(o, p) for o, p in zip(old, unit.params))
            assert same != t, (
                f"step {step}: {unit.name} {'trained' if t else 'frozen'} but {'un' if same else ''}changed"
            )
        model.slimfit_step()


def test_no_task_type_path_freezes_too():
    """A plain PeftModel (no task_type) calls the transformers model directly: the pre-hook still freezes."""
    model = slimfit_model("llama", freeze_ratio=0.9, task_type=None)
    model.train()
    loss_of(model, {k: v for k, v in make_batch("llama").items() if k != "labels"}).backward()
    for unit, t in zip(model.base_model._state.units, model.base_model.scheduler.trained):
        assert all((p.grad is not None) == t for p in unit.params)


def test_lora_units_are_adapter_pairs_and_b_zero_start_scores():
    model = slimfit_model("llama", lora=True, freeze_ratio=0.5)
    tuner = model.base_model
    assert all(len(unit.params) == 2 for unit in tuner._state.units)
    units = tuner._state.units
    assert all({n.split(".lora_")[1].split(".")[0] for n in unit.param_names} == {"A", "B"} for unit in units)
    train(model, "llama", steps=1)
    scored = [s for s in tuner.scheduler.scores if not math.isinf(s)]
    assert scored and all(s > 0 for s in scored), "a pair whose B started at zero must still score its first step"
    matrices = slimfit_model("llama", lora=True, lora_units="matrix")
    assert len(matrices.base_model._state.units) == 2 * len(tuner._state.units)


def test_unit_regex_groups_and_always_trainable():
    model = slimfit_model("llama", units=[r"model\.layers\.(\d+)\..*"], always_trainable=["lm_head"])
    names = model.base_model.unit_names
    layer_units = [n for n in names if n.startswith("model")]
    assert sum("layers" in n for n in layer_units) == 2  # one unit per layer (tiny Llama has 2)
    assert not any("lm_head" in n for n in names)
    model.train()
    loss_of(model, make_batch("llama")).backward()
    assert model.base_model.model.lm_head.weight.grad is not None


def test_starvation_limit_in_a_real_model():
    """No unit stays frozen longer than max_frozen_steps, though its score would keep it frozen.

    21 units, 11 trained per step: the first sweep ends after 2 steps, so the 10 remaining steps are ranked by
    score, and there are enough slots for every starving unit at once: the bound is exactly the limit.
    """
    model = slimfit_model("bert", freeze_ratio=0.5, max_frozen_steps=3)
    train(model, "bert", steps=12)
    history = model.base_model.slimfit_history()["trained"]
    num_units, num_trained = len(history[0]), model.base_model.scheduler.num_trained
    assert num_units - num_trained <= num_trained and -(-num_units // num_trained) <= 2
    longest = []
    for unit in range(num_units):
        run = worst = 0
        for row in history:
            run = 0 if row[unit] else run + 1
            worst = max(worst, run)
        longest.append(worst)
    assert max(longest) <= 3, longest
    # the limit was reached (low scorers would otherwise stay frozen to the end), so it was what held them
    assert 3 in longest, longest


def test_resume_restores_the_schedule():
    """Weights + scheduler state from step 4 continue exactly as the uninterrupted run."""
    straight = slimfit_model("gpt2", freeze_ratio=0.7, seed=3)
    optimizer = train(straight, "gpt2", steps=4)
    state = straight.base_model.slimfit_state_dict()
    weights = {k: v.clone() for k, v in straight.state_dict().items()}
    opt_state = copy.deepcopy(optimizer.state_dict())  # load_state_dict would share the tensors

    resumed = slimfit_model("gpt2", freeze_ratio=0.7, seed=99, base_seed=3)  # another seed: the state must override it
    resumed.load_state_dict(weights)
    resumed.base_model.load_slimfit_state_dict(state)
    opt2 = torch.optim.AdamW([p for p in resumed.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    resumed.slimfit_attach(opt2)
    opt2.load_state_dict(opt_state)
    for step in range(4, 8):
        for model, opt in ((straight, optimizer), (resumed, opt2)):
            model.train()
            torch.manual_seed(step)  # the same dropout masks
            loss_of(model, make_batch("gpt2", seed=step)).backward()
            opt.step()
            opt.zero_grad()
            model.slimfit_step()
    assert straight.base_model.slimfit_history() == resumed.base_model.slimfit_history()
    for (name, a), b in zip(straight.named_parameters(), resumed.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("explicit_optimizer", [False, True])
def test_frozen_units_hold_no_optimizer_state_by_default(explicit_optimizer):
    """The default frees a unit's AdamW state once it is frozen, from the optimizer that stepped (found by the
    step hooks, or passed); a unit trained at the last step keeps it."""
    model = slimfit_model("llama", freeze_ratio=0.8)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    tuner = model.base_model
    model.train()
    for step in range(6):
        loss_of(model, make_batch("llama", seed=step)).backward()
        optimizer.step()
        optimizer.zero_grad()
        model.slimfit_step(optimizer) if explicit_optimizer else model.slimfit_step()
        for index, unit in enumerate(tuner._state.units):
            if tuner.scheduler.frozen_for[index] >= 1:
                assert not any(p in optimizer.state for p in unit.params), unit.name
            elif tuner.scheduler.history[-1][index]:
                assert all(p in optimizer.state for p in unit.params), unit.name


def test_optimizer_state_kept_when_release_is_off():
    model = slimfit_model("llama", freeze_ratio=0.8, release_frozen_optimizer_state=False)
    tuner = model.base_model
    optimizer = train(model, "llama", steps=6, weight_decay=0.01)  # AdamW's default weight decay
    for index, unit in enumerate(tuner._state.units):
        if any(row[index] for row in tuner.scheduler.history):
            assert all(p in optimizer.state for p in unit.params), unit.name
    assert any(frozen >= 1 for frozen in tuner.scheduler.frozen_for)
