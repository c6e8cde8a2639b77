"""Token selection: train on a subset of each sequence's tokens, as hooks on any supported transformers model.

``TokenSelector.attach(model, config)`` makes every training forward (train mode, grad enabled) run each
block on all tokens without gradient tracking, then on the selected tokens with it, and score the loss on
the selected positions; ``detach()`` removes it. TokenTune is this component plus LoRA or base-weight
training; SlimFit attaches it when its ``tokentune`` field is set.
"""

from .config import TokenSelectionConfig
from .selector import TokenSelector

__all__ = ["TokenSelectionConfig", "TokenSelector"]
