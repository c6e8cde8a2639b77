"""TokenTune: the forward sees every token, gradients flow through a selected subset."""

from ..registry import register_method
from .callback import TokenTuneCallback, find_token_selector
from .config import TokenTuneConfig
from .model import TokenTuneModel

__all__ = ["TokenTuneCallback", "TokenTuneConfig", "TokenTuneModel", "find_token_selector"]

register_method("tokentune", TokenTuneConfig, TokenTuneModel)
