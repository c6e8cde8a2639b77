"""SlimFit under transformers.Trainer: one scheduler step per optimizer step, and the schedule in checkpoints."""

from __future__ import annotations

from transformers import TrainerCallback

from ..compat import ExportableState, stored_callback_attribute
from .transform import find_slimfit


class SlimFitCallback(TrainerCallback, ExportableState):
    """Attaches the Trainer's optimizer (``slimfit_attach``), calls ``slimfit_step`` after every optimizer step, and
    saves the schedule in every checkpoint (restored on resume). When the Trainer is built and when training ends,
    every unit requires grad again, so that another optimizer on the model holds them all."""

    def __init__(self):
        self.scheduler_state: dict | None = None
        self._tuner = None

    def on_init_end(self, args, state, control, model=None, **kwargs):
        tuner = find_slimfit(model) if model is not None else None
        if tuner is not None and not tuner.slimfit_paused:
            tuner._unfreeze()  # the Trainer builds its optimizer from what requires grad when train() starts

    def on_train_begin(self, args, state, control, model=None, optimizer=None, **kwargs):
        self._tuner = find_slimfit(model) if model is not None else None
        if self._tuner is None:
            raise ValueError(
                "SlimFitCallback: the Trainer's model has no SlimFit: wrap it with get_peft_model(model, "
                "SlimFitConfig(lora=...)) or apply peft_slim.slimfit_(model, SlimFitConfig()) first."
            )
        if self._tuner.slimfit_paused:
            raise ValueError(
                "SlimFitCallback: the SlimFit schedule is paused (model.slimfit_pause()). Call model.slimfit_resume() "
                "before trainer.train(), or train without SlimFitCallback to train every unit."
            )
        restored = self.scheduler_state
        if restored is None and state.global_step > 0:  # resuming: the checkpoint's trainer_state.json has it
            restored = stored_callback_attribute(state, self, "scheduler_state")
        if restored is not None:
            self._tuner.load_slimfit_state_dict(restored)
        self.scheduler_state = None
        if optimizer is not None:
            self._tuner.slimfit_attach(optimizer)

    def on_step_end(self, args, state, control, optimizer=None, **kwargs):
        self._tuner.slimfit_step(optimizer)  # used only with release_frozen_optimizer_state

    def on_train_end(self, args, state, control, **kwargs):
        self._tuner._unfreeze()

    def state(self) -> dict:
        scheduler_state = self._tuner.slimfit_state_dict() if self._tuner is not None else None
        return {"args": {}, "attributes": {"scheduler_state": scheduler_state}}
