"""The selected tokens' pass through a block: its outputs come from the no-grad pass over every token, and the block
runs with grad on the selected tokens only in backward, as activation checkpointing does (``SelectedPass``).

The no-grad pass already computes, exactly, what the selected pass would return at the selected positions, so a
step costs ``1 + 2r`` forwards at token ratio ``r``, at checkpointing's memory. This holds only when the block
computes the same values each time it runs: a block that draws random numbers (dropout) would draw other ones in
backward, so :class:`RandomOps` spots such a draw and that block runs the selected pass with grad in the forward
instead (``blocks.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ..compat import run_device_type

# Functions that draw random numbers, and how to tell that a call draws (for dropout: in training, p > 0).
_ALWAYS_RANDOM = {
    *(getattr(torch, name) for name in ("bernoulli", "multinomial", "normal", "poisson", "rand", "rand_like")),
    *(getattr(torch, name) for name in ("randint", "randint_like", "randn", "randn_like", "randperm")),
    *(getattr(torch.Tensor, name) for name in ("bernoulli", "bernoulli_", "cauchy_", "exponential_", "geometric_")),
    *(getattr(torch.Tensor, name) for name in ("log_normal_", "normal_", "random_", "uniform_")),
}
# dropout function -> the default of its `training` argument (p is argument 1, `training` argument 2)
_DROPOUTS = {
    **dict.fromkeys((F.dropout, F.dropout1d, F.dropout2d, F.dropout3d), True),
    **dict.fromkeys((F.alpha_dropout, F.feature_alpha_dropout), False),
    **dict.fromkeys((torch.dropout, torch.alpha_dropout, torch.feature_dropout, torch.feature_alpha_dropout), None),
}


def _argument(args: tuple, kwargs: dict, position: int, names: tuple[str, ...], default: Any) -> Any:
    if len(args) > position:
        return args[position]
    return next((kwargs[name] for name in names if name in kwargs), default)


def draws_random_numbers(func: Callable, args: tuple, kwargs: dict) -> bool:
    """Whether calling ``func(*args, **kwargs)`` draws random numbers."""
    if func in _ALWAYS_RANDOM:
        return True
    if func in _DROPOUTS:
        p = _argument(args, kwargs, 1, ("p",), 0.5)
        training = _argument(args, kwargs, 2, ("training", "train"), _DROPOUTS[func])
        return bool(training) and float(p) > 0
    if func is F.scaled_dot_product_attention:
        return float(_argument(args, kwargs, 4, ("dropout_p",), 0.0)) > 0
    if func is F.rrelu:
        return bool(_argument(args, kwargs, 3, ("training",), False))
    return False


class RandomOps(TorchFunctionMode):
    """Records the first torch function called inside it that draws random numbers (``found``), or None."""

    def __init__(self):
        super().__init__()
        self.found: str | None = None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.found is None and draws_random_numbers(func, args, kwargs):
            name = getattr(func, "__name__", repr(func))
            self.found = f"Tensor.{name}" if getattr(torch.Tensor, name, None) is func else f"torch {name}"
        return func(*args, **kwargs)


class SelectedPass(torch.autograd.Function):
    """``output`` (the no-grad pass's values at the selected slots) as the result of ``run(*inputs)``, run only in
    backward. ``inputs`` are kept through ``save_for_backward`` (so activation compression and the saved-activation
    measurement see them); they and ``parameters`` (what the block trains) receive the recomputation's gradients.
    """

    @staticmethod
    def forward(
        ctx, run: Callable, check: Callable | None, output: torch.Tensor, num_inputs: int, *inputs_and_parameters
    ):
        ctx.run, ctx.check = run, check
        ctx.parameters = inputs_and_parameters[num_inputs:]
        ctx.save_for_backward(*inputs_and_parameters[:num_inputs])
        return output

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        inputs = [t.detach().requires_grad_(needs) for t, needs in zip(ctx.saved_tensors, ctx.needs_input_grad[4:])]
        with torch.enable_grad():
            output = ctx.run(*inputs)
        if ctx.check is not None:
            ctx.check(output)
        wanted = [t for t in inputs if t.requires_grad] + list(ctx.parameters)  # backward runs: one needs grad
        grads = iter(torch.autograd.grad(output, wanted, grad_output, allow_unused=True))
        input_grads = [next(grads) if t.requires_grad else None for t in inputs]
        return (None, None, None, None, *input_grads, *grads)


def selected_pass(
    run: Callable[[Any], Any],
    output: torch.Tensor,
    arguments: Any,
    parameters: list[torch.Tensor],
    check: Callable[[torch.Tensor], None] | None = None,
) -> torch.Tensor:
    """``output`` with a backward that recomputes it as ``run(arguments)`` (and hands the result to ``check``).

    ``arguments`` is any nesting of tuples, lists and dicts; its tensors are kept through ``save_for_backward``
    (nothing else holds them) and handed back to ``run`` in the same places. ``run`` returns the block's output (a
    tensor, or a tuple whose first item is the hidden states). The forward's autocast state is restored for it.
    """
    inputs: list[torch.Tensor] = []
    skeleton = _strip(arguments, inputs)
    autocast = [
        (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))
        for kind in dict.fromkeys([run_device_type(output), "cpu"])
    ]

    def recompute(*tensors: torch.Tensor) -> torch.Tensor:
        with ExitStack() as stack:  # backward runs outside the forward's autocast contexts: enter the same ones
            for kind, enabled, dtype in autocast:
                stack.enter_context(torch.autocast(kind, dtype=dtype, enabled=enabled))
            result = run(_fill(skeleton, iter(tensors)))
        return result[0] if isinstance(result, (tuple, list)) else result

    return SelectedPass.apply(recompute, check, output, len(inputs), *inputs, *parameters)


_SLOT = object()  # where a tensor of the arguments goes back


def _strip(item: Any, tensors: list[torch.Tensor]) -> Any:
    """``item`` with its tensors (nested in tuples, lists and dicts) replaced by ``_SLOT`` and appended to ``tensors``.

    A module-level function, not a closure: a recursive closure is a reference cycle (the function, its cell) that
    would hold ``tensors`` until the garbage collector runs, keeping every uncompressed input of the selected pass
    alive after activation compression has stored its own copy.
    """
    if isinstance(item, torch.Tensor):
        tensors.append(item)
        return _SLOT
    if isinstance(item, (tuple, list)):
        return type(item)(_strip(part, tensors) for part in item)
    if isinstance(item, dict):
        return {key: _strip(part, tensors) for key, part in item.items()}
    return item


def _fill(skeleton: Any, tensors: Iterator[torch.Tensor]) -> Any:
    """``skeleton`` from ``_strip`` with its slots filled, in order, from ``tensors``."""
    if skeleton is _SLOT:
        return next(tensors)
    if isinstance(skeleton, (tuple, list)):
        return type(skeleton)(_fill(part, tensors) for part in skeleton)
    if isinstance(skeleton, dict):
        return {key: _fill(part, tensors) for key, part in skeleton.items()}
    return skeleton
