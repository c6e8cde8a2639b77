"""TokenTune's entries in transformers' attention-function registry, which the model's ``_attn_implementation`` names
while token selection is attached. They receive the block's :class:`BlockPass` through the layer's keyword arguments
(which transformers forwards down to the attention function, also in a checkpointing replay), so no global state:
the full pass (no grad, every token) records the keys/values and attends as usual; the selected pass (grad, selected
queries) puts its keys/values into the recorded ones, the others constants, and attends over all positions.

Without a ``BlockPass`` the original implementation runs unchanged: transformers picks the attention function by the
config's name only, so eval forwards, generation and another model holding the same config object (TRL's reference
model can) compute exactly what they compute without TokenTune (tests/tokentune/test_tokentune_semantics.py).
"""

from __future__ import annotations

import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface, eager_mask, sdpa_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from ..compat import eager_attention_function
from .selection import TokenSelection

PASS_KWARG = "tokentune_pass"
SUPPORTED_IMPLEMENTATIONS = ("sdpa", "eager")
REGISTERED_NAMES = {impl: f"peft_slim_tokentune_{impl}" for impl in SUPPORTED_IMPLEMENTATIONS}


# Every module of a model under token selection that lies outside the blocks it runs: (where it sits, whether its
# selector is in a training forward now), filled while attached. Such a module's attention call in a training forward
# would train every token.
OUTSIDE_BLOCKS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


@dataclass
class BlockPass:
    """What one block's two passes share."""

    selection: TokenSelection
    phase: str = "full"  # "full" or "selected"
    key: torch.Tensor | None = None  # all positions, recorded by the full pass
    value: torch.Tensor | None = None
    full_calls: int = 0  # attention calls seen by the full pass; TokenTune supports exactly one
    full_output: Any = None  # the block's no-grad output for every position
    recompute_in_backward: bool = True  # False: the block draws random numbers, the selected pass runs with grad
    check_recompute: Any = None  # the layout key (invariant.py) whose first recomputation in backward is checked


class UnroutedCalls:
    """Records the modules whose attention calls reached TokenTune's function without a block's ``BlockPass`` while
    ``names`` is a list (during a block's full pass): a layer that does not pass its keyword arguments down."""

    names: list[str] | None = None


def _original_attention(module: torch.nn.Module, implementation: str) -> Callable:
    if implementation == "sdpa":
        return ALL_ATTENTION_FUNCTIONS["sdpa"]
    eager = eager_attention_function(module)
    if eager is None:
        raise ValueError(
            f"TokenTune: {type(module).__name__} has no module-level `eager_attention_forward`; "
            "use attn_implementation='sdpa' for this model."
        )
    return eager


# Arguments that only transformers' own sdpa wrapper handles (e.g. T5 position bias, softcapping).
_SDPA_EXTRAS = ("position_bias", "softcap", "s_aux", "sinks")


def _sdpa_selected(module, query, key, value, attention_mask, selection, kwargs):
    """SDPA for the selected queries over all keys, with grouped-query attention done by the kernel: transformers'
    wrapper repeats grouped keys/values to every query head when a mask is given, and autograd saves those copies;
    ``enable_gqa`` keeps the [B, kv_heads, L, d] originals (the same result, a third of the bytes on SmolLM2)."""
    if attention_mask is not None and attention_mask.dtype == torch.bool:
        # The CPU kernels turn a boolean mask into an additive one and save that for backward: build it
        # once per forward (in the query dtype) so all layers save the same tensor.
        boolean = attention_mask
        attention_mask = selection.memo(
            ("additive", id(boolean), query.dtype),
            lambda: torch.zeros(boolean.shape, dtype=query.dtype, device=query.device).masked_fill(
                ~boolean, torch.finfo(query.dtype).min
            ),
            source=boolean,
        )
    output = torch.nn.functional.scaled_dot_product_attention(
        query,
        key,
        value,
        attn_mask=attention_mask,
        dropout_p=kwargs.get("dropout", 0.0),
        scale=kwargs.get("scaling"),
        is_causal=False,
        enable_gqa=query.shape[1] != key.shape[1],
    )
    return output.transpose(1, 2).contiguous(), None


def _causal_without_mask(module: torch.nn.Module, implementation: str, kwargs: dict) -> bool:
    """Whether the original implementation, given no mask, attends causally (the selected pass then needs the mask):
    transformers' sdpa wrapper does when the layer's ``is_causal`` argument says so, else the module's attribute
    (default True); a bidirectional config (``is_causal=False``) passes False to causal modules, CLIP's text model
    True to non-causal ones. Eager functions read the mask only: without one they attend to every key."""
    if implementation != "sdpa":
        return False
    causal = kwargs.get("is_causal")
    return bool(getattr(module, "is_causal", True) if causal is None else causal)


def _make_attention(implementation: str) -> Callable:
    def tokentune_attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs,
    ):
        block_pass: BlockPass | None = kwargs.pop(PASS_KWARG, None)
        original = _original_attention(module, implementation)
        if block_pass is None:
            outside = OUTSIDE_BLOCKS.get(module)
            if outside is not None and outside[1]():  # in a training forward of the selector that recorded it
                raise ValueError(
                    f"TokenTune cannot train {outside[0]}: it attends outside the transformer blocks "
                    "token selection runs, so all its tokens would receive gradients. Models with a second stack of "
                    "blocks (e.g. a vision tower beside the text model) or an attention outside the blocks are not "
                    "supported."
                )
            if UnroutedCalls.names is not None:
                UnroutedCalls.names.append(type(module).__name__)
            return original(module, query, key, value, attention_mask, **kwargs)
        if block_pass.phase == "full":
            block_pass.full_calls += 1
            block_pass.key, block_pass.value = key, value
            return original(module, query, key, value, attention_mask, **kwargs)
        selection = block_pass.selection
        key = selection.scatter(block_pass.key, key, dim=2)
        value = selection.scatter(block_pass.value, value, dim=2)
        if attention_mask is None and _causal_without_mask(module, implementation, kwargs):
            attention_mask = selection.causal_mask(key)
        if implementation == "sdpa" and not any(kwargs.get(name) is not None for name in _SDPA_EXTRAS):
            return _sdpa_selected(module, query, key, value, attention_mask, selection, kwargs)
        kwargs["is_causal"] = False
        return original(module, query, key, value, attention_mask, **kwargs)

    tokentune_attention.__name__ = f"tokentune_{implementation}_attention"
    return tokentune_attention


_MASKS = {"sdpa": sdpa_mask, "eager": eager_mask}
for _impl, _name in REGISTERED_NAMES.items():
    AttentionInterface.register(_name, _make_attention(_impl))
    AttentionMaskInterface.register(_name, _MASKS[_impl])
