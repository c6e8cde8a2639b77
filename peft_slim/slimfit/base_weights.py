"""What the base model's trainable tensors were before SlimFit trained them in place.

Saving writes only the tensors that changed, and telling which did must not cost a copy of the model:
a hash of each tensor's bytes, taken at wrapping time, settles it exactly. A full copy (on the CPU) is
kept only when asked for, so that unload() and disable_adapter() can give the base model back.
"""

from __future__ import annotations

import torch
from torch import nn

from ..tuner.record import tensor_digest


class BaseWeights:
    """Digests (and optionally CPU copies) of the parameters a standalone SlimFit model trains in place.

    Keyed by parameter name (relative to the wrapped model), holding no parameter: FSDP2 replaces the parameters
    with shards (a reference would keep every full tensor alive), and a sharded model saves gathered tensors.
    """

    def __init__(self, params: dict[str, nn.Parameter], keep_copies: bool):
        # name -> (dtype, shape, digest) at wrapping time
        self._entries = {name: (str(p.dtype), tuple(p.shape), tensor_digest(p)) for name, p in params.items()}
        self._copies = {name: p.detach().to("cpu", copy=True) for name, p in params.items()} if keep_copies else None

    @property
    def kept(self) -> bool:
        return self._copies is not None

    def changed(self, name: str, tensor: torch.Tensor) -> bool:
        """Whether parameter ``name`` now holding ``tensor`` differs from wrapping time (False if not tracked)."""
        entry = self._entries.get(name)
        return entry is not None and tensor_digest(tensor) != entry[2]

    @property
    def names(self) -> list[str]:
        return list(self._entries)

    def entry(self, name: str) -> tuple[str, tuple, bytes] | None:
        """``(dtype, shape, digest)`` of parameter ``name`` at wrapping time (None if not tracked): what a saved
        standalone adapter records of the base model it was trained on, and what loading compares it with."""
        return self._entries.get(name)

    def any_changed(self, model: nn.Module) -> bool:
        return any(self.changed(name, model.get_parameter(name)) for name in self._entries)

    def changed_except(self, model: nn.Module, names: set[str]) -> list[str]:
        """Tracked parameters, other than ``names``, that differ from wrapping time."""
        return [name for name in self._entries if name not in names and self.changed(name, model.get_parameter(name))]

    @torch.no_grad()
    def restore(self, model: nn.Module, values: dict[str, torch.Tensor] | None = None) -> None:
        """Copy ``values`` (by default the kept originals; ``swap_in``'s result to put it back) into the model."""
        if values is None and self._copies is None:
            raise RuntimeError("BaseWeights.restore: no copies were kept.")
        for name, value in (self._copies if values is None else values).items():
            model.get_parameter(name).copy_(value)

    @torch.no_grad()
    def swap_in(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Put the kept originals into the model; returns (CPU copies of) the values they replaced, for restore.

        Copies in place, so the parameters (and an optimizer's references to them) stay the same objects and the
        device holds no second copy of the weights.
        """
        current = {name: model.get_parameter(name).detach().to("cpu", copy=True) for name in self._entries}
        self.restore(model)
        return current
