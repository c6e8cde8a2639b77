"""peft_slim: memory-lean fine-tuning methods as PEFT tuner types over LoRA (``PeftType.TOKENTUNE`` and ``SLIMFIT``,
registered at import; nothing of PEFT replaced), and as transforms of a plain model for full fine-tuning
(``peft_slim.tokentune_`` / ``slimfit_``).
"""

from . import (
    quiet,  # noqa: F401  (then: imports peft with bitsandbytes' CPU probe warning silenced)
    versions,  # noqa: F401  (first: refuses unsupported torch / transformers / peft with a clear message)
)
from ._version import __version__
from .compression import ActivationCompressionConfig, compress_activations
from .planner import MemoryEstimate, estimate_memory, plan
from .slimfit import SlimFitCallback, SlimFitConfig, SlimFitModel, SlimFitTransform, slimfit_
from .token_selection import TokenSelectionConfig
from .tokentune import TokenTuneCallback, TokenTuneConfig, TokenTuneModel, TokenTuneTransform, tokentune_
from .tuner.saving import from_pretrained, load_adapter, load_config, save_pretrained

__all__ = [
    "ActivationCompressionConfig",
    "MemoryEstimate",
    "SlimFitCallback",
    "SlimFitConfig",
    "SlimFitModel",
    "SlimFitTransform",
    "TokenSelectionConfig",
    "TokenTuneCallback",
    "TokenTuneConfig",
    "TokenTuneModel",
    "TokenTuneTransform",
    "compress_activations",
    "estimate_memory",
    "from_pretrained",
    "load_adapter",
    "load_config",
    "plan",
    "save_pretrained",
    "slimfit_",
    "tokentune_",
    "__version__",
]
