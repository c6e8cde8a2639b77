"""SlimFit's rules beyond the paper's: byte-aware freezing, the catch-up update, norms that always train, scores
computed on the device."""

from __future__ import annotations

import math

import pytest
import torch
from helpers.slimfit_cases import loss_of, slimfit_model, train
from helpers.tiny_models import make_batch
from hypothesis import given, settings
from hypothesis import strategies as st

from peft_slim import SlimFitConfig
from peft_slim.slimfit.config import rotation_steps
from peft_slim.slimfit.scheduler import FreezeScheduler


def unit_bytes(unit) -> int:
    return sum(p.numel() * p.element_size() for p in unit.params)


# ---------------------------------------------------------------------------------------------- freeze_by="bytes"


def priority(scheduler: FreezeScheduler, unit: int) -> tuple:
    """The order in which units claim the budget, by definition: units frozen for max_frozen_steps or more first
    (longest frozen first), then the highest score; ties by the seeded sweep order."""
    starving = scheduler.frozen_for[unit] >= scheduler.max_frozen_steps
    if starving:
        return (0, -scheduler.frozen_for[unit], scheduler.sweep_rank[unit])
    return (1, -scheduler.scores[unit], scheduler.sweep_rank[unit])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 1000), min_size=1, max_size=30),
    ratio=st.floats(0.0, 0.95),
    max_frozen=st.integers(1, 8),
    seed=st.integers(0, 2**31),
)
def test_bytes_rule_fills_the_budget_in_rank_order(sizes, ratio, max_frozen, seed):
    """At every step the trained units hold at most (1 - ratio) of all bytes (or the smallest unit's), at least one
    trains, and a frozen unit is one that did not fit what the units ahead of it left; a unit larger than the
    budget never trains."""
    budget = max((1 - ratio) * sum(sizes), min(sizes))  # at least the smallest unit: one always trains
    scheduler = FreezeScheduler(len(sizes), ratio, 1, max_frozen, seed, sizes)
    assert scheduler.too_large == [u for u, size in enumerate(sizes) if size > budget]
    scores = torch.rand(len(sizes), generator=torch.Generator().manual_seed(seed)).tolist()
    for _ in range(3 * len(sizes)):
        trained = scheduler.trained
        assert 0 < sum(size for size, t in zip(sizes, trained) if t) <= budget + 1e-6
        order = sorted(range(len(sizes)), key=lambda u: priority(scheduler, u))
        left = budget
        for unit in order:
            if trained[unit]:
                left -= sizes[unit]
            else:
                assert sizes[unit] > left, f"unit {unit} ({sizes[unit]} bytes) fits the {left} left but froze"
        assert not any(trained[u] for u in scheduler.too_large)
        scheduler.advance({u: scores[u] for u, t in enumerate(trained) if t})


def test_bytes_rule_in_a_model_caps_the_gradient_bytes():
    """In a real model: the gradients of scheduled units hold at most (1 - ratio) of their bytes at every step,
    and a unit larger than that budget never gets a gradient (with a warning naming it)."""
    with pytest.warns(UserWarning, match="larger than the byte budget") as caught:
        model = slimfit_model("bert", freeze_ratio=0.8, freeze_by="bytes")
    tuner = model.base_model
    total = sum(unit_bytes(unit) for unit in tuner._state.units)
    too_large = [unit for unit in tuner._state.units if unit_bytes(unit) > 0.2 * total]
    assert too_large and all(unit.name in str(caught[0].message) for unit in too_large)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    model.train()
    for step in range(6):
        loss_of(model, make_batch("bert", seed=step)).backward()
        held = sum(
            p.grad.numel() * p.grad.element_size() for u in tuner._state.units for p in u.params if p.grad is not None
        )
        assert 0 < held <= 0.2 * total + 1e-6
        assert all(p.grad is None for unit in too_large for p in unit.params)
        optimizer.step()
        optimizer.zero_grad()
        model.slimfit_step()


def test_count_rule_is_the_papers():
    """freeze_by='count': exactly max(1, n - floor(ratio n)) units train, whatever their sizes."""
    model = slimfit_model("bert", freeze_ratio=0.8, freeze_by="count")
    tuner = model.base_model
    assert tuner.scheduler.sizes is None
    assert sum(tuner.scheduler.trained) == max(1, len(tuner._state.units) - math.floor(0.8 * len(tuner._state.units)))


# ---------------------------------------------------------------------------------------------- catch-up


