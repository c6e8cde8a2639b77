"""The per-layer outputs a token-selection training forward refuses: a block's output with gradients exists for the
selected positions only, and partial ones would not have the shape transformers documents (eval mode or
``torch.no_grad()`` forwards return every output of the plain model).
"""

from __future__ import annotations

from typing import Any

PER_LAYER_OUTPUTS = ("output_hidden_states", "output_attentions", "output_router_logits")
# What else a flag would get wrong: a mixture-of-experts model adds a loss computed from its router logits.
_ALSO = {"output_router_logits": " (and the router's load-balancing loss, computed from them, would be left out)"}


def check_output_flags(config: Any, kwargs: dict) -> None:
    """Raise ``ValueError`` when the call (or the model's config) asks a training forward for per-layer outputs."""
    for flag in PER_LAYER_OUTPUTS:
        given = kwargs.get(flag)
        source = f"{flag}=True"
        if given is None and getattr(config, flag, False) is True:
            given, source = True, f"model.config.{flag}=True"
        if given:
            raise ValueError(
                f"Token selection (TokenTune, SlimFit's token_selection) does not return "
                f"{flag.removeprefix('output_')} in a training forward ({source}): each block runs with gradients on "
                f"the selected positions only, so whole-sequence per-layer outputs are never computed"
                f"{_ALSO.get(flag, '')}. Run that forward in eval mode or under torch.no_grad() (every position, "
                "the plain model's values), or leave the flag unset in training."
            )
