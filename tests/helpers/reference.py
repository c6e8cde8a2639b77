"""The TokenTune gradient by its equivalent definition (methods.md), written independently of peft_slim.

An ordinary forward in which, at every block input, hidden states at unselected positions are
detached, and inside attention, keys and values at unselected positions are detached; the loss is
taken over selected positions only.
"""

from __future__ import annotations

import contextlib
import sys

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask

_MASK: dict = {}


def _detaching_attention(module, query, key, value, attention_mask, **kwargs):
    keep = _MASK["mask"][:, None, :, None]
    key = torch.where(keep, key, key.detach())
    value = torch.where(keep, value, value.detach())
    return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _detaching_eager_attention(module, query, key, value, attention_mask, **kwargs):
    """The same for a model run with attn_implementation='eager': its modeling file's own eager attention (softcapping,
    sinks and the like, which the sdpa wrapper does not take)."""
    keep = _MASK["mask"][:, None, :, None]
    key = torch.where(keep, key, key.detach())
    value = torch.where(keep, value, value.detach())
    eager = sys.modules[type(module).__module__].eager_attention_forward
    return eager(module, query, key, value, attention_mask, **kwargs)


AttentionInterface.register("reference_detach_sdpa", _detaching_attention)
AttentionMaskInterface.register("reference_detach_sdpa", sdpa_mask)
AttentionInterface.register("reference_detach_eager", _detaching_eager_attention)
AttentionMaskInterface.register("reference_detach_eager", eager_mask)


@contextlib.contextmanager
def reference_forward(model: torch.nn.Module, blocks, mask: torch.Tensor, implementation: str = "sdpa"):
    """Run ``model`` (a transformers model) under the equivalent definition for ``mask`` [B, L], with the attention
    of ``implementation`` ('sdpa' or 'eager')."""

    def detach_unselected(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        hidden = torch.where(mask[:, :, None], hidden, hidden.detach())
        if args:
            return (hidden, *args[1:]), kwargs
        return args, {**kwargs, "hidden_states": hidden}

    handles = [block.register_forward_pre_hook(detach_unselected, with_kwargs=True) for block in blocks]
    saved = model.config._attn_implementation
    model.config._attn_implementation = f"reference_detach_{implementation}"
    _MASK["mask"] = mask
    try:
        yield
    finally:
        model.config._attn_implementation = saved
        _MASK.clear()
        for handle in handles:
            handle.remove()


def selected_causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean over selected positions i with a valid label at i+1 of CE(logits[i], labels[i+1])."""
    targets = torch.full_like(labels, -100)
    targets[:, :-1] = torch.where(mask[:, :-1], labels[:, 1:], -100)
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), ignore_index=-100)
