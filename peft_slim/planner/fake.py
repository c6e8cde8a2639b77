"""The planner's private torch APIs: a training step on tensors that have shapes but no data, and a hook on every
operator to follow their bytes; and one transformers internal that reads tensor values where fake tensors have none
(``one_sequence_per_row``). ``tests/test_compat.py`` tests each on the installed versions (see
``peft_slim.compat``, which holds the fake-tensor checks the training code itself makes: ``is_fake_tensor``,
``outside_fake_mode``)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import transformers.masking_utils
from torch._subclasses.fake_tensor import FakeTensorMode

# ``TorchDispatchMode`` (private module ``torch.utils._python_dispatch``): a Python hook on every operator call, which
# the planner uses to follow the bytes of every tensor an operator creates. ``tree_leaves`` (private module
# ``torch.utils._pytree``): the tensors among an operator's nested outputs and arguments.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._pytree import tree_leaves as tree_leaves

from ..compat import is_fake_tensor


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (private module ``torch._subclasses.fake_tensor``): inside it, operators compute shapes,
    dtypes and strides only. Real tensors given to an operator are converted (``allow_non_fake_inputs``): the
    planner passes real token ids and labels, which the token selection reads."""
    return FakeTensorMode(allow_non_fake_inputs=True)


@contextlib.contextmanager
def one_sequence_per_row() -> Iterator[None]:
    """Inside it, transformers' mask builders find no packed sequences in fake position ids, as they find none in
    the real ones of the planner's inputs.

    Internal API: ``transformers.masking_utils.find_packed_sequence_indices``, which ``create_causal_mask`` (and the
    sliding-window and chunked variants) calls, through the module, when a forward gets no attention mask. It reads
    the position ids' values: on real ones with a single sequence per row it returns None and the causal mask can
    be left to SDPA's ``is_causal`` (no mask is built or kept for backward); on fake ones, which have no values, it
    returns its packed-sequence tensor, so a ``[batch, 1, seq, seq]`` mask would be built that the real step never
    builds. The planner passes no position ids: the model's own (consecutive positions) hold one sequence per row.
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
