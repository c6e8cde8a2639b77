"""Which token positions receive gradients: a boolean mask ``[batch, seq]``, and the padded index form blocks use
(:class:`TokenSelection`: each row's selected positions in order, then distinct unselected ones up to the widest row).
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ..process_rank import rank
from .config import TokenSelectionConfig

IGNORE_INDEX = -100  # a label that carries no loss (PyTorch's cross-entropy default)

# Tiers added to a uniform [0, 1) draw: a position of a higher tier is always chosen before a lower one.
_FORCED, _LABELLED, _OTHER = 3.0, 2.0, 1.0


@dataclass
class TokenSelection:
    """A selection mask and its padded index form."""

    mask: torch.Tensor  # [B, L] bool, True where gradients flow
    index: torch.Tensor  # [B, n] long, selected positions first, then distinct unselected ones
    valid: torch.Tensor  # [B, n] bool, True for slots that hold a selected position
    all_valid: bool = False  # every row selects the same number of positions: no padded slots
    unselected: torch.Tensor | None = None  # [n_unselected] long: the unselected positions of the flattened [B * L]
    _memo: dict = field(default_factory=dict, repr=False)

    @classmethod
    def from_mask(cls, mask: torch.Tensor) -> TokenSelection:
        counts = mask.sum(dim=1)
        width = max(int(counts.max()), 1)
        # A stable sort on "not selected" puts selected positions first, each group in position order.
        order = torch.sort((~mask).to(torch.uint8), dim=1, stable=True).indices
        index = order[:, :width]
        valid = torch.arange(width, device=mask.device)[None, :] < counts[:, None]
        unselected = (~mask).flatten().nonzero().flatten()
        return cls(mask=mask, index=index, valid=valid, all_valid=bool(valid.all()), unselected=unselected)

    def unselected_part(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor``'s entries at the unselected positions along ``dim`` (batch is dim 0), packed: ``[n_unselected,
        ...the other dims]``. What the selected pass needs of a tensor whose selected positions it recomputes."""
        moved = tensor.movedim(dim, 1)
        return moved.reshape(-1, *moved.shape[2:]).index_select(0, self.unselected.to(tensor.device))

    def with_unselected(self, part: torch.Tensor, like_shape: tuple[int, ...], dim: int) -> torch.Tensor:
        """A tensor of shape ``like_shape`` holding ``part`` (from ``unselected_part``) at the unselected positions
        along ``dim`` and zeros at the selected ones (which the selected pass overwrites)."""
        moved_shape = list(like_shape)
        moved_shape.insert(1, moved_shape.pop(dim))
        flat = part.new_zeros((moved_shape[0] * moved_shape[1], *moved_shape[2:]))
        flat.index_copy_(0, self.unselected.to(part.device), part)
        return flat.view(moved_shape).movedim(1, dim)

    def gather(self, tensor: torch.Tensor, dim: int) -> torch.Tensor:
        """``tensor`` at the slot positions along ``dim`` (batch is dim 0). With grad through ``index_select`` over
        the flattened (batch, ``dim``) axes, whose backward keeps only the index (``torch.gather`` keeps its input)."""
        if not tensor.requires_grad:
            return tensor.gather(dim, _expand_index(self.index, tensor, dim))
        moved = tensor.movedim(dim, 1)
        batch, length = moved.shape[:2]
        rows = (self.index + torch.arange(batch, device=self.index.device)[:, None] * length).flatten()
        picked = moved.reshape(batch * length, *moved.shape[2:]).index_select(0, rows.to(tensor.device))
        return picked.view(batch, self.index.shape[1], *moved.shape[2:]).movedim(1, dim)

    def scatter(self, full: torch.Tensor, part: torch.Tensor, dim: int) -> torch.Tensor:
        """``full`` (a constant) with its slot positions replaced by ``part`` (gradients) where the slot is valid."""
        index = _expand_index(self.index, full, dim)
        source = part.to(full.dtype)
        if not self.all_valid:
            valid = self.valid.view(self.valid.shape + (1,) * (part.dim() - 2)).movedim(1, dim)
            source = torch.where(valid, source, full.gather(dim, index))
        return full.scatter(dim, index, source)

    def causal_mask(self, key: torch.Tensor) -> torch.Tensor:
        """Boolean causal mask [B, 1, n, L] for the slots' queries over ``key``'s L positions, on ``key``'s device
        (the index's in training; the planner's meta trace gets a meta mask instead of computing its values)."""

        def make() -> torch.Tensor:
            positions = torch.arange(key.shape[2], device=key.device)
            return (positions[None, None, :] <= self.index.to(key.device)[:, :, None]).unsqueeze(1)

        return self.memo(("causal", key.shape[2], key.device), make)

    def memo(self, key: Any, make: Callable[[], torch.Tensor], source: Any = None) -> torch.Tensor:
        """``make()``, once per selection (one forward) and shared by every block, so autograd saves one copy of the
        blocks' common mask and rotary tensors, not one per layer. ``source`` (what the key's ``id`` names) is held
        weakly: the result is reused only while it lives (a reused id is never mistaken for it), and it (a full
        ``[B, 1, L, L]`` mask, say) is not kept for backward when only its cut rows are needed.
        """
        entry = self._memo.get(key)
        if entry is None or (entry[0] is not None and entry[0]() is not source):
            entry = self._memo[key] = (None if source is None else weakref.ref(source), make())
        return entry[1]


