"""SlimFit around the training loop: eval outputs before training, disable_adapter() and merge_and_unload(), the
optimizer hooks' lifetime, several optimizers, the order of slimfit_step(), pausing the schedule, a second Trainer,
and load_best_model_at_end."""

from __future__ import annotations

import functools
import gc
import re
import warnings
import weakref

import pytest
import torch
from helpers.slimfit_cases import loss_of, slimfit_model, step_hook_counts, train
from helpers.tiny_models import build, make_batch
from helpers.trainer_cases import slimfit_trainer
from transformers import TrainerCallback

from peft_slim import TokenSelectionConfig
from peft_slim.slimfit.observer import ORDER


def _eval_logits(model, arch: str) -> torch.Tensor:
    model.eval()
    with torch.no_grad():
        return model(**{k: v for k, v in make_batch(arch).items() if k != "labels"}).logits


def _adamw(params) -> torch.optim.AdamW:
    return torch.optim.AdamW([p for p in params if p.requires_grad], lr=1e-2, weight_decay=0.1)


@pytest.fixture
def no_automatic_gc():
    """Hook counts are process-wide: collect earlier tests' models now, and nothing behind the test's back."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


# ---------------------------------------------------------------------------------------------- disable_adapter


def test_untrained_equals_the_base_and_disable_adapter_and_merge_and_unload_are_peft_s():
    for arch in ("bert", "llama"):  # before training, eval outputs are the base model's (full and LoRA)
        base = _eval_logits(build(arch), arch)
        assert torch.equal(_eval_logits(slimfit_model(arch), arch), base)
        assert torch.equal(_eval_logits(slimfit_model(arch, lora=True), arch), base)
    model = slimfit_model("llama", lora=True, freeze_ratio=0.5)
    train(model, "llama", steps=3)
    tuned = _eval_logits(model, "llama")
    assert not torch.equal(tuned, base)
    with model.disable_adapter():
        assert torch.equal(_eval_logits(model, "llama"), base)
    assert torch.equal(_eval_logits(model, "llama"), tuned)
    merged = model.merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_parameters())
    assert torch.allclose(_eval_logits(merged, "llama"), tuned, atol=1e-5)


# ---------------------------------------------------------------------------------------------- hook lifetime


@pytest.mark.parametrize(
    ("how", "fields"),
    [
        ("remove", {}),
        ("merge_and_unload", {"lora": True}),
        ("unload", {"lora": True}),
    ],
)
def test_step_hooks_go_on_unload(how, fields, no_automatic_gc):
    start = step_hook_counts()
    model = slimfit_model("llama", freeze_ratio=0.5, **fields)
    assert step_hook_counts() == start  # no process-wide hook
    optimizer = train(model, "llama", steps=1)
    assert step_hook_counts(optimizer) == (1, 1)  # attached
    getattr(model, how)()
    assert step_hook_counts() == start
    assert step_hook_counts(optimizer) == (0, 0)


@pytest.mark.parametrize("fields", [{}, {"lora": True}, {"token_selection": TokenSelectionConfig(token_ratio=0.5)}])
def test_step_hooks_go_when_the_model_is_collected(fields, no_automatic_gc):
    start = step_hook_counts()
    model = slimfit_model("llama", freeze_ratio=0.5, **fields)
    optimizer = train(model, "llama", steps=2)
    assert step_hook_counts() == start
    assert step_hook_counts(optimizer) == (1, 1)
    collected = weakref.ref(model)
    del model
    gc.collect()
    assert collected() is None
    assert step_hook_counts(optimizer) == (0, 0)


def test_an_attached_optimizer_is_watched_by_its_own_hooks_only():
    """slimfit_attach registers the step hooks on that optimizer, once; an optimizer over other parameters is never
    attached, and the schedule is the same as when attached just before training."""
    attached, plain = slimfit_model("llama", freeze_ratio=0.5), slimfit_model("llama", freeze_ratio=0.5)
    optimizer = torch.optim.AdamW([p for p in attached.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    attached.slimfit_attach(optimizer)
    attached.slimfit_attach(optimizer)
    assert step_hook_counts(optimizer) == (1, 1)
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)
    other.param_groups[0]["params"][0].grad = torch.ones(2)
    other.step()
    assert step_hook_counts(other) == (0, 0)
    train(attached, "llama", steps=3, optimizer=optimizer)
    train(plain, "llama", steps=3)
    assert step_hook_counts(optimizer) == (1, 1)
    assert attached.slimfit_history() == plain.slimfit_history()
    assert attached.base_model.scheduler.state_dict() == plain.base_model.scheduler.state_dict()


class _StepForwarder(torch.optim.Optimizer):
    """As accelerate's AcceleratedOptimizer: an Optimizer that skips Optimizer.__init__ (no step hooks of its own)
    and forwards to the optimizer it wraps."""

    def __init__(self, optimizer):
        self.optimizer = optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def step(self, closure=None):
        return self.optimizer.step(closure)

    def zero_grad(self, set_to_none: bool = True):
        self.optimizer.zero_grad(set_to_none=set_to_none)


def test_a_wrapper_without_step_hooks_is_attached_through_the_optimizer_it_wraps():
    wrapped, plain = slimfit_model("llama", freeze_ratio=0.5), slimfit_model("llama", freeze_ratio=0.5)
    inner = torch.optim.AdamW([p for p in wrapped.parameters() if p.requires_grad], lr=1e-2, weight_decay=0.1)
    wrapper = _StepForwarder(inner)
    wrapped.slimfit_attach(wrapper)
    assert step_hook_counts(inner) == (1, 1)
    train(wrapped, "llama", steps=3, optimizer=wrapper)
    train(plain, "llama", steps=3)
    assert step_hook_counts(inner) == (1, 1)
    assert wrapped.slimfit_history() == plain.slimfit_history()


# ---------------------------------------------------------------------------------------------- several optimizers

LAYER_UNITS = [r"model\.layers\.(\d+)\..*"]  # one unit per layer: the split below cuts through each


def _split_optimizers(model) -> list[torch.optim.Optimizer]:
    """Attention tensors in one AdamW, everything else in another."""
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    return [
        _adamw(p for name, p in named if ".self_attn." in name),
        _adamw(p for name, p in named if ".self_attn." not in name),
    ]


def test_two_optimizers_score_and_train_as_one():
    """Scores (summed over both optimizers' steps), schedule and weights equal a one-optimizer run; no warning."""
    one = slimfit_model("llama", freeze_ratio=0.5, units=LAYER_UNITS)
    two = slimfit_model("llama", freeze_ratio=0.5, units=LAYER_UNITS)
    runs = ((one, [_adamw(one.parameters())]), (two, _split_optimizers(two)))
    for model, optimizers in runs:
        for optimizer in optimizers:
            model.slimfit_attach(optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SlimFit")
        for step in range(6):
            for model, optimizers in runs:
                model.train()
                torch.manual_seed(step)
                loss_of(model, make_batch("llama", seed=step)).backward()
                for optimizer in optimizers:
                    optimizer.step()
                for optimizer in optimizers:
                    optimizer.zero_grad()
                model.slimfit_step()
            assert two.base_model.scheduler.scores == pytest.approx(one.base_model.scheduler.scores, rel=1e-9)
    tuner = two.base_model
    assert tuner.slimfit_history() == one.base_model.slimfit_history()
    assert any(s not in (0.0, float("inf")) for s in tuner.scheduler.scores)
    for (name, a), b in zip(one.named_parameters(), two.parameters()):
        assert torch.equal(a, b), name
    for index, unit in enumerate(tuner._state.units):  # frozen units' state freed from both optimizers
        if tuner.scheduler.frozen_for[index] >= 1:
            assert not any(p in optimizer.state for optimizer in runs[1][1] for p in unit.params), unit.name


def test_stepping_twice_without_slimfit_step_warns():
    model = slimfit_model("llama", freeze_ratio=0.5)
    optimizer = _adamw(model.parameters())
    model.slimfit_attach(optimizer)
    model.train()
    for step in range(2):
        loss_of(model, make_batch("llama", seed=step)).backward()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            optimizer.step()
        optimizer.zero_grad()
        assert any("stepped twice" in str(w.message) for w in caught) == (step == 1)


def test_a_trained_unit_in_no_optimizer_warns():
    model = slimfit_model("llama", freeze_ratio=0.0)
    optimizer = _adamw(p for name, p in model.named_parameters() if "lm_head" not in name)
    model.slimfit_attach(optimizer)
    model.train()
    loss_of(model, make_batch("llama")).backward()
    optimizer.step()
    with pytest.warns(UserWarning, match=r"in no optimizer that stepped \(e\.g\. \['lm_head\.weight'\]\)"):
        model.slimfit_step()


def test_an_optimizer_built_before_get_peft_model_warns():
    """It holds the original classifier, not the modules_to_save copy that trains: the head would never change."""
    model = slimfit_model("bert", lora=True, freeze_ratio=0.0)
    base = model.base_model.model
    classifier = base.classifier.original_module
    optimizer = _adamw([p for name, p in base.named_parameters() if "classifier" not in name and p.requires_grad])
    optimizer.add_param_group({"params": list(classifier.parameters())})
    model.slimfit_attach(optimizer)
    model.train()
    loss_of(model, make_batch("bert")).backward()
    optimizer.step()
    copy = r"\['classifier\.modules_to_save\.default\.weight', 'classifier\.modules_to_save\.default\.bias'\]"
    with pytest.warns(UserWarning, match=rf"train at every step .* in no optimizer that stepped \(e\.g\. {copy}"):
        model.slimfit_step()


def test_an_optimizer_of_only_what_trains_at_every_step_counts():
    """The units in one optimizer, biases, norms and the head in another, which holds no unit: no warning."""
    model = slimfit_model("bert", freeze_ratio=0.5)
    units = {id(p) for unit in model.base_model._state.units for p in unit.params}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizers = [_adamw(p for p in trainable if id(p) in units), _adamw(p for p in trainable if id(p) not in units)]
    for optimizer in optimizers:
        model.slimfit_attach(optimizer)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SlimFit")
        for step in range(2):
            model.train()
            loss_of(model, make_batch("bert", seed=step)).backward()
            for optimizer in reversed(optimizers) if step else optimizers:
                optimizer.step()
                optimizer.zero_grad()
            model.slimfit_step()


# ---------------------------------------------------------------------------------------------- call order


@pytest.mark.parametrize("lora", [False, True])
def test_an_unattached_optimizer_is_refused_naming_slimfit_attach(lora):
    """Nothing process-wide finds an optimizer the loop did not attach: its update of the units, which SlimFit could
    not score, is refused at slimfit_step() (or the next training forward) before the schedule moves on."""
    start = step_hook_counts()
    model = slimfit_model("llama", lora=lora, freeze_ratio=0.5)
    optimizer = _adamw(model.parameters())
    other = torch.optim.SGD([torch.nn.Parameter(torch.ones(2))], lr=0.1)  # another model's: fine
    model.train()
    loss_of(model, make_batch("llama")).backward()
    other.param_groups[0]["params"][0].grad = torch.ones(2)
    other.step()
    optimizer.step()
    assert step_hook_counts() == start and step_hook_counts(optimizer) == (0, 0)
    attach = r"model\.slimfit_attach\(optimizer\) first: an optimizer that is not attached updated"
    with pytest.raises(RuntimeError, match=attach):
        model.slimfit_step()
    assert model.base_model.scheduler.step == 0
    loss_of(model, make_batch("llama", seed=1)).backward()  # a training forward: it checks too
    optimizer.step()
    with pytest.raises(RuntimeError, match=attach):
        model(**make_batch("llama", seed=2))
    model.slimfit_attach(optimizer)  # attached: the steps from here on are scored
    optimizer.zero_grad()
    loss_of(model, make_batch("llama", seed=3)).backward()
    optimizer.step()
    model.slimfit_step()
    assert model.base_model.scheduler.step == 1


def test_slimfit_step_before_the_optimizer_step_is_refused():
    model = slimfit_model("llama", freeze_ratio=0.5)
    optimizer = train(model, "llama", steps=1)
    model.train()
    loss_of(model, make_batch("llama", seed=1)).backward()
    model.slimfit_step()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(RuntimeError, match=r"after model\.slimfit_step\(\).*" + re.escape(ORDER)):
        optimizer.step()
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters()))


