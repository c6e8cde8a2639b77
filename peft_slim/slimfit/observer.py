"""Watch optimizer steps through their own step hooks (``attach``): snapshot the training units before a step (after
backward, so never at the activation peak), score their change and apply the catch-up after it.

An unattached optimizer's update shows in the units' version counters and is refused at the next training forward or
``slimfit_step()``. With parameters over several optimizers a unit's score sums over every step between two training
forwards, as if one optimizer had stepped it. The hooks go with the observer; a copy of the model gets its own.
"""

from __future__ import annotations

import warnings
import weakref
from collections.abc import Callable
from functools import partial

import torch

from ..compat import optimizer_running_step_hooks, tensor_version
from .scheduler import DTensor, FreezeScheduler, _item, _tensor_parts, finish_score, score_parts
from .units import Unit

ORDER = "loss.backward(); optimizer.step(); optimizer.zero_grad(); model.slimfit_step()"
# One optimizer step's score parts: unit index and value count of each tensor it stepped, and each tensor's sums (on
# the device until scored: [n], update_norm [n, 2]; host floats under FSDP2).
Parts = tuple[list[int], list[int], "torch.Tensor | list"]


def _plain(tensors: list[torch.Tensor]) -> bool:
    """No DTensor among them (a shard's sums need a reduction)."""
    return not any(isinstance(t, DTensor) for t in tensors)


def _fused(tensors: list[torch.Tensor]) -> bool:
    """Whether to use ``torch._foreach_*``: on CUDA one multi-tensor kernel per operation; on a CPU it loops over
    the tensors in C++ slower than separate operations do (measured: benchmarks/bench_slimfit.py --part scoring)."""
    return all(t.is_cuda for t in tensors)


def snapshot(params: list[torch.Tensor]) -> list[torch.Tensor]:
    fused = params and _fused(params) and _plain(params)
    return torch._foreach_mul(params, 1.0) if fused else [p.detach().clone() for p in params]


def step_parts(
    metric: str, before: list[torch.Tensor], after: list[torch.Tensor], epsilon: float, factors: list[float]
) -> torch.Tensor:
    """Each tensor's score sums over one optimizer step, on the device: relative_change's sum(|after - before| /
    (|before| + eps)) [n]; update_norm's squared norms of the change and of the old values [n, 2]. Consumes
    ``before``; then each tensor moves ``factor`` times the update (catch-up)."""
    if not _fused(after):  # tensor by tensor, one temporary at a time; the sums stay on the device
        sums = [_tensor_parts(metric, o, n, epsilon, f) for o, n, f in zip(before, after, factors)]
        return _stack(sums) if metric == "relative_change" else torch.stack([_stack(p) for p in zip(*sums)], dim=1)
    new, old = [t.detach().float() for t in after], [t.float() for t in before]  # (fp32: the tensors themselves)
    delta = torch._foreach_sub(new, old)
    scaled = [i for i, factor in enumerate(factors) if factor != 1.0]
    if scaled:
        extra = torch._foreach_mul([delta[i] for i in scaled], [factors[i] - 1.0 for i in scaled])
        torch._foreach_add_([after[i] for i in scaled], extra)
    if metric == "relative_change":
        torch._foreach_abs_(delta)
        torch._foreach_abs_(old)
        torch._foreach_add_(old, epsilon)
        torch._foreach_div_(delta, old)
        return _stack(torch._foreach_norm(delta, 1))  # the values are >= 0: their 1-norm is their sum
    change = torch._foreach_pow(torch._foreach_norm(delta, 2), 2)
    size = torch._foreach_pow(torch._foreach_norm(old, 2), 2)
    return torch.stack([_stack(change), _stack(size)], dim=1)


def gradient_sums(params: list[torch.Tensor]) -> torch.Tensor | list[float]:
    """The 'gradient' metric's sums before the step: fp32 sum(|grad|) per tensor (0 without one), on the device [n];
    under FSDP2, host floats reduced over the shards."""
    grads = [p.grad if p.grad is not None else p.new_zeros(()) for p in params]
    sums = [torch.linalg.vector_norm(grad, 1, dtype=torch.float32) for grad in grads]
    return _stack(sums) if _plain(params) else [_item(total) for total in sums]


def scale_updates(before: list[torch.Tensor], after: list[torch.Tensor], factors: list[float]) -> None:
    """Catch-up without scoring: each tensor moves ``factor`` times the optimizer's update; consumes ``before``."""
    for old, new, factor in zip(before, after, factors):
        if factor != 1.0:
            new.add_(old.neg_().add_(new.detach()), alpha=factor - 1.0)


