"""SlimFit under transformers.Trainer: one scheduler step per optimizer step, and the schedule in checkpoints."""

from __future__ import annotations

from torch import nn
from transformers import TrainerCallback

from ..compat import exportable_state_cls

ExportableState = exportable_state_cls()


def find_slimfit(model: nn.Module):
    """The SlimFit tuner inside ``model`` (a PeftModel, possibly wrapped by DDP/accelerate), or None."""
    from .model import SlimFitModel

    return next((module for module in model.modules() if isinstance(module, SlimFitModel)), None)


class SlimFitCallback(TrainerCallback, ExportableState):
    """Calls ``slimfit_step`` after every optimizer step, and saves the schedule with every checkpoint.

    The scheduler state (scores, frozen ages, sweep order, history) is written into ``trainer_state.json``
    and restored when training resumes from a checkpoint, whether or not
    ``restore_callback_states_from_checkpoint`` is set.
    """

    def __init__(self):
        self.scheduler_state: dict | None = None
        self._tuner = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._tuner = find_slimfit(model) if model is not None else None
        if self._tuner is None:
            raise ValueError("SlimFitCallback: the Trainer's model has no SlimFit adapter.")
        restored = self.scheduler_state
        if restored is None and state.global_step > 0:  # resuming: the checkpoint's trainer_state.json has it
            stored = state.stateful_callbacks.get(type(self).__name__)
            if isinstance(stored, list):
                stored = stored[0] if stored else None
            if isinstance(stored, dict):
                restored = stored.get("attributes", {}).get("scheduler_state")
        if restored is not None:
            self._tuner.load_slimfit_state_dict(restored)
        self.scheduler_state = None

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._tuner.slimfit_step(optimizer)  # used only with release_frozen_optimizer_state

    def state(self) -> dict:
        scheduler_state = self._tuner.slimfit_state_dict() if self._tuner is not None else None
        return {"args": {}, "attributes": {"scheduler_state": scheduler_state}}