def _expand_index(index: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Broadcast ``index`` [B, n] to gather/scatter ``like`` along ``dim``."""
    shape = list(like.shape)
    shape[dim] = index.shape[1]
    view = [index.shape[0]] + [1] * (like.dim() - 1)
    view[dim] = index.shape[1]
    return index.view(view).expand(shape)


def selection_generator(seed: int | None) -> torch.Generator:
    """The generator selections are drawn from, seeded with ``seed`` plus this process's rank (``rank()``: models are
    often built before the process group exists): data-parallel ranks must not all select the same positions."""
    if seed is None:  # a fresh draw: reproducible only through `seed`
        seed = int(torch.randint(2**62, (1,)).item())
    return torch.Generator().manual_seed(seed + rank())


def forced_positions(real: torch.Tensor, keep_first: bool, keep_last: bool) -> torch.Tensor:
    """Mask of positions that are always selected: the first and/or last real token of each row."""
    forced = torch.zeros_like(real)
    has_real = real.any(dim=1, keepdim=True)  # written at each row's position: False (a no-op) in a row without any
    if keep_first:  # argmax returns the first of equal maxima
        forced.scatter_(1, real.int().argmax(dim=1, keepdim=True), has_real)
    if keep_last:
        forced.scatter_(1, real.shape[1] - 1 - real.flip(1).int().argmax(dim=1, keepdim=True), has_real)
    return forced


def labelled_positions(labels: torch.Tensor, causal: bool) -> torch.Tensor:
    """Mask of the positions whose loss has a label: a causal LM's position t predicts token t + 1, so it is labelled
    when ``labels[t + 1]`` is not -100 (its last position never is); another head's position, by its own label."""
    labelled = labels != IGNORE_INDEX
    return torch.cat([labelled[:, 1:], torch.zeros_like(labelled[:, :1])], dim=1) if causal else labelled


def ratio_keeping_labels(labels: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """Per row of a causal LM's batch, the lowest token ratio at which answer-first selection holds every labelled
    position: those and the first and last real token (always selected), over the row's real tokens."""
    kept = (labelled_positions(labels, causal=True) | forced_positions(real, True, True)) & real
    return kept.sum(dim=1, dtype=torch.float64) / real.sum(dim=1)


def draw_selection(
    config: TokenSelectionConfig,
    real: torch.Tensor,
    forced: torch.Tensor,
    labelled: torch.Tensor | None,
    generator: torch.Generator,
) -> torch.Tensor:
    """Draw a selection mask [B, L] as ``config`` asks.

    ``real`` marks non-padding positions, ``forced`` those always selected (a head reads them, padding or not),
    ``labelled`` those with a loss label (for ``selection="answer"``). The count is over real tokens (at least the
    forced real ones), forced padding on top: the budget (``token_ratio`` or ``num_tokens``), or under "answer" with
    labels, fewer where every labelled position and ``prompt_ratio`` of the others fit in it. Each candidate scores
    a uniform draw plus its tier (forced > labelled, under "answer" > other): the highest ``wanted`` are selected,
    so each tier is a uniform subset once the count runs short.
    """
    n_real = real.sum(dim=1)
    if config.num_tokens is not None:
        wanted = torch.clamp(n_real, max=config.num_tokens)
    else:
        wanted = torch.ceil(n_real.to(torch.float64) * config.token_ratio).to(n_real.dtype)
        wanted = torch.minimum(torch.clamp(wanted, min=1), n_real)
    answer = config.selection == "answer" and labelled is not None
    if answer and config.prompt_ratio < 1.0:
        first = ((labelled | forced) & real).sum(dim=1)  # labelled and forced real positions: all of them train
        prompt = torch.ceil((n_real - first).to(torch.float64) * config.prompt_ratio).to(n_real.dtype)
        wanted = torch.minimum(wanted, first + prompt)
    wanted = torch.maximum(wanted, (forced & real).sum(dim=1)) + (forced & ~real).sum(dim=1)

    candidates = real | forced
    draw = torch.rand(real.shape, generator=generator, device=generator.device).to(real.device)
    tier = torch.full(real.shape, _OTHER, device=real.device)
    if answer:
        tier = torch.where(labelled & real, _LABELLED, tier)
    tier = torch.where(forced, _FORCED, tier)
    score = torch.where(candidates, tier + draw, -math.inf)
    order = torch.argsort(score, dim=1, descending=True)
    rank = torch.empty_like(order).scatter_(1, order, torch.arange(real.shape[1], device=real.device).expand_as(order))
    return (rank < wanted[:, None]) & candidates


def check_token_mask(token_mask: Any, real: torch.Tensor, required: torch.Tensor | None) -> torch.Tensor:
    """A user's ``token_mask``, validated against the padding (``real``) and the positions a head reads (``required``).

    Padding may be selected only where the head reads it (e.g. position 0 of a left-padded encoder batch).
    """
    if not isinstance(token_mask, torch.Tensor) or token_mask.dtype != torch.bool:
        raise ValueError(f"token_mask must be a bool tensor of shape {tuple(real.shape)} [batch, seq].")
    if tuple(token_mask.shape) != tuple(real.shape):
        raise ValueError(
            f"token_mask has shape {tuple(token_mask.shape)}; it must be [batch, seq] = {tuple(real.shape)}."
        )
    token_mask = token_mask.to(real.device)
    if not token_mask.any():
        raise ValueError("token_mask selects no position; select at least one token.")
    allowed = real if required is None else real | required
    if (token_mask & ~allowed).any():
        raise ValueError("token_mask selects padding positions (attention_mask == 0); padding cannot be trained.")
    if required is not None and (required & ~token_mask).any():
        rows, positions = (required & ~token_mask).nonzero(as_tuple=True)
        missing = ", ".join(f"row {r}: position {p}" for r, p in zip(rows.tolist()[:4], positions.tolist()[:4]))
        raise ValueError(
            "token_mask must select every position the classification head reads (position 0 for encoders, the "
            f"last non-pad token by transformers' rule for decoders); it misses {missing}."
        )
    return token_mask
