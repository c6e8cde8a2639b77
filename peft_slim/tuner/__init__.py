"""What TokenTune and SlimFit share: the config base and the tuner base a peft_slim method stands on."""

from .config import MethodConfig
from .model import MethodTuner, find_tuner

__all__ = ["MethodConfig", "MethodTuner", "find_tuner"]
