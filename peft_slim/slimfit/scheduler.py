"""Inter-layer scheduling: which units train at the next step, from how much each changed when it last trained
(bookkeeping over unit indices, its state JSON-ready for Trainer checkpoints); and the scores' sums."""

from __future__ import annotations

import math

import torch

from ..compat import is_fake_tensor

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a build without torch.distributed
    DTensor = ()

NEVER_TRAINED = math.inf


class FreezeScheduler:
    """Rank units by score; the lowest ``freeze_ratio`` of them freeze until the next re-ranking. With ``sizes``
    (bytes per unit) the training units fill, in rank order, a budget of ``1 - freeze_ratio`` of all bytes (at least
    the smallest unit's). Units start with an infinite score, so the first steps sweep every unit in a seeded random
    order (which breaks ties throughout); one frozen ``max_frozen_steps`` steps trains at the next re-ranking.
    """

    def __init__(
        self,
        num_units: int,
        freeze_ratio: float,
        schedule_every: int,
        max_frozen_steps: int,
        seed: int,
        sizes: list[int] | None = None,
    ):
        self.num_units = num_units
        self.num_trained = max(1, num_units - math.floor(freeze_ratio * num_units))
        self.sizes = None if sizes is None else [int(size) for size in sizes]
        # At least one unit trains, as under the count rule: the budget is never below the smallest unit.
        self.budget = None if sizes is None else max((1.0 - freeze_ratio) * sum(self.sizes), min(self.sizes))
        self.schedule_every = schedule_every
        self.max_frozen_steps = max_frozen_steps
        generator = torch.Generator().manual_seed(seed)
        self.sweep_rank = torch.randperm(num_units, generator=generator).tolist()
        self.scores = [NEVER_TRAINED] * num_units
        self.frozen_for = [0] * num_units  # consecutive steps frozen
        self.step = 0
        self.history: list[list[bool]] = []  # per completed step: which units trained
        self.trained = self._rank()

    @property
    def too_large(self) -> list[int]:
        """Units that never train: larger than the whole byte budget (``sizes`` given), else none."""
        return [unit for unit, size in enumerate(self.sizes or []) if size > self.budget]

    def _rank(self) -> list[bool]:
        def key(u: int) -> tuple:  # the starving first, the longest frozen first; then the rest by score
            starving = self.frozen_for[u] >= self.max_frozen_steps
            return (not starving, -self.frozen_for[u] if starving else -self.scores[u], self.sweep_rank[u])

        return self.fill(sorted(range(self.num_units), key=key))

    def fill(self, order: list[int]) -> list[bool]:
        """Which units train, taken in ``order``: the first ``num_trained``, or (by bytes) each that still fits."""
        if self.sizes is None:
            chosen = set(order[: self.num_trained])
        else:
            chosen, left = set(), self.budget
            for unit in order:
                if self.sizes[unit] <= left:
                    chosen.add(unit)
                    left -= self.sizes[unit]
        return [u in chosen for u in range(self.num_units)]

    def advance(self, scores: dict[int, float]) -> None:
        """Close a step: record the ``scores`` of units that trained in it, then re-rank if it is time."""
        for unit, score in scores.items():
            self.scores[unit] = float(score)
        for unit, trained in enumerate(self.trained):
            self.frozen_for[unit] = 0 if trained else self.frozen_for[unit] + 1
        self.history.append(list(self.trained))
        self.step += 1
        if self.step % self.schedule_every == 0:
            self.trained = self._rank()

    def state_dict(self) -> dict:
        return {
            "num_units": self.num_units,
            "sweep_rank": list(self.sweep_rank),
            "scores": [None if math.isinf(s) else s for s in self.scores],
            "frozen_for": list(self.frozen_for),
            "step": self.step,
            "trained": list(self.trained),
            "history": ["".join("1" if t else "0" for t in row) for row in self.history],
        }

    def load_state_dict(self, state: dict) -> None:
        if state["num_units"] != self.num_units:
            raise ValueError(
                f"SlimFit scheduler state is for {state['num_units']} units; this model has {self.num_units}."
            )
        self.sweep_rank = list(state["sweep_rank"])
        self.scores = [NEVER_TRAINED if s is None else float(s) for s in state["scores"]]
        self.frozen_for = list(state["frozen_for"])
        self.step = int(state["step"])
        self.trained = [bool(t) for t in state["trained"]]
        self.history = [[c == "1" for c in row] for row in state["history"]]


def score_parts(metric: str, before: list[torch.Tensor], after: list[torch.Tensor], epsilon: float) -> list[float]:
    """The two sums a unit's score is made of, over some of its tensors (they add up over tensors and optimizers);
    consumes ``before``."""
    sums = [_tensor_parts(metric, old, new, epsilon, 1.0) for old, new in zip(before, after)]
    if metric == "relative_change":  # sum of |after - before| / (|before| + eps), and the count of values
        return [sum((_item(total) for total in sums), 0.0), float(sum(old.numel() for old in before))]
    # update_norm: squared norms of the change and of the old values
    return [float(sum(_item(change) for change, _ in sums)), float(sum(_item(size) for _, size in sums))]


def _tensor_parts(metric: str, before: torch.Tensor, after: torch.Tensor, epsilon: float, factor: float):
    """One tensor's ``score_parts`` as 0-d tensors (no host sync); a ``factor`` not 1 then moves ``after`` that many
    times the update (catch-up). Consumes ``before``."""
    old = before.float()
    delta = after.detach().float() - old
    if factor != 1.0:
        after.add_(delta, alpha=factor - 1.0)
    if metric == "relative_change":
        return delta.abs_().div_(old.abs_().add_(epsilon)).sum()
    return delta.pow_(2).sum(), old.pow(2).sum()


def finish_score(metric: str, parts: list[float], epsilon: float) -> float:
    """The score from the summed ``score_parts`` of all of a unit's tensors."""
    if metric in ("relative_change", "gradient"):  # a mean over all of the unit's values
        return parts[0] / max(parts[1], 1.0)
    return math.sqrt(parts[0]) / (math.sqrt(parts[1]) + epsilon)  # ||after - before|| / (||before|| + eps)


def _item(total: torch.Tensor) -> float:
    """A sum as a float; a DTensor shard's partial sum reduced over the shards, so every rank scores alike."""
    if isinstance(total, DTensor):
        total = total.full_tensor()
    if is_fake_tensor(total):  # a memory estimate (peft_slim.planner): shapes, no values to score
        return 0.0
    return float(total)
