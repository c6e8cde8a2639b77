"""The planner's private torch APIs (fake tensors, a hook on every operator) and one transformers internal that
reads tensor values (``one_sequence_per_row``); ``tests/project/test_compat.py`` tests each, as for
``peft_slim.compat``."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
import transformers.masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode

# Private modules: ``TorchDispatchMode``, a hook on every operator call (the planner follows the bytes of every tensor
# created), and ``tree_leaves``, the tensors among an operator's nested outputs and arguments.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._pytree import tree_leaves as tree_leaves

from ..compat import is_fake_tensor

# The operator a tensor's ``.device`` dispatches to inside a mode (``torch.ops``: the operator registry).
PRIM_DEVICE = torch.ops.prim.device.default


def device_of_fake(tensor) -> Any:
    """The device a fake tensor reports (``FakeTensor.fake_device``, private) as fake tensor mode answers
    ``prim.device`` outside its kernels, without a dispatch through the mode; None where that is not the answer
    (not a fake tensor, or inside a fake kernel, where the answer is "meta")."""
    if is_fake_tensor(tensor) and not tensor.fake_mode.in_kernel_invocation:
        return tensor.fake_device
    return None


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (private module ``torch._subclasses.fake_tensor``): inside it, operators compute shapes,
    dtypes and strides only. Real tensors given to an operator are converted (``allow_non_fake_inputs``): the
    planner passes real token ids and labels, which the token selection reads."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """Inside it, transformers' mask builders find no packed sequences in fake position ids, as they find none in
    the real ones of the planner's inputs (the model's own: one sequence per row).

    Internal API: ``transformers.masking_utils.find_packed_sequence_indices``, which the mask builders call through
    the module without an attention mask. It reads the position ids' values: on fake ones it would return a tensor,
    and a ``[batch, 1, seq, seq]`` mask would be built that the real step (SDPA's ``is_causal``) never builds.
    """
    module = transformers.masking_utils
    find = module.find_packed_sequence_indices

    def find_in_real_ones(position_ids):
        return None if is_fake_tensor(position_ids) else find(position_ids)

    module.find_packed_sequence_indices = find_in_real_ones
    try:
        yield
    finally:
        module.find_packed_sequence_indices = find
