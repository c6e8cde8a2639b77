"""TokenTune: the forward sees every token, gradients flow through a selected subset."""

from ..registry import register_method
from .callback import TokenTuneCallback, find_token_selector
from .config import TokenTuneConfig
from .model import TokenTuneModel
from .transform import TokenTuneTransform, tokentune_

__all__ = [
    "find_token_selector",
    "tokentune_",
    "TokenTuneCallback",
    "TokenTuneConfig",
    "TokenTuneModel",
    "TokenTuneTransform",
]

register_method("tokentune", TokenTuneConfig, TokenTuneModel)