@pytest.mark.parametrize("optimizer_cls", [torch.optim.LBFGS, torch.optim.AdamW])
def test_a_step_with_a_closure_is_refused(optimizer_cls):
    """A closure runs the forward inside the step, after the pre-hook's snapshot: the step went unscored."""
    model = slimfit_model("bert")
    optimizer = optimizer_cls([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    model.slimfit_attach(optimizer)
    model.train()

    def closure():
        optimizer.zero_grad()
        loss = loss_of(model, make_batch("bert"))
        loss.backward()
        return loss

    with pytest.raises(ValueError, match=r"optimizer\.step\(closure\) runs the model inside the optimizer step"):
        optimizer.step(closure)
    with pytest.raises(ValueError, match="closure"):
        optimizer.step(closure=closure)
    loss_of(model, make_batch("bert")).backward()  # without one, as documented
    if optimizer_cls is torch.optim.AdamW:
        optimizer.step()
        model.slimfit_step()


def test_slimfit_step_twice_in_one_step_is_refused():
    model = slimfit_model("llama", freeze_ratio=0.5)
    train(model, "llama", steps=1)
    with pytest.raises(RuntimeError, match="twice without a training forward"):
        model.slimfit_step()
    assert model.base_model.scheduler.step == 1


def test_a_skipped_optimizer_step_is_not_an_error():
    """GradScaler skips optimizer.step() on inf gradients and Trainer still ends the step: no error, no warning."""
    model = slimfit_model("llama", freeze_ratio=0.5)
    optimizer = _adamw(model.parameters())
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message="SlimFit")
        model.train()
        loss_of(model, make_batch("llama")).backward()
        optimizer.zero_grad()
        model.slimfit_step()
        train(model, "llama", steps=2, optimizer=optimizer)
    assert model.base_model.scheduler.step == 3


# ---------------------------------------------------------------------------------------------- pause / resume


def test_pause_restores_the_trainable_set_and_resume_continues_the_schedule():
    model = slimfit_model("llama", freeze_ratio=0.8)
    tuner = model.base_model
    wrapped = model.get_nb_trainable_parameters()
    optimizer = train(model, "llama", steps=3)
    assert model.get_nb_trainable_parameters()[0] < wrapped[0]
    state = tuner.slimfit_state_dict()

    model.slimfit_pause()
    assert model.slimfit_paused and model.get_nb_trainable_parameters() == wrapped
    model.train()
    loss_of(model, make_batch("llama", seed=7)).backward()  # paused: every unit trains, nothing is scored
    before = [[p.detach().clone() for p in unit.params] for unit in tuner._state.units]
    optimizer.step()
    optimizer.zero_grad()
    for unit, old in zip(tuner._state.units, before):
        assert all(not torch.equal(o, p) for o, p in zip(old, unit.params)), unit.name
    with pytest.raises(RuntimeError, match="slimfit_resume"):
        model.slimfit_step()
    assert tuner.slimfit_state_dict() == state and model.get_nb_trainable_parameters() == wrapped

    model.slimfit_resume()
    assert not model.slimfit_paused and model.get_nb_trainable_parameters() == wrapped
    loss_of(model, make_batch("llama", seed=8)).backward()  # the schedule freezes again, where it stopped
    for unit, trained in zip(tuner._state.units, tuner.scheduler.trained):
        assert all((p.grad is not None) == trained for p in unit.params), unit.name
    optimizer.step()
    optimizer.zero_grad()
    model.slimfit_step()
    assert tuner.scheduler.step == 4 and tuner.slimfit_history()["trained"][:3] == [
        [c == "1" for c in row] for row in state["history"]
    ]


# Every Trainer here holds the evaluation set too (load_best_model_at_end evaluates on it).
_trainer = functools.partial(slimfit_trainer, evaluate=True)


class _Watch(TrainerCallback):
    """Per optimizer step: did each unit change, and was it scheduled to train."""

    def __init__(self, tuner):
        self.tuner = tuner
        self.steps: list[tuple[list[bool], list[bool]]] = []
        self.optimizer_params: set[int] = set()

    def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
        self.optimizer_params = {id(p) for group in optimizer.param_groups for p in group["params"]}

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self._before = [[p.detach().clone() for p in unit.params] for unit in self.tuner._state.units]

    def on_optimizer_step(self, args, state, control, **kwargs):
        changed = [
            any(not torch.equal(o, p) for o, p in zip(old, unit.params))
            for unit, old in zip(self.tuner._state.units, self._before)
        ]
        self.steps.append((changed, list(self.tuner.scheduler.trained)))


@pytest.mark.parametrize("first", ["trainer", "plain loop"])
def test_a_second_trainer_trains_what_the_config_says(tmp_path, first):
    """After a Trainer run (its on_train_end) or a plain loop (the new Trainer's on_init_end), the next Trainer's
    optimizer holds every unit and each step trains exactly the scheduled ones."""
    model = slimfit_model("llama", freeze_ratio=0.8, seed=5)
    tuner = model.base_model
    wrapped = model.get_nb_trainable_parameters()
    if first == "trainer":
        _trainer(tmp_path / "first", model, steps=3).train()
        assert model.get_nb_trainable_parameters() == wrapped  # on_train_end gave the trainable set back
    else:
        train(model, "llama", steps=3)
    frozen_at_end = {index for index, trained in enumerate(tuner.scheduler.trained) if not trained}

    watch = _Watch(tuner)
    _trainer(tmp_path / "second", model, steps=4, callbacks=[watch]).train()
    assert all(id(p) in watch.optimizer_params for unit in tuner._state.units for p in unit.params)
    assert len(watch.steps) == 4
    for changed, trained in watch.steps:
        assert changed == trained
    trained_now = {index for _, trained in watch.steps for index, t in enumerate(trained) if t}
    assert frozen_at_end & trained_now  # units frozen when the first Trainer ended did train in the second
    assert len(tuner.slimfit_history()["trained"]) == 7


def test_the_callback_attaches_the_trainers_optimizer_before_its_first_step(tmp_path):
    class Hooks(TrainerCallback):
        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):
            self.at_begin = step_hook_counts(optimizer.optimizer)  # accelerate's wrapper: the torch optimizer in it

    model, hooks = slimfit_model("llama", freeze_ratio=0.5), Hooks()
    _trainer(tmp_path, model, steps=2, callbacks=[hooks]).train()
    assert hooks.at_begin == (1, 1)


