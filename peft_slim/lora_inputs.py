"""LoRA keeps its input at the base model's width: no fp32 copy of a bf16/fp16 activation saved for backward.

PEFT casts each LoRA layer's input to the fp32 adapter's dtype before ``lora_A``, whose matmul saves that copy (twice
the input's bytes, once per adapted layer). Here ``lora_A`` saves the narrow input and upcasts it in forward and
backward: the same values, half the saved bytes. Only for plain ``lora.Linear`` layers (no dropout, which would round
differently; no variant, which uses the input elsewhere) outside autocast. The overrides are ``functools.partial``
objects set on the instance, so they deep-copy and pickle.
"""

from __future__ import annotations

from functools import partial

import torch
import torch.nn.functional as F
from peft.tuners.lora import Linear as LoraLinear
from torch import nn

from .compat import run_device_type, set_lora_input_cast


def keep_lora_inputs_narrow(model: nn.Module) -> int:
    """Install the narrow-input path on every plain LoRA ``Linear`` of ``model``; returns how many layers."""
    count = 0
    for module in model.modules():
        if type(module) is LoraLinear:
            set_lora_input_cast(module, partial(_cast_input, module))
            for lora_a in module.lora_A.values():
                if type(lora_a) is nn.Linear:
                    lora_a.forward = partial(_narrow_input_forward, lora_a)
            count += 1
    return count


def _plain(layer: LoraLinear) -> bool:
    return not layer.lora_variant and all(type(d) is nn.Identity for d in layer.lora_dropout.values())


def _cast_input(layer: LoraLinear, x, dtype: torch.dtype):
    """PEFT's ``_cast_input_dtype``, except that a narrower floating input of a plain layer is passed on as it is
    (``lora_A`` upcasts it)."""
    if x is None or not getattr(layer, "cast_input_dtype_enabled", True) or x.dtype == dtype:
        return x
    narrower = x.is_floating_point() and x.dtype.itemsize < dtype.itemsize and dtype.is_floating_point
    if narrower and _plain(layer) and not torch.is_autocast_enabled(run_device_type(x)):
        return x
    return x.to(dtype=dtype)


def _narrow_input_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    if x.dtype == self.weight.dtype:
        return F.linear(x, self.weight, self.bias)
    return _UpcastLinear.apply(x, self.weight, self.bias)


class _UpcastLinear(torch.autograd.Function):
    """``F.linear(x.to(weight.dtype), weight, bias)`` saving ``x`` in its own (narrower) dtype."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x.to(weight.dtype), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = grad.matmul(weight).to(x.dtype)  # as the cast's backward: the gradient in the input's dtype
        flat = grad.reshape(-1, grad.shape[-1])
        if ctx.needs_input_grad[1]:
            grad_weight = flat.t().mm(x.reshape(-1, x.shape[-1]).to(weight.dtype))
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = flat.sum(0)
        return grad_x, grad_weight, grad_bias
