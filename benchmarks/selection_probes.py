"""Token selections scored from the inputs or from a no-grad pass, passed to TokenTune as ``token_mask``.

Probes of which prompt tokens are worth a gradient path, measured before any of them becomes a library rule: the
gradient of a given mask is TokenTune's (tested against its definition in the library's tests); only the choice of
positions differs from ``selection="answer"``. Each probe keeps that rule's budget and tiers: ``ceil(ratio x real
tokens)`` positions per row, the first and last real token always, then every position whose next token carries a
label, then the prompt positions with the highest score (``answer`` draws them uniformly):

* ``attention``: the attention the labelled positions pay to each prompt position, averaged over layers, heads and
  those queries, from a no-grad forward of the batch in eval mode (eager attention, so the weights exist). That
  forward is an extra pass here; a library rule would read the scores from TokenTune's own no-grad pass.
* ``recent``: the prompt positions nearest the answer (the latest ones), from the inputs alone.
"""

from __future__ import annotations

import math

import torch

from peft_slim.compat import get_attn_implementation, set_attn_implementation
from peft_slim.token_selection.loss import IGNORE_INDEX
from peft_slim.token_selection.selection import forced_positions

PROBES = ("attention", "recent")
_FORCED, _LABELLED, _OTHER = 3.0, 2.0, 1.0


def labelled_positions(labels: torch.Tensor) -> torch.Tensor:
    """Positions whose prediction carries a loss: position t when labels[t + 1] is not ignored."""
    scored = labels != IGNORE_INDEX
    return torch.cat([scored[:, 1:], torch.zeros_like(scored[:, :1])], dim=1)


@torch.no_grad()
def attention_received(model, batch: dict) -> torch.Tensor:
    """[batch, seq]: the mean attention the labelled positions pay to each key position, over layers and heads."""
    config = model.get_base_model().config
    implementation, was_training = get_attn_implementation(config), model.training
    model.eval()
    set_attn_implementation(config, "eager")
    try:
        output = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"], output_attentions=True)
    finally:
        set_attn_implementation(config, implementation)
        model.train(was_training)
    weights = torch.stack([layer.float() for layer in output.attentions]).mean(dim=(0, 2))  # [B, L queries, L keys]
    queries = labelled_positions(batch["labels"]) & batch["attention_mask"].bool()
    total = (weights * queries[:, :, None]).sum(dim=1)
    return total / queries.sum(dim=1, keepdim=True).clamp(min=1)


def probe_mask(probe: str, model, batch: dict, token_ratio: float, generator: torch.Generator) -> torch.Tensor:
    """The [batch, seq] bool ``token_mask`` of ``probe`` at ``token_ratio`` (see the module docstring)."""
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    real = batch["attention_mask"].bool()
    length = real.shape[1]
    positions = torch.arange(length)
    if probe == "attention":
        score = attention_received(model, batch)
        score = score / score.amax(dim=1, keepdim=True).clamp(min=1e-30) * 0.999  # in [0, 1): stays in its tier
    else:
        score = (positions / length).expand_as(real)
    forced = forced_positions(real, keep_first=True, keep_last=True)
    labelled = labelled_positions(batch["labels"]) & real
    draw = torch.rand(real.shape, generator=generator)  # labelled positions: uniform, as "answer" draws them
    tier = torch.where(forced, _FORCED, torch.where(labelled, _LABELLED + draw, _OTHER + score))
    tier = torch.where(real, tier, -math.inf)
    n_real = real.sum(dim=1)
    wanted = torch.minimum(torch.ceil(n_real * token_ratio).long().clamp(min=2), n_real)
    order = torch.argsort(tier, dim=1, descending=True)
    rank = torch.empty_like(order).scatter_(1, order, positions.expand_as(order).contiguous())
    return (rank < wanted[:, None]) & real