def _stack(sums: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack([s.to(sums[0].device) for s in sums])  # (to the device it is on: itself)


class StepObserver:
    """Scores of the units trained in each training step (forward to forward: any number of optimizer steps),
    collected until ``take_scores()`` (``slimfit_step``)."""

    def __init__(
        self,
        units: list[Unit],
        scheduler: FreezeScheduler,
        metric: str,
        epsilon: float,
        resolve: Callable[[], None],
        guard: Callable[[torch.optim.Optimizer], None],
        catch_up: Callable[[int], float] | None = None,
        always: Callable[[], list[tuple[str, torch.Tensor]]] | None = None,
    ):
        self.units = units
        self.always = always  # () -> the named parameters outside the units that train at every step
        self.catch_up = catch_up  # unit index -> factor of its update (SlimFitConfig.catch_up), None: 1
        self.resolve = resolve  # re-points units at the model's current parameters (FSDP2 replaces them)
        self.guard = guard  # called with an optimizer before it steps over the units; raises if it must not
        self.scheduler = scheduler  # whose `trained` says which units train in this step
        self.metric = metric
        self.epsilon = epsilon
        self.active = True  # False while the schedule is paused: steps are not watched
        self._closed_step: list[Parts] = []  # the parts of the last training step closed since take_scores
        self._parts: list[Parts] = []  # the open training step's score parts, one entry per optimizer step
        self._early_scores: dict[int, float] = {}  # of closed steps before the last one, since take_scores
        self._snapshot: tuple[list[int], list[torch.Tensor], list[torch.Tensor]] | None = None
        self._depth = 0  # nesting of optimizer steps over the units (a wrapper's step around the inner one's)
        self._stepped: set[int] = set()  # ids of unit parameters held by an optimizer that stepped since take
        self._optimizers: list[weakref.ref] = []  # optimizers that stepped over the units since take
        self._last_optimizers: list[weakref.ref] = []
        self._closed = False  # slimfit_step() ran and no training forward since
        self._warned_twice = False
        self._warned_missing = False
        self._check_always = True  # whether the next closed step checks the stepping optimizers hold `always`
        self._held: set[int] = set()  # while _check_always: ids of the parameters of every optimizer that stepped
        self._always_versions: dict[int, int] = {}  # while _check_always: `always`'s versions at the forward
        self._versions: list[tuple[str, torch.Tensor, int]] | None = None  # (unit, param, version) at the forward
        self._register()

    def _register(self) -> None:
        self._attached: weakref.WeakSet = weakref.WeakSet()  # optimizers whose own step hooks call this observer
        self._parked: weakref.WeakSet = weakref.WeakSet()  # attached while not watching: hooked by watch()
        # The hooks hold the observer weakly and go when it is collected, or by remove().
        self._hook_handles = []
        self._finalizer = weakref.finalize(self, _remove_handles, self._hook_handles)

    def remove(self) -> None:
        """Stop watching: every attached optimizer's hooks go (attached again after ``watch()``)."""
        self._versions = None
        self._finalizer()

    def watch(self) -> None:
        """Watch again after ``remove()`` (the adapter is active again), the optimizers attached before included."""
        if not self._finalizer.alive:
            attached = [*self._attached, *self._parked]
            self._register()
            for optimizer in attached:
                self.attach(optimizer)

    def attach(self, optimizer: torch.optim.Optimizer) -> None:
        """Watch ``optimizer``'s steps through its own step hooks (once); a wrapper without them (accelerate's) through
        the optimizer it wraps."""
        optimizer = optimizer_running_step_hooks(optimizer)
        if not self._finalizer.alive:  # not watching (the adapter is parked): hooked once it watches again
            self._parked.add(optimizer)
            return
        if optimizer in self._attached:
            return
        ref = weakref.ref(self)
        self._hook_handles += [
            optimizer.register_step_pre_hook(partial(_call, ref, "_before_step")),
            optimizer.register_step_post_hook(partial(_call, ref, "_after_step")),
        ]
        self._attached.add(optimizer)
        self._check_always = True

    def __getstate__(self) -> dict:
        """A copy watches its own parameters with its own hooks, no optimizer seen; ids become (unit, position)."""
        private = {"_finalizer", "_hook_handles", "_attached", "_parked"}
        state = {key: value for key, value in self.__dict__.items() if key not in private}
        state["_optimizers"], state["_last_optimizers"], state["_held"] = [], [], set()
        state["_versions"], state["_always_versions"] = None, {}
        positions = {id(p): (i, j) for i, unit in enumerate(self.units) for j, p in enumerate(unit.params)}
        state["_stepped"] = sorted(positions[key] for key in self._stepped if key in positions)
        state["_watching"] = self._finalizer.alive
        return state

    def __setstate__(self, state: dict) -> None:
        watching = state.pop("_watching")
        self.__dict__.update(state)
        self._stepped = {id(self.units[i].params[j]) for i, j in state["_stepped"]}
        self._register()
        if not watching:
            self.remove()

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The optimizers that stepped over these units in the latest training step in which any did."""
        return [opt for opt in (ref() for ref in self._last_optimizers) if opt is not None]

    def note_forward(self) -> None:
        """A forward that can produce gradients starts: the previous training step is complete."""
        self._refuse_unattached()
        if self.active:
            self._versions = [(unit.name, p, tensor_version(p)) for unit in self.units for p in unit.params]
            if self._check_always and self.always is not None:
                self._always_versions = {id(p): tensor_version(p) for _, p in self.always()}
        self._finish_step()
        self._closed = False
        self._depth, self._snapshot = 0, None  # a step that raised half-way left these set

    def take_scores(self, stacklevel: int = 1) -> dict[int, float]:
        """Close the training step (``slimfit_step``): the scores since the last call, by unit index."""
        if self._closed and self.active:
            raise RuntimeError(
                "SlimFit: slimfit_step() was called twice without a training forward in between. Call it once per "
                f"step: {ORDER}."
            )
        self._refuse_unattached()
        self._finish_step()
        self._warn_if_missing(stacklevel + 1)
        scores, self._early_scores = self._early_scores, {}
        scores.update(self._step_scores(self._closed_step))  # a later step's score of a unit replaces an earlier one's
        self._closed_step = []
        if self._optimizers:
            self._last_optimizers = self._optimizers
        self._optimizers, self._stepped = [], set()
        self._closed = True
        self._warned_twice = False
        return scores

    def _refuse_unattached(self) -> None:
        """Raise when a unit changed since the last training forward but no attached optimizer stepped over it."""
        versions, self._versions = self._versions, None
        if versions is None or not self.active:
            return
        stepped = self._stepped
        changed = list(dict.fromkeys(n for n, p, v in versions if tensor_version(p) != v and id(p) not in stepped))
        if changed:
            raise RuntimeError(
                f"SlimFit: model.slimfit_attach(optimizer) first: an optimizer that is not attached updated "
                f"{len(changed)} scheduled unit(s) (e.g. {changed[:3]}), so SlimFit could not score them and its "
                "schedule would not follow training. Attach each optimizer once before training "
                f"(peft_slim.SlimFitCallback does it under Trainer); then {ORDER}."
            )

    def _finish_step(self) -> None:
        if self._parts:  # the step closed before, if not taken: to the host (one step's device sums kept, at most)
            self._early_scores.update(self._step_scores(self._closed_step))
            self._closed_step = self._parts
        self._parts = []

    def _step_scores(self, step: list[Parts]) -> dict[int, float]:
        """Scores of one training step from its optimizer steps' parts: the only place device sums reach the host."""
        totals: dict[int, list[float]] = {}
        for indices, counts, sums in step:
            values = sums.tolist() if torch.is_tensor(sums) else sums
            for index, count, value in zip(indices, counts, values):
                # [sum of relative changes or |gradient|, count], or [squared norm of the change, of the old values]
                parts = (value, count) if self.metric != "update_norm" else value
                total = totals.setdefault(index, [0.0, 0.0])
                total[0] += parts[0]
                total[1] += parts[1]
        return {index: finish_score(self.metric, parts, self.epsilon) for index, parts in totals.items()}

    def _before_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Step pre-hook: snapshot the training units the optimizer holds ('gradient' reads their gradients now)."""
        if not self.active:
            return
        held = {id(p) for group in optimizer.param_groups for p in group["params"]}
        if self._check_always:  # any attached optimizer, also one holding only parameters that train at every step
            self._held |= held
        if self._depth:  # a wrapper optimizer's step around its wrapped one's, both attached: one snapshot
            self._depth += 1
            return
        self.resolve()  # the parameters the model holds now, as the optimizer does (FSDP2 replaces them)
        mine = held & {id(p) for unit in self.units for p in unit.params}
        if not mine:
            return  # another model's optimizer
        self.guard(optimizer)
        args = args[1:] if args and args[0] is optimizer else args  # torch passes step's self among them
        if (args[0] if args else kwargs.get("closure")) is not None:
            raise ValueError(
                "SlimFit: optimizer.step(closure) runs the model inside the optimizer step (LBFGS, Lightning's "
                "automatic optimization), where SlimFit cannot score the update. Call optimizer.step() without a "
                f"closure: {ORDER} (Lightning: automatic_optimization=False)."
            )
        if self._closed:
            raise RuntimeError(
                "SlimFit: optimizer.step() was called after model.slimfit_step() with no training forward in "
                "between, which loses the step's scores and the gradients of the units it freezes. Call it after "
                f"the optimizer step: {ORDER} (with several optimizers, after all of their steps)."
            )
        if mine & self._stepped and not self._warned_twice:
            self._warned_twice = True
            warnings.warn(
                "SlimFit: an optimizer stepped twice over the same units without model.slimfit_step(); the frozen "
                "set does not change until it is called (after each optimizer.step(), or use "
                "peft_slim.SlimFitCallback with Trainer).",
                stacklevel=4,  # the optimizer.step() call: _call, torch's step wrapper
            )
        self._depth = 1
        self._stepped |= mine
        if not any(ref() is optimizer for ref in self._optimizers):
            self._optimizers.append(weakref.ref(optimizer))
        training = [(i, p) for i, unit in enumerate(self.units) if self.scheduler.trained[i] for p in unit.params]
        indices, params = [i for i, p in training if id(p) in mine], [p for _, p in training if id(p) in mine]
        with torch.no_grad():
            # 'gradient' reads the gradients now; it needs the old values only for the catch-up
            gradients = gradient_sums(params) if self.metric == "gradient" and params else None
            before = None if gradients is not None and self.catch_up is None else snapshot(params)
        self._snapshot = (indices, params, before, gradients)

    def _after_step(self, optimizer: torch.optim.Optimizer, args: tuple, kwargs: dict) -> None:
        """Step post-hook: score the update of the units and apply the catch-up, in one pass over the tensors."""
        if not self._depth:
            return
        self._depth -= 1
        if self._depth:
            return
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None or not snapshot[1]:
            return
        indices, params, before, gradients = snapshot
        factors = [1.0] * len(indices) if self.catch_up is None else [self.catch_up(index) for index in indices]
        with torch.no_grad():
            if gradients is not None:
                if before is not None:
                    scale_updates(before, params, factors)
                sums = gradients
            elif _plain(params):
                sums = step_parts(self.metric, before, params, self.epsilon, factors)
            else:  # DTensor shards (FSDP2): tensor by tensor, each sum reduced over the shards
                sums = []
                for old, new, factor in zip(before, params, factors):
                    update = new.detach() - old if factor != 1.0 else None
                    parts = score_parts(self.metric, [old], [new], self.epsilon)  # consumes old
                    sums.append(parts[0] if self.metric == "relative_change" else parts)
                    if update is not None:
                        new.add_(update.mul_(factor - 1.0))
        self._parts.append((indices, [p.numel() for p in params], sums))

    def _warn_if_missing(self, stacklevel: int) -> None:
        """Units that trained in this step but that no optimizer which stepped holds: their gradient is lost."""
        if not self._stepped:  # no step at all: skipped (inf gradients under AMP)
            return
        if self._check_always and self.always is not None:
            self._warn_if_always_missing(stacklevel + 1)
        if self._warned_missing:
            return
        trained = [unit for unit, trains in zip(self.units, self.scheduler.trained) if trains]
        missing = [unit.name for unit in trained if any(id(p) not in self._stepped for p in unit.params)]
        if missing:
            self._warned_missing = True
            warnings.warn(
                f"SlimFit: {len(missing)} scheduled unit(s) trained in this step but are in no optimizer that stepped "
                f"(e.g. {missing[:3]}); they will never change. Build the optimizer(s) before the first training "
                "forward, from every parameter that requires grad at that point.",
                stacklevel=stacklevel + 1,
            )

    def _warn_if_always_missing(self, stacklevel: int) -> None:
        """Once per newly attached optimizer: parameters that train at every step but are in no optimizer that stepped
        (one built before get_peft_model holds the originals of PEFT's modules_to_save, not the trained copies)."""
        self._check_always = False
        versions = self._always_versions
        moved = {id(p) for _, p in self.always() if id(p) in versions and tensor_version(p) != versions[id(p)]}
        missing = [name for name, param in self.always() if id(param) not in self._held | moved]
        self._held, self._always_versions = set(), {}
        if missing:
            warnings.warn(
                f"SlimFit: {len(missing)} parameter(s) that train at every step (biases, norms, `always_trainable`, "
                f"`modules_to_save`, new weights) are in no optimizer that stepped (e.g. {missing[:3]}); they will "
                "never change. Build the optimizer(s) after get_peft_model(), from every parameter that requires "
                "grad.",
                stacklevel=stacklevel + 1,
            )


def _call(ref: weakref.ref, method: str, optimizer: torch.optim.Optimizer, args=None, kwargs=None) -> None:
    observer = ref()
    if observer is not None:
        getattr(observer, method)(optimizer, args or (), kwargs or {})


def _remove_handles(handles: list) -> None:
    for handle in handles:
        handle.remove()
