"""This process's rank in a ``torch.distributed`` run (0 in a single process)."""

from __future__ import annotations

import os

import torch.distributed as dist


def rank() -> int:
    """This process's rank: from the process group once initialised, else torchrun's ``RANK`` variable."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))
