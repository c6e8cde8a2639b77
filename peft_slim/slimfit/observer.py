"""Watch optimizer steps: snapshot the training units right before a step, score their change right after.

Global optimizer step hooks (``torch.optim.optimizer.register_optimizer_step_*_hook``) fire for every
optimizer, including ones built by Trainer or accelerate, so the user's loop needs no extra call
for scoring. The snapshot is taken after backward, when activations are freed, so it never adds to the
activation peak.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .scheduler import unit_score
from .units import Unit


class StepObserver:
    """Scores of the units trained in each optimizer step, collected until ``take_scores()``."""

    def __init__(
        self,
        units: list[Unit],
        is_training: Callable[[int], bool],
        metric: str,
        epsilon: float,
        resolve: Callable[[], None] | None = None,
    ):
        self.units = units
        self.resolve = resolve  # re-points units at the model's current parameters (FSDP2 replaces them)
        self.is_training = is_training
        self.metric = metric
        self.epsilon = epsilon
        self.steps_since_take = 0
        self._scores: dict[int, float] = {}
        self._snapshot: dict[int, list[torch.Tensor]] | None = None
        self._warned_missing = False
        self._last_optimizer: weakref.ref | None = None
        self._unit_of = {id(p): index for index, unit in enumerate(units) for p in unit.params}
        ref = weakref.ref(self)  # the global hooks must not keep a discarded tuner alive
        self._handles = [
            register_optimizer_step_pre_hook(lambda opt, args, kwargs: _call(ref, "_before_step", opt)),
            register_optimizer_step_post_hook(lambda opt, args, kwargs: _call(ref, "_after_step", opt)),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    @property
    def last_optimizer(self) -> torch.optim.Optimizer | None:
        """The optimizer that last stepped over these units (None if none did, or it is gone)."""
        return self._last_optimizer() if self._last_optimizer is not None else None

    def take_scores(self) -> dict[int, float]:
        scores, self._scores = self._scores, {}
        self.steps_since_take = 0
        return scores

    def _before_step(self, optimizer: torch.optim.Optimizer) -> None:
        if self._snapshot is not None:
            return  # a wrapper's step (accelerate) around the inner optimizer's: one snapshot
        if self.resolve is not None:  # the optimizer holds the parameters the model holds between steps
            self.resolve()
            self._unit_of = {id(p): index for index, unit in enumerate(self.units) for p in unit.params}
        in_optimizer = {id(p) for group in optimizer.param_groups for p in group["params"]}
        mine = {index for pid, index in self._unit_of.items() if pid in in_optimizer}
        if not mine:
            return  # another model's optimizer
        self._warn_if_missing(in_optimizer)
        self._last_optimizer = weakref.ref(optimizer)
        self._snapshot = {
            index: [p.detach().clone() for p in self.units[index].params] for index in mine if self.is_training(index)
        }

    def _after_step(self, optimizer: torch.optim.Optimizer) -> None:
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None:
            return
        self.steps_since_take += 1
        with torch.no_grad():
            for index, before in snapshot.items():
                self._scores[index] = unit_score(self.metric, before, self.units[index].params, self.epsilon)
        if self.steps_since_take == 2:
            warnings.warn(
                "SlimFit: the optimizer stepped twice without model.slimfit_step(); the frozen set does not change "
                "until it is called (after each optimizer.step(), or use peft_slim.SlimFitCallback with Trainer).",
                stacklevel=5,  # the optimizer.step() call: _call, the hook lambda, torch's step wrapper
            )

    def _warn_if_missing(self, in_optimizer: set[int]) -> None:
        if self._warned_missing:  # once is enough: skip the scan on every later step
            return
        missing = [unit.name for unit in self.units if any(id(p) not in in_optimizer for p in unit.params)]
        if missing:
            self._warned_missing = True
            warnings.warn(
                f"SlimFit: {len(missing)} scheduled unit(s) are not in the optimizer (e.g. {missing[:3]}); they will "
                "never change. Build the optimizer before the first training forward, from every parameter that "
                "requires grad at that point (SlimFit freezes units only once training starts).",
                stacklevel=6,
            )


def _call(ref: weakref.ref, method: str, optimizer: torch.optim.Optimizer) -> None:
    observer = ref()
    if observer is not None:
        getattr(observer, method)(optimizer)