CATCH_UP_FACTOR = {"linear": lambda k: k, "sqrt": math.sqrt, "none": lambda k: 1.0}


@pytest.mark.parametrize("metric", ["relative_change", "gradient"])
@pytest.mark.parametrize("catch_up", ["linear", "sqrt", "none"])
def test_catch_up_scales_the_update_by_the_missed_steps(catch_up, metric):
    """With plain SGD the optimizer's update is -lr * grad: a unit that trains after f frozen steps moves by
    -lr * grad * g(k), k = min(f + 1, 1 / (1 - ratio)), g(k) = k ('linear'), sqrt(k) ('sqrt'), 1 ('none'); frozen
    units do not move at all (bit-identical)."""
    ratio, lr = 0.75, 0.1
    model = slimfit_model("bert", freeze_ratio=ratio, freeze_by="count", catch_up=catch_up, metric=metric)
    assert model.peft_config["default"].catch_up == catch_up
    tuner = model.base_model
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=lr)
    model.slimfit_attach(optimizer)
    model.train()
    seen_factors = set()
    for step in range(10):
        loss_of(model, make_batch("bert", seed=step)).backward()
        frozen_for = list(tuner.scheduler.frozen_for)
        before = [[p.detach().clone() for p in unit.params] for unit in tuner._state.units]
        grads = [[None if p.grad is None else p.grad.clone() for p in unit.params] for unit in tuner._state.units]
        trained = list(tuner.scheduler.trained)
        optimizer.step()
        for index, unit in enumerate(tuner._state.units):
            factor = CATCH_UP_FACTOR[catch_up](min(frozen_for[index] + 1, 1 / (1 - ratio)))
            for p, old, grad in zip(unit.params, before[index], grads[index]):
                if not trained[index]:
                    assert torch.equal(p, old), unit.name
                else:
                    seen_factors.add(factor)
                    torch.testing.assert_close(p.detach(), old - lr * factor * grad, rtol=1e-5, atol=1e-6)
        optimizer.zero_grad()
        model.slimfit_step()
    assert seen_factors == {CATCH_UP_FACTOR[catch_up](k) for k in (1.0, 2.0, 3.0, 4.0)}


def test_catch_up_does_not_change_the_scores():
    """The scores rank the optimizer's own update: over the first sweep (two steps at ratio 0.5; the second step's
    units missed one step, so catch-up doubles their update) both runs score alike, though their weights differ."""
    scores, weights = [], []
    for catch_up in ("linear", "none"):
        model = slimfit_model("bert", freeze_ratio=0.5, freeze_by="count", catch_up=catch_up)
        sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
        model.slimfit_attach(sgd)
        train(model, "bert", steps=2, optimizer=sgd)
        scores.append(model.base_model.scheduler.scores)
        weights.append(torch.cat([p.detach().flatten() for p in model.parameters()]))
    assert not any(math.isinf(s) for s in scores[0])
    assert scores[0] == pytest.approx(scores[1], rel=1e-5)
    assert not torch.equal(weights[0], weights[1])


# ---------------------------------------------------------------------------------------------- norms, scores


def test_norms_always_train_and_are_no_unit():
    model = slimfit_model("bert", freeze_ratio=0.9, always_train_norms=True)
    tuner = model.base_model
    norms = [n for n, m in model.base_model.model.named_modules() if isinstance(m, torch.nn.LayerNorm)]
    assert norms and not any(name.startswith(tuple(norms)) for name in tuner.unit_names)
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    model.train()
    for step in range(3):
        loss_of(model, make_batch("bert", seed=step)).backward()
        for name in norms:
            module = tuner.model.get_submodule(name)
            assert module.weight.grad is not None and module.bias.grad is not None, name
        optimizer.step()
        optimizer.zero_grad()
        model.slimfit_step()
    plain = slimfit_model("bert", freeze_ratio=0.9, always_train_norms=False)
    assert any("LayerNorm" in name for name in plain.base_model.unit_names)


