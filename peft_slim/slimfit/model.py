"""The SlimFit tuner: PEFT's entry point for training with most weight tensors frozen at every step."""

from __future__ import annotations

import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, ClassVar

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..compat import active_ddp_module
from ..token_selection import TokenSelectionConfig
from ..trainable import peft_wrapped_names
from ..tuner import MethodTuner
from ..tuner.model import AdapterState
from .config import SlimFitConfig, rotation_steps
from .observer import StepObserver
from .scheduler import FreezeScheduler
from .units import Unit, find_units, new_weights

# Set to 1 to check, at every freeze decision, that all processes of a distributed run took the same one.
CHECK_RANKS_ENV = "PEFT_SLIM_CHECK_RANKS"


@dataclass(eq=False)
class SlimFitState(AdapterState):
    """One SlimFit adapter's schedule and what runs it."""

    units: list[Unit] = field(default_factory=list)
    scheduler: FreezeScheduler | None = None
    observer: StepObserver | None = None  # None when loaded for inference
    applied: bool = False  # the schedule's requires_grad is set (since the last training forward)
    paused: bool = False  # slimfit_pause()


class SlimFitSchedule:
    """SlimFit's schedule, shared by its PEFT tuner (``SlimFitModel``: the LoRA adapters are the units) and its
    transform (``slimfit_``: the model's own weights); reads ``self._state``, ``self._config`` and ``self.model``.

    A frozen unit has ``requires_grad=False`` from the start of the training forward (the training context applies
    the decision there, for every forward path) to the optimizer step: no gradient, update or cached input.
    Optimizer hooks score the units that trained; ``slimfit_step()`` re-ranks.
    """

    trains_lora: ClassVar[bool]  # the units: the LoRA adapters (tuner), or the model's own weights (transform)

    def _token_selection(self, config: SlimFitConfig) -> TokenSelectionConfig | None:
        return config.token_selection

    def _setup(self, model: nn.Module, config: SlimFitConfig) -> None:
        state = self._state
        new = [] if self.trains_lora else new_weights(model, config)
        state.units = find_units(model, config, new, lora=self.trains_lora)
        if new and not config.inference_mode:
            warn_new_weights(new, peft_wrapped_names(model, config.modules_to_save))
        sizes = unit_bytes(state.units) if config.freeze_by == "bytes" else None
        waits = rotation_steps(config.freeze_ratio) if config.max_frozen_steps is None else config.max_frozen_steps
        state.scheduler = FreezeScheduler(
            len(state.units), config.freeze_ratio, config.schedule_every, waits, config.seed, sizes
        )
        too_large = [state.units[index].name for index in state.scheduler.too_large]
        if too_large and not config.inference_mode:
            warnings.warn(
                f"SlimFit: {len(too_large)} unit(s) are larger than the byte budget of freeze_ratio="
                f"{config.freeze_ratio} ({1 - config.freeze_ratio:.3g} of the scheduled bytes) and will never train: "
                f"{too_large[:5]}. Lower freeze_ratio, list them in `always_trainable`, or set freeze_by='count'.",
                stacklevel=4,
            )
        if config.inference_mode:
            return
        # Every unit keeps requires_grad=True until the first training forward, so that an optimizer (or DDP)
        # built before it holds them all; freezing starts there.
        state.observer = StepObserver(
            state.units,
            state.scheduler,
            config.metric,
            config.epsilon,
            resolve=self._resolve_params,
            guard=self._before_optimizer_step,
            catch_up=None if config.catch_up == "none" else self._catch_up_factor,
            always=self._always_trained,
        )

    def _remove_method_hooks(self) -> None:
        state = self._active_state()
        if state is not None and state.observer is not None:
            state.observer.remove()

    def _restore_method_hooks(self) -> None:
        state = self._state
        if state.observer is not None:  # not loaded for inference
            state.observer.watch()

    def _freezing(self) -> Callable[[nn.Module], None] | None:
        return None if self._state.observer is None else self._before_forward

    # ------------------------------------------------------------------ the schedule

    @property
    def scheduler(self) -> FreezeScheduler:
        return self._state.scheduler

    @property
    def unit_names(self) -> list[str]:
        return [unit.name for unit in self._state.units]

    @property
    def trained_units(self) -> list[str]:
        """Units that train at the next step."""
        return [unit.name for unit, trained in zip(self._state.units, self.scheduler.trained) if trained]

    def train_largest_units(self) -> list[str]:
        """Make the next step train the largest units the budget takes (the step the memory planner sizes: most
        gradients and optimizer state) until ``slimfit_step()``. Returns their names."""
        sizes = unit_bytes(self._state.units)
        self.scheduler.trained = self.scheduler.fill(sorted(range(len(sizes)), key=lambda u: (-sizes[u], u)))
        self._apply_schedule()
        return self.trained_units

    def _catch_up_factor(self, index: int) -> float:
        """How many steps' worth of update unit ``index`` makes now: k = 1 + the consecutive steps it was frozen (or,
        before it first trained, every step so far), at most 1 / (1 - freeze_ratio); sqrt(k) under 'sqrt'."""
        limit = 1.0 / (1.0 - self._config.freeze_ratio)
        steps = float(min(1 + self.scheduler.frozen_for[index], limit))
        return math.sqrt(steps) if self._config.catch_up == "sqrt" else steps

    def slimfit_step(self, optimizer: torch.optim.Optimizer | list | tuple | None = None) -> None:
        """Close a training step, once after every ``optimizer.step()`` (``SlimFitCallback`` does with Trainer): score
        the units that trained, re-rank, freeze for the next step. With ``release_frozen_optimizer_state``, frees
        long-frozen units' state from ``optimizer`` (one or a list; default: those that last stepped the units)."""
        if self._state.paused:
            raise RuntimeError(
                "SlimFit: slimfit_step() while the schedule is paused (slimfit_pause()): no unit was scheduled, so "
                "there is no step to close. Call model.slimfit_resume() first."
            )
        observer, config = self._state.observer, self._config
        self.scheduler.advance(observer.take_scores(stacklevel=2) if observer is not None else {})
        self._apply_schedule()
        if optimizer is None:
            optimizer = observer.optimizers() if observer is not None else []
        if config.release_frozen_optimizer_state:
            for opt in optimizer if isinstance(optimizer, (list, tuple)) else [optimizer]:
                for index, unit in enumerate(self._state.units):
                    if self.scheduler.frozen_for[index] >= config.release_after_steps:
                        for param in unit.params:
                            opt.state.pop(param, None)

    def slimfit_attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Score the units over ``optimizer``'s steps: once before training, for each optimizer of a plain loop
        (``SlimFitCallback`` does it under Trainer); an unattached optimizer's update is refused."""
        if self._state.observer is not None:
            self._state.observer.attach(optimizer)

    @property
    def slimfit_paused(self) -> bool:
        return self._state.paused

    def slimfit_pause(self) -> None:
        """Until ``slimfit_resume()`` every unit trains, steps are not scored, ``slimfit_step()`` raises."""
        self._unfreeze()
        self._state.paused = True
        if self._state.observer is not None:
            self._state.observer.active = False

    def slimfit_resume(self) -> None:
        """The schedule freezes again from the next training forward, where it stopped."""
        self._state.paused = False
        if self._state.observer is not None:
            self._state.observer.active = True

    def _unfreeze(self) -> None:
        """Every scheduled unit requires grad until the next training forward re-applies the schedule."""
        if self._config.inference_mode:
            return  # loaded for inference: nothing trains
        self._resolve_params()
        for unit in self._state.units:
            for param in unit.params:
                param.requires_grad_(True)
        self._state.applied = False

    def _always_trained(self) -> list[tuple[str, torch.Tensor]]:
        """The parameters outside the units that require grad: those that train at every step."""
        scheduled = {id(p) for unit in self._state.units for p in unit.params}
        return [(name, p) for name, p in self.model.named_parameters() if p.requires_grad and id(p) not in scheduled]

    def _resolve_params(self) -> None:
        """Point every unit at the parameters the model holds now, by name (FSDP2's ``fully_shard`` replaces them)."""
        for unit in self._state.units:
            unit.params[:] = [self.model.get_parameter(name) for name in unit.param_names]

    def _apply_schedule(self) -> None:
        """Set requires_grad of every unit from the scheduler's decision; frozen units lose any stale gradient."""
        state = self._state
        self._resolve_params()
        if os.environ.get(CHECK_RANKS_ENV) == "1":
            check_same_on_all_ranks(state.scheduler.trained, state.scheduler.step)
        for unit, trained in zip(state.units, state.scheduler.trained):
            for param in unit.params:
                param.requires_grad_(trained)
                if not trained:
                    param.grad = None
        state.applied = True

    def slimfit_history(self) -> dict[str, Any]:
        """The freeze pattern so far: unit names, and per completed step which units trained."""
        return {"units": self.unit_names, "trained": [list(row) for row in self.scheduler.history]}

    def slimfit_state_dict(self) -> dict[str, Any]:
        """The scheduler's state (JSON-ready), to resume the same schedule."""
        return {"units": self.unit_names, **self.scheduler.state_dict()}

    def load_slimfit_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("units")
        if saved != self.unit_names:
            saved = saved if isinstance(saved, list) else []
            only_saved = [name for name in saved if name not in self.unit_names]
            only_here = [name for name in self.unit_names if name not in saved]
            raise ValueError(
                f"SlimFit: the scheduler state was saved for other units than this model's (only in the state: "
                f"{only_saved[:5]}; only in this model: {only_here[:5]}). Wrap the model as the run that saved it "
                "did: same model, `units`, `always_trainable`, `always_train_norms` and `train_new_weights` "
                "(train_new_weights=False for a run saved before that field existed)."
            )
        self.scheduler.load_state_dict(state)
        if self._state.applied:
            self._apply_schedule()

    # ------------------------------------------------------------------ forward path

    def _before_forward(self, model: nn.Module) -> None:
        """Before every forward with grad enabled: the schedule applied in train mode, a training step opened."""
        state = self._state
        if not torch.is_grad_enabled() or state.paused:
            return
        if model.training:
            check_ddp(active_ddp_module(), state.scheduler)
            if not state.applied:
                self._apply_schedule()
        state.observer.note_forward()  # any forward that can produce gradients opens a training step

    def _before_optimizer_step(self, optimizer: torch.optim.Optimizer) -> None:
        if not self._state.applied:
            # Only training-mode forwards apply the schedule: a loop training in eval mode reaches its first step with
            # every unit's gradient; the units the schedule freezes drop theirs here, bit-identical as at every step.
            self._apply_schedule()
        # Releasing state pops it; bitsandbytes' *paged* optimizers keep each buffer in a process-wide page manager,
        # so nothing would be freed and each restart would allocate more. (``.optimizer``: accelerate's wrapper.)
        inner = getattr(optimizer, "optimizer", optimizer)
        if self._config.release_frozen_optimizer_state and getattr(inner, "is_paged", False) is True:
            raise ValueError(
                f"SlimFit: release_frozen_optimizer_state=True cannot free the state of {type(inner).__name__} (a "
                "bitsandbytes paged optimizer): its page manager keeps every state buffer, so frozen units' state "
                "would stay and each restart would allocate more. Use bitsandbytes' non-paged AdamW8bit / AdamW (or "
                "torch's AdamW), or set release_frozen_optimizer_state=False to keep all state."
            )


