"""The SlimFit tuner: PEFT's entry point for training with most weight tensors frozen at every step."""

from __future__ import annotations

import json
import os
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from ..compat import active_ddp_module
from ..token_selection import TokenSelectionConfig
from ..tuner import MethodTuner
from .base_weights import BaseWeights
from .config import SlimFitConfig
from .observer import StepObserver
from .scheduler import FreezeScheduler
from .units import find_units

# Set to 1 to check, at every freeze decision, that all processes of a distributed run took the same one.
CHECK_RANKS_ENV = "PEFT_SLIM_CHECK_RANKS"


class SlimFitModel(MethodTuner):
    """Freeze most scheduling units at every step, chosen by training dynamics (Ardakani et al., NAACL 2024).

    A frozen unit has ``requires_grad=False`` from the start of the training forward to the optimizer step:
    it gets no gradient (so the optimizer skips it: no weight decay, no momentum), and its layer caches no
    input for backward. The decision is taken before each training forward, in a forward pre-hook on the
    transformers model, so it holds for every PEFT forward path. Optimizer hooks score the units that
    trained; ``slimfit_step()`` re-ranks. With ``tokentune``, the shared token selection is attached too.
    """

    prefix: str = "slimfit_"

    def _token_selection(self, config: SlimFitConfig) -> TokenSelectionConfig | None:
        return config.tokentune

    def _trainable_base_parameters(self, model: nn.Module, config: SlimFitConfig) -> list[str]:
        return [name for name, _ in model.named_parameters()]  # full fine-tuning; the schedule freezes units

    def _setup(self, model: nn.Module, config: SlimFitConfig) -> None:
        self._handles: list = []
        self._observer: StepObserver | None = None
        self._base_weights: BaseWeights | None = None
        self._applied = False
        self._units, always = find_units(model, config)
        if config.lora is None:
            tracked = {id(p) for unit in self._units for p in unit.params} | {id(p) for p in always}
            named = {name: p for name, p in model.named_parameters() if id(p) in tracked}
            self._base_weights = BaseWeights(named, keep_copies=config.keep_base_weights)
        self.scheduler = FreezeScheduler(
            len(self._units), config.freeze_ratio, config.schedule_every, config.max_frozen_steps, config.seed
        )
        if config.inference_mode:
            return
        # Every unit keeps requires_grad=True until the first training forward, so that an optimizer (or DDP)
        # built before it holds them all; freezing starts there.
        self._observer = StepObserver(
            self._units,
            lambda index: self.scheduler.trained[index],
            config.metric,
            config.epsilon,
            resolve=self._resolve_params,
        )
        self._handles.append(model.register_forward_pre_hook(self._before_forward))

    def _remove_method_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        if self._observer is not None:
            self._observer.remove()

    # ------------------------------------------------------------------ the schedule

    @property
    def unit_names(self) -> list[str]:
        return [unit.name for unit in self._units]

    @property
    def trained_units(self) -> list[str]:
        """Units that train at the next step."""
        return [unit.name for unit, trained in zip(self._units, self.scheduler.trained) if trained]

    def slimfit_step(self, optimizer: torch.optim.Optimizer | None = None) -> None:
        """Close a training step: score the units that trained, re-rank, freeze for the next step.

        Call it once after each ``optimizer.step()`` (``SlimFitCallback`` does with Trainer). With
        ``release_frozen_optimizer_state``, the state of long-frozen units is freed from ``optimizer``, by
        default the optimizer that last stepped over the units.
        """
        config = self._config
        scores = self._observer.take_scores() if self._observer is not None else {}
        self.scheduler.advance(scores)
        self._apply_schedule()
        if optimizer is None and self._observer is not None:
            optimizer = self._observer.last_optimizer
        if config.release_frozen_optimizer_state and optimizer is not None:
            self._release_optimizer_state(optimizer, config.release_after_steps)

    def _resolve_params(self) -> None:
        """Point every unit at the parameters the model holds now, found by name: FSDP2's ``fully_shard`` replaces
        them with sharded ones after SlimFit found them (and stale references would keep the full tensors alive)."""
        for unit in self._units:
            unit.params[:] = [self.model.get_parameter(name) for name in unit.param_names]

    def _apply_schedule(self) -> None:
        """Set requires_grad of every unit from the scheduler's decision; frozen units lose any stale gradient."""
        self._resolve_params()
        if os.environ.get(CHECK_RANKS_ENV) == "1":
            check_same_on_all_ranks(self.scheduler.trained, self.scheduler.step)
        for unit, trained in zip(self._units, self.scheduler.trained):
            for param in unit.params:
                param.requires_grad_(trained)
                if not trained:
                    param.grad = None
        self._applied = True

    def _release_optimizer_state(self, optimizer: torch.optim.Optimizer, after: int) -> None:
        state = optimizer.state
        for index, unit in enumerate(self._units):
            if self.scheduler.frozen_for[index] >= after:
                for param in unit.params:
                    state.pop(param, None)

    def slimfit_history(self) -> dict[str, Any]:
        """The freeze pattern so far: unit names, and per completed step which units trained."""
        return {"units": self.unit_names, "trained": [list(row) for row in self.scheduler.history]}

    def export_freeze_pattern(self, path: str) -> str:
        """Write ``slimfit_history()`` as JSON (for plotting); returns ``path``."""
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        with open(path, "w") as handle:
            json.dump(self.slimfit_history(), handle)
        return path

    def slimfit_state_dict(self) -> dict[str, Any]:
        """The scheduler's state (JSON-ready), to resume the same schedule."""
        return {"units": self.unit_names, **self.scheduler.state_dict()}

    def load_slimfit_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("units") != self.unit_names:
            raise ValueError("SlimFit: the scheduler state was saved for other units than this model's.")
        self.scheduler.load_state_dict(state)
        if self._applied:
            self._apply_schedule()

    # ------------------------------------------------------------------ forward path

    def _before_forward(self, model: nn.Module, args: tuple) -> None:
        if not (model.training and torch.is_grad_enabled()):
            return
        check_ddp(active_ddp_module(), self.scheduler)
        if not self._applied:
            self._apply_schedule()

    # ------------------------------------------------------------------ unloading and saving

    def _unload_and_optionally_merge(self, merge: bool = True, **kwargs):
        config = self._config
        if config.lora is None and not merge and self._base_weights.any_changed(self.model):
            if not self._base_weights.kept:
                raise ValueError(
                    "SlimFit trained the base weights in place and did not keep the originals, so unload() cannot "
                    "return the base model. Use merge_and_unload() for the tuned model, reload the base model, or "
                    "set SlimFitConfig(keep_base_weights=True)."
                )
            self._base_weights.restore(self.model)
        if config.lora is None:
            self.model.requires_grad_(True)  # a plain model again
        return super()._unload_and_optionally_merge(merge=merge, **kwargs)

    def _saves_base_tensor(self, name: str, tensor: torch.Tensor) -> bool:
        # Standalone SlimFit trains base tensors in place: save those that changed (modules_to_save are PEFT's).
        return self._base_weights.changed(name, tensor)


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