@pytest.mark.parametrize("metric", ["relative_change", "update_norm", "gradient"])
def test_scores_of_a_step_follow_their_definition(metric):
    """The device-side scores (torch._foreach_*) equal the definition computed here tensor by tensor, in float64;
    'gradient' from the gradients the backward left (a tensor without one counts as zeros)."""
    eps = 1e-3
    model = slimfit_model("llama", freeze_ratio=0.5, freeze_by="count", metric=metric, epsilon=eps)
    tuner = model.base_model
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    model.train()
    loss_of(model, make_batch("llama")).backward()
    trained = [u for u, t in enumerate(tuner.scheduler.trained) if t]
    before = {u: [p.detach().double() for p in tuner._state.units[u].params] for u in trained}
    grads = {
        u: [torch.zeros_like(p) if p.grad is None else p.grad.double() for p in tuner._state.units[u].params]
        for u in trained
    }
    optimizer.step()
    optimizer.zero_grad()
    model.slimfit_step()
    for u in trained:
        olds, news = before[u], [p.detach().double() for p in tuner._state.units[u].params]
        if metric == "relative_change":
            total = sum(((n - o).abs() / (o.abs() + eps)).sum().item() for o, n in zip(olds, news))
            expected = total / sum(o.numel() for o in olds)
        elif metric == "gradient":
            expected = sum(g.abs().sum().item() for g in grads[u]) / sum(g.numel() for g in grads[u])
        else:
            change = math.sqrt(sum((n - o).pow(2).sum().item() for o, n in zip(olds, news)))
            expected = change / (math.sqrt(sum(o.pow(2).sum().item() for o in olds)) + eps)
        assert tuner.scheduler.scores[u] == pytest.approx(expected, rel=1e-5), tuner._state.units[u].name


# ---------------------------------------------------------------------------------------------- defaults, old files


def test_new_configs_use_the_measured_defaults():
    config = SlimFitConfig()
    assert (config.freeze_by, config.catch_up, config.always_train_norms) == ("bytes", "linear", True)
    assert config.max_frozen_steps is None  # one round: rotation_steps(freeze_ratio)


@pytest.mark.parametrize(("ratio", "steps"), [(0.0, 1), (0.5, 1), (0.6, 2), (0.7, 3), (0.8, 4), (0.9, 9), (0.95, 19)])
def test_rotation_steps_is_one_round_less_one(ratio, steps):
    """ceil(1 / (1 - ratio)) - 1, by hand (1 / (1 - 0.8) is 5.000000000000001 in floats: still 4)."""
    assert rotation_steps(ratio) == steps


@settings(max_examples=60, deadline=None)
@given(num_units=st.integers(1, 40), ratio=st.floats(0.0, 0.95), seed=st.integers(0, 2**31))
def test_the_default_rotation_trains_every_unit_once_per_round(num_units, ratio, seed):
    """With max_frozen_steps=None and the count rule, no unit waits more than ceil(1 / (1 - ratio)) - 1 steps,
    even when fixed scores would keep the same units training forever."""
    scheduler = FreezeScheduler(num_units, ratio, 1, rotation_steps(ratio), seed)
    scores = {u: float(u) for u in range(num_units)}  # unit order decides: the low ones would starve
    longest = [0] * num_units
    for _ in range(4 * num_units + 20):
        scheduler.advance({u: scores[u] for u in range(num_units) if scheduler.trained[u]})
        longest = [max(a, b) for a, b in zip(longest, scheduler.frozen_for)]
    assert max(longest) <= rotation_steps(ratio)


@pytest.mark.parametrize(("given", "used"), [(None, 4), (100, 100), (2, 2)])
def test_the_model_waits_what_the_config_says(given, used):
    model = slimfit_model("bert", freeze_ratio=0.8, max_frozen_steps=given)
    assert model.base_model.scheduler.max_frozen_steps == used


@pytest.mark.parametrize("metric", ["relative_change", "update_norm"])
def test_foreach_path_equals_the_tensor_by_tensor_path(metric, monkeypatch):
    """The CUDA path (torch._foreach_*) computes what the CPU path does, catch-up included: forced here on CPU."""
    from peft_slim.slimfit import observer

    generator = torch.Generator().manual_seed(0)
    shapes = [(3, 4), (5,), (2, 2, 3)]
    olds = [torch.randn(s, generator=generator) for s in shapes]
    news = [o + 0.01 * torch.randn(o.shape, generator=generator) for o in olds]
    factors = [1.0, 3.0, 2.5]
    results = {}
    for fused in (False, True):
        monkeypatch.setattr(observer, "_fused", lambda tensors, fused=fused: fused)
        after = [n.clone() for n in news]
        sums = observer.step_parts(metric, [o.clone() for o in olds], after, 1e-3, factors)
        results[fused] = (sums, after)
    torch.testing.assert_close(results[True][0], results[False][0])
    for o, n, f, a, b in zip(olds, news, factors, results[True][1], results[False][1]):
        torch.testing.assert_close(a, o + f * (n - o))
        torch.testing.assert_close(b, o + f * (n - o))
