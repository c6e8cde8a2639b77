"""TokenTune under transformers.Trainer: the token-selection generator in checkpoints, so a resumed run is exact."""

from __future__ import annotations

import base64
import warnings

import torch
import torch.distributed as dist
from torch import nn
from transformers import TrainerCallback

from ..compat import ExportableState, stored_callback_attribute
from ..process_rank import rank
from ..token_selection import TokenSelector
from ..tuner import find_tuner
from ..tuner.transform import find_transform


def find_token_selector(model: nn.Module) -> TokenSelector | None:
    """The token selector of the peft_slim tuner or transform on ``model``, or None."""
    tuner = find_tuner(model)
    tuner = find_transform(model) if tuner is None else tuner
    return None if tuner is None else tuner.token_selector


def _world_size() -> int:
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def _encode(selector: TokenSelector) -> str:
    return base64.b64encode(selector.state_dict()["generator_state"].numpy().tobytes()).decode("ascii")


def _decode(text: str) -> dict:
    raw = base64.b64decode(text.encode("ascii"), validate=True)
    return {"generator_state": torch.frombuffer(bytearray(raw), dtype=torch.uint8).clone()}


class TokenTuneCallback(TrainerCallback, ExportableState):
    """Saves each process's token-selection generator in every Trainer checkpoint and restores it on resume (else a
    resumed run draws other positions), gathered from every rank after each step; tells the model which trainer
    trains it (TRL's fused-LM-head call is exact under SFTTrainer only)."""

    def __init__(self):
        self.generator_states: list[str] | None = None  # base64 of each rank's generator state, by rank
        self._selector: TokenSelector | None = None
        self._gathered: list[str] | None = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        self._selector = find_token_selector(model) if model is not None else None
        if self._selector is None:
            raise ValueError(
                "TokenTuneCallback: the Trainer's model has no token selection (a TokenTune adapter, or SlimFit with "
                "`token_selection`); remove the callback, or wrap the model with get_peft_model or apply "
                "peft_slim.tokentune_ first."
            )
        self._selector.set_trainer_args(args)
        stored = self.generator_states
        if stored is None and state.global_step > 0:  # resuming: the checkpoint's trainer_state.json has it
            stored = stored_callback_attribute(state, self, "generator_states")
        if stored is not None:
            self._restore(stored)
        elif state.global_step > 0:
            warnings.warn(
                f"TokenTuneCallback: resuming at step {state.global_step} from a checkpoint without the "
                "token-selection state (written without TokenTuneCallback): the selections from here on differ from "
                "an uninterrupted run's.",
                UserWarning,
                stacklevel=2,
            )
        self.generator_states = None
        self._gathered = None

    def _restore(self, stored) -> None:
        world, here = _world_size(), rank()
        if not isinstance(stored, list) or not all(isinstance(item, str) for item in stored):
            raise ValueError(
                "TokenTuneCallback: the checkpoint's token-selection state is not a list of base64 strings "
                f"(got {type(stored).__name__}); was trainer_state.json edited?"
            )
        if len(stored) != world:
            warnings.warn(
                f"TokenTuneCallback: the checkpoint holds the token-selection state of {len(stored)} processes, "
                f"this run has {world}; process {here} "
                + ("restores the state of the same rank." if here < len(stored) else "keeps its fresh generator.")
                + " Selections differ from an uninterrupted run's.",
                UserWarning,
                stacklevel=3,
            )
        if here < len(stored):
            self._selector.load_state_dict(_decode(stored[here]))

    def on_train_end(self, args, state, control, **kwargs):
        if self._selector is not None:
            self._selector.set_trainer_args(None)

    def on_step_end(self, args, state, control, **kwargs):
        # The main process writes every rank's state: gathered here, before any save of this step.
        if _world_size() > 1 and args.save_strategy != "no":
            gathered: list = [None] * _world_size()
            dist.all_gather_object(gathered, _encode(self._selector))
            self._gathered = gathered

    def state(self) -> dict:
        states = None
        if self._selector is not None:
            states = self._gathered if _world_size() > 1 else [_encode(self._selector)]
        return {"args": {}, "attributes": {"generator_states": states}}