def test_the_callback_refuses_a_paused_schedule(tmp_path):
    model = slimfit_model("llama", freeze_ratio=0.8)
    model.slimfit_pause()
    with pytest.raises(ValueError, match=r"paused.*slimfit_resume\(\)"):
        _trainer(tmp_path, model, steps=1).train()


# ---------------------------------------------------------------------------------------------- reloading


class _BestAtStep(TrainerCallback):
    """An eval metric that makes checkpoint ``step`` the best one, whatever the losses."""

    def __init__(self, step: int):
        self.step = step

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        metrics["eval_closeness"] = -abs(state.global_step - self.step)


def test_load_best_model_at_end_is_exactly_the_best_checkpoint(tmp_path):
    model = slimfit_model("llama", freeze_ratio=0.8, seed=2)
    trainer = _trainer(
        tmp_path,
        model,
        steps=5,
        callbacks=[_BestAtStep(2)],
        eval_strategy="steps",
        eval_steps=1,
        save_strategy="steps",
        save_steps=1,
        load_best_model_at_end=True,
        metric_for_best_model="closeness",
        greater_is_better=True,
    )
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best.endswith("checkpoint-2")
    history = model.base_model.slimfit_history()["trained"]
    late = [u for u in range(len(history[0])) if not any(r[u] for r in history[:2]) and any(r[u] for r in history[2:])]
    assert late, "no unit trained only after the best checkpoint: the test would prove nothing"
    fresh = type(model.get_base_model()).from_pretrained(best)  # the plain checkpoint Trainer saved
    for (name, a), b in zip(model.named_parameters(), fresh.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("after_pause", [False, True])
def test_training_in_eval_mode_freezes_from_the_first_step(after_pause):
    """A loop training with model.eval() (no dropout): its forwards do not apply the schedule, so the first step
    (and the first after slimfit_resume()) had every unit's gradient; the frozen units still stay bit-identical."""
    model = slimfit_model("bert", freeze_ratio=0.8)
    tuner = model.base_model
    optimizer = _adamw(model.parameters())
    model.slimfit_attach(optimizer)
    if after_pause:
        train(model, "bert", steps=2, optimizer=optimizer)
        model.slimfit_pause()
        model.slimfit_resume()
    model.eval()
    for step in range(3):
        loss_of(model, make_batch("bert", seed=step)).backward()
        before = [[p.detach().clone() for p in unit.params] for unit in tuner._state.units]
        trained = list(tuner.scheduler.trained)
        optimizer.step()
        optimizer.zero_grad()
        model.slimfit_step()
        for unit, old, trains in zip(tuner._state.units, before, trained):
            changed = any(not torch.equal(o, p) for o, p in zip(old, unit.params))
            assert changed == trains, (step, unit.name)
