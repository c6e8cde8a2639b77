"""Which optimizers SlimFit can free the state of (``release_frozen_optimizer_state``), refused at their first step.

Freeing is ``optimizer.state.pop(param)``: an optimizer that keeps its state there and rebuilds it when it is missing
(torch's, and bitsandbytes' 8-bit and 32-bit ones on every device) then restarts a unit exactly as a fresh optimizer
does. bitsandbytes' *paged* optimizers also register each large state buffer with a process-wide page manager,
which keeps it after the pop: nothing is freed, and each restart allocates new buffers, so memory grows.
"""

from __future__ import annotations

import torch


def _inner(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """The optimizer a wrapper (accelerate's ``AcceleratedOptimizer``) steps."""
    return getattr(optimizer, "optimizer", optimizer)


def check_releasable(optimizer: torch.optim.Optimizer) -> None:
    """Raise ``ValueError`` for an optimizer whose state SlimFit's release would not free."""
    inner = _inner(optimizer)
    if getattr(inner, "is_paged", False) is True:
        name = type(inner).__name__
        raise ValueError(
            f"SlimFit: release_frozen_optimizer_state=True cannot free the state of {name} (a bitsandbytes paged "
            "optimizer): its page manager keeps every state buffer, so frozen units' state would stay and each "
            "restart would allocate more. Use bitsandbytes' non-paged AdamW8bit / AdamW (or torch's AdamW), or set "
            "release_frozen_optimizer_state=False to keep all state."
        )
