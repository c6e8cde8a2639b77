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
from torch.utils._python_dispatch import _disable_current_modes
from torch.utils._pytree import tree_leaves as tree_leaves
from torch.utils._pytree import tree_map_only as tree_map_only

from ..compat import is_fake_tensor

# The operator a tensor's ``.device`` dispatches to inside a mode (``torch.ops``: the operator registry).
PRIM_DEVICE = torch.ops.prim.device.default
# ``Tensor.to``'s operator: a real tensor moved to the meta device stands for itself (``LiveBytes``).
TO_COPY = torch.ops.aten._to_copy.default


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


# ``torch._fused_sdp_choice``'s answer for the CPU's fused kernel (``SDPBackend.flash_attention``).
_CPU_FLASH = 1


@contextlib.contextmanager
def attention_as_on_cpu() -> Iterator[None]:
    """Inside it, ``F.scaled_dot_product_attention`` on meta tensors runs the kernel it runs on CPU tensors of the
    same shapes (on the meta device it always takes its unfused path, which saves the attention weights).

    Private API: the operators ``aten._fused_sdp_choice`` (which kernel SDPA takes, asked of empty CPU tensors of
    the same shapes and strides, made with no mode active) and ``aten._scaled_dot_product_flash_attention_for_cpu``.
    """
    module = torch.nn.functional
    sdpa = module.scaled_dot_product_attention
    choices: dict[tuple, int] = {}

    def cpu_choice(*tensors, **options) -> int:
        key = (*((t.shape, t.stride(), t.dtype) if t is not None else None for t in tensors), *options.items())
        if key not in choices:
            with _disable_current_modes():
                empty = [t if t is None else torch.empty_strided(t.shape, t.stride(), dtype=t.dtype) for t in tensors]
                choices[key] = torch.ops.aten._fused_sdp_choice(*empty, **options)
        return choices[key]

    def as_on_cpu(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
        options = dict(dropout_p=dropout_p, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa)
        # (a boolean mask is converted to a float one first: left to the unfused path, which does so on meta too)
        on_meta = query.device.type == "meta" and (attn_mask is None or attn_mask.dtype != torch.bool)
        if on_meta and cpu_choice(query, key, value, attn_mask, **options) == _CPU_FLASH:
            flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
            return flash(query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]
        return sdpa(query, key, value, attn_mask, **options)

    module.scaled_dot_product_attention = as_on_cpu
    try:
        yield
    finally:
        module.scaled_dot_product_attention = sdpa
