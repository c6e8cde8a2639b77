"""Saving a model trained under ``torch.distributed`` (DDP, FSDP2 ``fully_shard``, FSDP1).

Under FSDP every rank holds only a shard of each tensor, so ``model.save_pretrained`` on rank 0 alone
cannot write the adapter (it fails on the sharded tensors). :func:`save_pretrained` gathers full tensors
first, on every rank, and lets rank 0 write the usual PEFT files, which then load in a single process.
"""

from __future__ import annotations

import torch.distributed as dist
from torch import nn

from .process_rank import rank
from .tuner.saving import save_pretrained as atomic_save_pretrained


def unwrap(model: nn.Module) -> nn.Module:
    """The model inside DDP / FSDP1 wrappers (FSDP2 ``fully_shard`` keeps the model itself)."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    return model


def full_state_dict(model: nn.Module) -> dict:
    """The full, unsharded state dict on rank 0 (on CPU), ``{}`` on other ranks. Call it on every rank."""
    if not (dist.is_available() and dist.is_initialized()):
        return unwrap(model).state_dict()
    # torch.distributed.checkpoint is slow to import, and needed only under a process group
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def save_pretrained(model: nn.Module, save_directory: str, **kwargs) -> None:
    """``PeftModel.save_pretrained`` for a (possibly wrapped or sharded) model. Call it on every rank.

    Keys of the gathered state dict are those of the unwrapped PeftModel, which is what PEFT expects. Rank 0 saves
    through :func:`peft_slim.save_pretrained`: the folder holds the old adapter or the new one, never a mix.
    """
    state_dict = full_state_dict(model)
    if rank() == 0:
        atomic_save_pretrained(unwrap(model), save_directory, state_dict=state_dict, **kwargs)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
