"""The first lines of a child process that loads adapters with vanilla PEFT only and records every warning."""

from __future__ import annotations

# PEFT imports bitsandbytes (when installed) on its own import (PEFT 0.21) or at the first LoRA load (later
# releases), and bitsandbytes' import warns torch's deprecations (``torch.jit.script_method``), no fault of an
# adapter's: the children import it up front, before the load whose warnings they record.
IMPORT_BITSANDBYTES = (
    "import importlib.util\nif importlib.util.find_spec('bitsandbytes') is not None:\n    import bitsandbytes\n"
)
