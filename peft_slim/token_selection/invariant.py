"""TokenTune's one assumption about a block, checked at run time rather than by a list of architectures.

The selected tokens' outputs are taken from the no-grad pass over every token, and their gradients come from
recomputing the block on the selected tokens alone (``recompute.py``). Both are right only when the block, given
every token's keys and values, computes each selected token's output from that token alone plus its one attention
call. A second token mixer beside attention (a state-space mixer, a convolution, a sparse-attention indexer, a mask
computed from the hidden states) breaks it, and no signature shows it. So at a block's first training forward with a
new argument layout (``layout``), the selected pass runs once more without grad and must give the no-grad pass's
outputs at the selected positions within the dtype's rounding (``TOLERANCES``); its first recomputation in backward
must give an output of the same shape and dtype (as torch.utils.checkpoint checks; its values may differ there by
activation compression's rounding of the saved inputs). Otherwise the step is refused, before any optimizer step,
naming the block and what differs.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..compat import run_device_type
from .selection import TokenSelection

# Largest difference allowed between the selected pass and the full pass, relative to the largest output value: a
# few units in the last place of the compute dtype (the two passes multiply matrices of different shapes, so their
# sums may round differently). A mixer that sees other tokens moves outputs by a sizeable fraction of their scale.
TOLERANCES = {torch.float64: 1e-10, torch.float32: 1e-4, torch.bfloat16: 5e-2, torch.float16: 5e-3}

NOT_SUPPORTED_FIX = "train this model without token selection (LoRA, or SlimFit without `token_selection`)"


def layout(arguments: dict[str, Any]) -> tuple:
    """What about a block's arguments can change how it mixes tokens: which are given, tensors' ranks, dtypes and
    size-1 (broadcast) axes, other values themselves. Not the sizes: a new sequence length is the same layout."""
    return tuple((name, _layout_of(value)) for name, value in arguments.items())


def _layout_of(value: Any) -> Any:
    if isinstance(value, torch.Tensor):
        return ("tensor", value.dtype, tuple(size == 1 for size in value.shape))
    if isinstance(value, (tuple, list)):
        return tuple(_layout_of(v) for v in value)
    if isinstance(value, dict):
        return tuple((k, _layout_of(v)) for k, v in value.items())
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return type(value).__name__


def compute_dtype(output: torch.Tensor) -> torch.dtype:
    """The least precise of the output's dtype and an enabled autocast's: the rounding both passes are subject to."""
    dtype = output.dtype
    kind = run_device_type(output)
    if torch.is_autocast_enabled(kind):
        autocast = torch.get_autocast_dtype(kind)
        if torch.finfo(autocast).eps > torch.finfo(dtype).eps:
            dtype = autocast
    return dtype


def difference(expected: torch.Tensor, actual: Any, selection: TokenSelection) -> str | None:
    """What differs between the full pass's outputs at the selected slots (``expected``) and the selected pass's
    (``actual``: the block's output or its first item), or None when they agree within ``TOLERANCES``."""
    actual = actual[0] if isinstance(actual, (tuple, list)) else actual
    if not isinstance(actual, torch.Tensor):
        return f"it returns {type(actual).__name__} for the selected tokens, not a tensor of hidden states"
    if actual.shape != expected.shape:
        return (
            f"its output for the selected tokens has shape {tuple(actual.shape)}, where the full pass's at those "
            f"tokens has {tuple(expected.shape)}"
        )
    valid = selection.valid.to(expected.device).view(selection.valid.shape + (1,) * (expected.dim() - 2))
    gap = torch.where(valid, (actual.float() - expected.float()).abs(), 0.0)
    error = float(gap.max()) if gap.numel() else 0.0
    scale = float(torch.where(valid, expected.float().abs(), 0.0).max()) if gap.numel() else 0.0
    dtype = compute_dtype(expected)
    tolerance = TOLERANCES.get(dtype, 1e-4) * max(scale, torch.finfo(dtype).tiny)
    if error <= tolerance and error == error:  # error == error: not NaN
        return None
    return (
        f"its outputs at the selected tokens differ from the full pass's by up to {error:.3g} (largest output "
        f"{scale:.3g}, {dtype} tolerance {tolerance:.3g})"
    )


def refusal(block_name: str, what: str, when: str) -> ValueError:
    """The refusal for a block whose selected pass (``when``: in the forward or recomputed in backward) differs."""
    return ValueError(
        f"TokenTune cannot train {block_name} exactly on a token subset: {NOT_SUPPORTED_FIX}. On the selected "
        f"tokens alone ({when}), {what}: something in the block besides its attention call mixes tokens (a "
        "state-space or convolution mixer, a sparse-attention indexer, a mask computed from the hidden states), so "
        "the gradients would be wrong."
    )


def check_selected_pass(block_name: str, run: Callable[[], Any], expected: torch.Tensor, selection: TokenSelection):
    """Run the selected pass (``run``, without grad) and refuse when it fails or differs from ``expected``."""
    try:
        with torch.no_grad():
            actual = run()
    except ValueError as error:
        if str(error).startswith("TokenTune"):
            raise
        raise refusal(block_name, f"it fails ({type(error).__name__}: {_short(error)})", "in the forward") from error
    except (RuntimeError, IndexError, TypeError, AssertionError) as error:
        raise refusal(block_name, f"it fails ({type(error).__name__}: {_short(error)})", "in the forward") from error
    what = difference(expected, actual, selection)
    if what is not None:
        raise refusal(block_name, what, "in the forward")


def _short(error: BaseException) -> str:
    text = " ".join(str(error).split())
    return text if len(text) <= 200 else text[:197] + "..."
