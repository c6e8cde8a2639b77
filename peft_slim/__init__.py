"""peft_slim: memory-lean fine-tuning methods as first-class PEFT tuner types.

Importing this package registers ``PeftType.TOKENTUNE`` and ``PeftType.SLIMFIT`` with PEFT, so ``get_peft_model``,
``PeftConfig.from_pretrained``, ``PeftModel.from_pretrained`` and ``AutoPeftModel*`` know it.
"""

from . import versions  # noqa: F401  (first: refuses unsupported torch / transformers / peft with a clear message)
from .compression import ActivationCompressionConfig, compress_activations
from .export import export_lora
from .planner import MemoryEstimate, estimate_memory, plan
from .slimfit import SlimFitCallback, SlimFitConfig, SlimFitModel
from .token_selection import TokenSelectionConfig
from .tokentune import TokenTuneCallback, TokenTuneConfig, TokenTuneModel

__version__ = "0.1.0"

__all__ = [
    "ActivationCompressionConfig",
    "MemoryEstimate",
    "SlimFitCallback",
    "SlimFitConfig",
    "SlimFitModel",
    "TokenSelectionConfig",
    "TokenTuneCallback",
    "TokenTuneConfig",
    "TokenTuneModel",
    "compress_activations",
    "estimate_memory",
    "export_lora",
    "plan",
    "__version__",
]
