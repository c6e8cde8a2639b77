"""Token selection: train on a subset of each sequence's tokens, as hooks on any supported transformers model.

``TokenSelector.attach(model, config)`` puts it on the model, for a ``TrainingContext`` to run at every training
forward (train mode, grad enabled); ``detach()`` removes it. TokenTune is this component plus LoRA or base-weight
training; SlimFit's ``token_selection`` field attaches it.
"""

from .config import TokenSelectionConfig
from .selector import TokenSelector

__all__ = ["TokenSelectionConfig", "TokenSelector"]
