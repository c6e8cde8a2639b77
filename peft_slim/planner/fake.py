"""The planner's private torch APIs: a training step on tensors that have shapes but no data, and a hook on every
operator to follow their bytes. ``tests/test_compat.py`` tests each on the installed torch (see ``peft_slim.compat``,
which holds the fake-tensor checks the training code itself makes: ``is_fake_tensor``, ``outside_fake_mode``)."""

from __future__ import annotations

from typing import Any

from torch._subclasses.fake_tensor import FakeTensorMode

# ``TorchDispatchMode`` (private module ``torch.utils._python_dispatch``): a Python hook on every operator call, which
# the planner uses to follow the bytes of every tensor an operator creates. ``tree_leaves`` (private module
# ``torch.utils._pytree``): the tensors among an operator's nested outputs and arguments.
from torch.utils._python_dispatch import TorchDispatchMode as TorchDispatchMode
from torch.utils._pytree import tree_leaves as tree_leaves


def fake_tensor_mode() -> Any:
    """A ``FakeTensorMode`` (private module ``torch._subclasses.fake_tensor``): inside it, operators compute shapes,
    dtypes and strides only. Real tensors given to an operator are converted (``allow_non_fake_inputs``): the
    planner passes real token ids and labels, which the token selection reads."""
    return FakeTensorMode(allow_non_fake_inputs=True)
