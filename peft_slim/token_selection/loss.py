"""The selected-token loss: the mean cross-entropy over selected positions with a label (not -100); a causal LM's
selected position i scored on token i+1, a per-position head's (token classification, masked LM) on its own label.

Under ``transformers.Trainer`` the model receives ``num_items_in_batch``, the labelled positions of the whole
accumulated batch over all processes: each micro-batch's selected-token mean is weighted by its share of them, so
summed over micro-batches and processes (as Trainer and DDP do) the loss is again a mean, no token counted twice.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .selection import IGNORE_INDEX, TokenSelection


def selected_targets(labels: torch.Tensor, selection: TokenSelection, shift: bool) -> torch.Tensor:
    """Labels [B, n] for the selection's slots; -100 where a slot has no selected, labelled target."""
    length = labels.shape[1]
    positions = selection.index + 1 if shift else selection.index
    in_range = selection.valid & (positions < length)
    targets = labels.gather(1, positions.clamp(max=length - 1))
    return torch.where(in_range, targets, IGNORE_INDEX)


def selected_token_loss(
    logits: torch.Tensor,
    labels: torch.Tensor,
    selection: TokenSelection,
    shift: bool,
    num_items_in_batch: torch.Tensor | int | None = None,
) -> torch.Tensor:
    """Mean cross-entropy over selected, labelled positions; ``logits`` are [B, n, V] over the slots."""
    targets = selected_targets(labels, selection, shift)
    total = F.cross_entropy(
        logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1), ignore_index=IGNORE_INDEX, reduction="sum"
    )
    return labelled_mean(total, targets, labels, shift, num_items_in_batch)


def labelled_mean(
    total: torch.Tensor,
    targets: torch.Tensor,
    labels: torch.Tensor,
    shift: bool,
    num_items_in_batch: torch.Tensor | int | None,
) -> torch.Tensor:
    """The loss from ``total``, the summed cross-entropy over ``targets`` (the slots' labels, -100 ignored)."""
    count = (targets != IGNORE_INDEX).sum()
    loss = total / count.clamp(min=1)
    if num_items_in_batch is not None:
        labelled = labels[:, 1:] if shift else labels
        loss = loss * (labelled != IGNORE_INDEX).sum() / num_items_in_batch
    return loss
