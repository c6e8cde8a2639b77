"""SlimFit: freeze most weight tensors at every step, chosen by how much each is still changing."""

from ..registry import register_method
from .callback import SlimFitCallback
from .config import SlimFitConfig
from .model import SlimFitModel
from .transform import SlimFitTransform, find_slimfit, slimfit_

__all__ = ["find_slimfit", "slimfit_", "SlimFitCallback", "SlimFitConfig", "SlimFitModel", "SlimFitTransform"]

register_method("slimfit", SlimFitConfig, SlimFitModel)
