"""Which models a peft_slim method can be handed, refused before anything changes: DeepSpeed ZeRO-3 (parameters
sharded to empty tensors before PEFT sees them; FSDP2, DDP and ZeRO-1/2 keep them whole), and for token selection
anything but a transformers model (it reads the config and the decoder blocks).
"""

from __future__ import annotations

from torch import nn
from transformers import PretrainedConfig, PreTrainedModel
from transformers.integrations import is_deepspeed_zero3_enabled


def check_model_kind(model: nn.Module, method: str, selects_tokens: bool) -> None:
    """Raise ``ValueError`` for a model ``method`` cannot train exactly, naming what is needed instead."""
    zero3 = ("ds_id", "ds_status", "ds_shape")  # what DeepSpeed ZeRO-3 sets on each parameter it partitions
    sharded = [name for name, param in model.named_parameters() if any(hasattr(param, key) for key in zero3)]
    if sharded or is_deepspeed_zero3_enabled():
        found = f"{len(sharded)} parameters partitioned, e.g. {sharded[0]!r}" if sharded else "ZeRO-3 is enabled"
        raise ValueError(
            f"{method} does not support DeepSpeed ZeRO-3 ({found}): it shards parameters to empty tensors before "
            "the adapter is injected. Use FSDP2 (fully_shard), DDP, or DeepSpeed ZeRO-1/2."
        )
    config = getattr(model, "config", None)
    if selects_tokens and not (isinstance(model, PreTrainedModel) and isinstance(config, PretrainedConfig)):
        raise ValueError(
            f"{method}'s token selection needs a transformers model (a PreTrainedModel with a `config`), got "
            f"{type(model).__name__}{'' if hasattr(model, 'config') else ' (no `config` attribute)'}. For another "
            "nn.Module use SlimFit without `token_selection`, or LoRA with `compress_activations`."
        )