class SlimFitModel(SlimFitSchedule, MethodTuner):
    """Freeze most scheduling units at every step, chosen by training dynamics (Ardakani et al., NAACL 2024): PEFT's
    tuner, whose units are the LoRA adapters (``SlimFitSchedule``)."""

    # The schedule lives on this tuner and advances through slimfit_step(), which a bare model from
    # peft.inject_adapter_in_model could not reach: PEFT refuses direct injection of such tuners (use get_peft_model).
    uses_shared_state = True
    state_cls = SlimFitState
    trains_lora = True

    def _after_set_adapter(self) -> None:
        state = self._state
        # PEFT just made every LoRA weight trainable: freeze the schedule's units again now, since TRL switches to its
        # reference adapter and back between a training forward and its backward (which may recompute it).
        if state.applied and not state.paused:
            self._apply_schedule()


def unit_bytes(units: list[Unit]) -> list[int]:
    return [sum(p.numel() * p.element_size() for p in unit.params) for unit in units]


def warn_new_weights(new: list[str], peft_modules: list[str]) -> None:
    """One warning naming the weights that train at every step because the checkpoint did not provide them."""
    modules = sorted({name.rsplit(".", 1)[0] for name in new})
    shown = ", ".join(modules[:8]) + (f" and {len(modules) - 8} more" if len(modules) > 8 else "")
    head = f"; PEFT's modules_to_save ({', '.join(peft_modules)}) train at every step too" if peft_modules else ""
    warnings.warn(
        f"SlimFit: {len(new)} weight(s) of {len(modules)} module(s) were not in the checkpoint (transformers "
        f"initialised them in from_pretrained): {shown}; they train at every step, outside the schedule "
        f"(train_new_weights=True){head}. Set SlimFitConfig(train_new_weights=False) to schedule them.",
        stacklevel=5,
    )


def check_ddp(ddp: DistributedDataParallel | None, scheduler: FreezeScheduler) -> None:
    """Refuse a DDP wrapper whose reducer would wait forever for the gradients of frozen units."""
    if ddp is None or scheduler.num_trained == scheduler.num_units:
        return
    if not ddp.find_unused_parameters or ddp.static_graph:
        raise ValueError(
            "SlimFit under DistributedDataParallel: frozen units get no gradient, so DDP must look for unused "
            "parameters at every step. Wrap with DistributedDataParallel(model, find_unused_parameters=True) and "
            "without static_graph (transformers.Trainer does so for a PeftModel unless ddp_find_unused_parameters="
            "False or ddp_static_graph=True; with accelerate, pass DistributedDataParallelKwargs("
            "find_unused_parameters=True))."
        )


def check_same_on_all_ranks(trained: list[bool], step: int) -> None:
    """Debug check (``PEFT_SLIM_CHECK_RANKS=1``): every process of a distributed run froze the same units."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return
    masks: list = [None] * dist.get_world_size()
    dist.all_gather_object(masks, "".join("1" if t else "0" for t in trained))
    if any(mask != masks[0] for mask in masks):
        raise RuntimeError(f"SlimFit: processes disagree on which units train at step {step}: {masks}")
