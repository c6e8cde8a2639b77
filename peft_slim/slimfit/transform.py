"""Full fine-tuning with SlimFit: ``peft_slim.slimfit_(model, SlimFitConfig(...))`` schedules the model's own
weights (each weight tensor a unit, by default); the model stays a plain model."""

from __future__ import annotations

from torch import nn

from ..tuner import find_tuner
from ..tuner.transform import MethodTransform, find_transform
from .config import SlimFitConfig
from .model import SlimFitModel, SlimFitSchedule, SlimFitState


class SlimFitTransform(SlimFitSchedule, MethodTransform):
    """What ``slimfit_`` attached to a model: the schedule (``slimfit_step``, ``slimfit_attach``, ...), its token
    selection and compression; ``remove()`` takes them off."""

    config_cls = SlimFitConfig
    transform_name = "slimfit_"
    state_cls = SlimFitState
    trains_lora = False


def slimfit_(model: nn.Module, config: SlimFitConfig) -> SlimFitTransform:
    """Fine-tune ``model``'s own weights with SlimFit (``config`` without ``lora``); returns the handle (in a loop
    ``slimfit_attach(optimizer)`` once, ``slimfit_step()`` after each step; under Trainer ``SlimFitCallback()``)."""
    return SlimFitTransform(model, config)


def find_slimfit(model: nn.Module) -> SlimFitSchedule | None:
    """SlimFit's schedule on ``model`` (possibly wrapped): its PEFT tuner, or the handle of ``slimfit_``; or None."""
    tuner = find_tuner(model, SlimFitModel)
    return find_transform(model, SlimFitTransform) if tuner is None else tuner
