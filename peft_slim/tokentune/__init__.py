"""TokenTune: the forward sees every token, gradients flow through a selected subset."""

from ..registry import register_method
from .config import TokenTuneConfig
from .model import TokenTuneModel

__all__ = ["TokenTuneConfig", "TokenTuneModel"]

register_method("tokentune", TokenTuneConfig, TokenTuneModel)
