"""peft_slim: memory-lean fine-tuning methods as first-class PEFT tuner types.

Importing this package registers ``PeftType.TOKENTUNE`` and ``PeftType.SLIMFIT`` with PEFT, so ``get_peft_model``,
``PeftConfig.from_pretrained``, ``PeftModel.from_pretrained`` and ``AutoPeftModel*`` know it; nothing of PEFT is
replaced. A LoRA-stacked adapter saves as a plain LoRA adapter (with the method's settings beside it, read by
``peft_slim.from_pretrained``). Full fine-tuning with a method is a transform of the plain model
(``peft_slim.tokentune_`` / ``peft_slim.slimfit_``), which saves as the checkpoint it is.
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
