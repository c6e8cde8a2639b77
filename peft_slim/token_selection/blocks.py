"""Running one transformer block on all tokens without grad, then on the selected tokens with grad.

Forward hooks do this around each block, so the model keeps its structure and state-dict keys:

* the pre-hook runs the block's ``forward`` under ``torch.no_grad()`` on every token (exact outputs
  for all positions, keys/values recorded by the attention function), then hands the block only the
  selected hidden states, with per-position arguments (mask rows, rotary embeddings, position ids)
  cut to the same positions;
* the block then runs normally (with grad, gradient checkpointing included) on the selected tokens;
* the forward hook scatters those outputs back into the no-grad outputs.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import Cache

from ..compat import (
    checkpointing_function,
    get_attn_implementation,
    set_attn_implementation,
    set_checkpointing_function,
)
from .attention import PASS_KWARG, BlockPass
from .selection import TokenSelection

# Per-position block arguments and the dimension that indexes the query position.
_PER_POSITION_ARGS = {"attention_mask": -2, "position_embeddings": 1, "position_ids": 1}


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of transformer blocks: the largest ModuleList of identical layers."""
    best, best_size = None, 0
    for name, module in model.named_modules():
        if not isinstance(module, nn.ModuleList) or len(module) == 0:
            continue
        if len({type(child) for child in module}) != 1:
            continue
        size = sum(p.numel() for p in module.parameters())
        if size > best_size:
            best, best_size = (name, module), size
    if best is None:
        raise ValueError(
            f"TokenTune could not find the transformer blocks of {type(model).__name__}: it looks for an "
            "nn.ModuleList of identical layers (e.g. `model.layers`, `encoder.layer`)."
        )
    return best


def _cut(value: Any, selection: TokenSelection, dim: int, name: str, block_name: str) -> Any:
    """``value`` restricted to the selected query positions along ``dim``."""
    if value is None:
        return None
    if isinstance(value, (tuple, list)):
        return type(value)(_cut(v, selection, dim, name, block_name) for v in value)
    if not isinstance(value, torch.Tensor):
        raise ValueError(f"TokenTune: unexpected {type(value).__name__} for argument `{name}` of {block_name}.")
    dim = dim % value.dim()
    batch = selection.index.shape[0]

    def cut() -> torch.Tensor:
        full = value.expand((batch,) + tuple(value.shape[1:])) if value.shape[0] != batch else value
        return selection.gather(full, dim)

    return selection.memo(("cut", id(value), dim), cut, source=value)


class BlockRunner:
    """Installs the two hooks on every block; ``current`` returns the active selection or None."""

    def __init__(
        self,
        blocks: nn.ModuleList,
        current: Callable[[torch.Tensor], TokenSelection | None],
        config: Any = None,
    ):
        self.current = current
        self.config = config  # the model config whose `_attn_implementation` routes attention to TokenTune
        self.blocks = blocks
        # One signature per block, taken once: inspecting it on every call is a hot-path cost. Keyed by id(), so a
        # copy (deepcopy, pickle) starts with none: its blocks are other objects (see __getstate__).
        self.signatures: dict[int, inspect.Signature] = {}
        self.handles = []
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._before, with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._after, with_kwargs=True))

    def __getstate__(self) -> dict:
        return {**self.__dict__, "signatures": {}}

    def _signature(self, block: nn.Module) -> inspect.Signature:
        signature = self.signatures.get(id(block))
        if signature is None:
            signature = self.signatures[id(block)] = inspect.signature(block.forward)
        return signature

    def remove(self) -> None:
        """Remove the hooks and undo ``_route_checkpoint_replay``: the blocks are as they were."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for block in self.blocks:
            checkpoint_func = checkpointing_function(block)
            if getattr(checkpoint_func, "_tokentune_replay", False):
                set_checkpointing_function(block, checkpoint_func.__wrapped__)

    def _before(self, block: nn.Module, args: tuple, kwargs: dict):
        if PASS_KWARG in kwargs:  # already prepared (e.g. a wrapper that calls the block again)
            return None
        signature = self._signature(block)
        params = list(signature.parameters.values())
        hidden_name = params[0].name
        hidden = args[0] if args else kwargs.get(hidden_name)
        selection = self.current(hidden)
        if selection is None:  # outside training forwards: nothing to bind
            return None
        bound = signature.bind(*args, **kwargs)
        block_name = type(block).__name__
        block_pass = BlockPass(selection=selection, block_name=block_name)
        extra_name = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        if extra_name is None:
            raise ValueError(
                f"TokenTune: {block_name}.forward takes no **kwargs, so the attention function cannot receive "
                "TokenTune's per-block state. This architecture is not supported."
            )
        extra = dict(bound.arguments.get(extra_name, {}))
        for name, value in [*bound.arguments.items(), *extra.items()]:
            if isinstance(value, Cache):
                raise ValueError(
                    f"TokenTune: {block_name} received a KV cache (`{name}`) in a training forward; each block runs "
                    "twice, so the cache would be filled twice. Train without a cache (use_cache=False)."
                )
        extra[PASS_KWARG] = block_pass
        bound.arguments[extra_name] = extra

        with torch.no_grad():
            full_output = block.forward(*bound.args, **bound.kwargs)
        full_hidden = full_output[0] if isinstance(full_output, (tuple, list)) else full_output
        if block_pass.full_calls != 1 or not isinstance(full_hidden, torch.Tensor):
            found = "no call" if block_pass.full_calls == 0 else f"{block_pass.full_calls} calls"
            raise ValueError(
                f"TokenTune cannot train {block_name} on a token subset: it needs exactly one self-attention "
                f"call through transformers' attention-function registry per block, and saw {found}. "
                "Unselected tokens would silently receive gradients, so this architecture is not supported."
            )
        if full_hidden.shape[:2] != hidden.shape[:2]:
            raise ValueError(f"TokenTune: {block_name} changed the sequence shape; it cannot be supported.")

        for name, value in list(bound.arguments.items()):
            if name in (hidden_name, extra_name) or value is None or not _has_tensor(value):
                continue
            if name not in _PER_POSITION_ARGS:
                raise ValueError(
                    f"TokenTune does not know how to restrict argument `{name}` of {block_name} to the selected "
                    "tokens; this use of the block (e.g. cross-attention or a cache) is not supported in training."
                )
            bound.arguments[name] = _cut(value, selection, _PER_POSITION_ARGS[name], name, block_name)
        for name, dim in _PER_POSITION_ARGS.items():
            if name in extra and extra[name] is not None:
                extra[name] = _cut(extra[name], selection, dim, name, block_name)
        bound.arguments[hidden_name] = selection.gather(hidden, 1)
        block_pass.phase = "selected"
        block_pass.full_output = full_output
        self._route_checkpoint_replay(block)
        return bound.args, bound.kwargs

    def _route_checkpoint_replay(self, block: nn.Module) -> None:
        """Make a gradient-checkpointing replay of the selected pass use TokenTune's attention too.

        transformers checkpoints the block's ``forward`` through ``block._gradient_checkpointing_func``; the
        replay runs in backward, after the model forward has restored ``config._attn_implementation``, so
        the attention function would be looked up under the original name and miss the recorded keys/values.
        """
        checkpoint_func = checkpointing_function(block)
        if self.config is None or checkpoint_func is None or getattr(checkpoint_func, "_tokentune_replay", False):
            return
        set_checkpointing_function(block, _ReplayUnderSameAttention(checkpoint_func, self.config))

    def _after(self, block: nn.Module, args: tuple, kwargs: dict, output: Any):
        block_pass: BlockPass | None = kwargs.get(PASS_KWARG)
        if block_pass is None:
            return None
        # Keys/values stay on the pass: gradient checkpointing replays the selected pass in backward.
        full, block_pass.full_output = block_pass.full_output, None
        if isinstance(output, (tuple, list)):
            merged = block_pass.selection.scatter(full[0], output[0], dim=1)
            return type(output)((merged, *full[1:]))
        return block_pass.selection.scatter(full, output, dim=1)


class _ReplayUnderSameAttention:
    """``checkpoint_func`` whose function (first run and backward replay) sees today's attention name.

    An object rather than a closure, so that a block deep-copies (the copy's refers to the copy's config) and pickles.
    """

    _tokentune_replay = True

    def __init__(self, checkpoint_func: Callable, config: Any):
        self.__wrapped__ = checkpoint_func
        self.config = config

    def __call__(self, function, *args, **kwargs):
        return self.__wrapped__(
            partial(_run_under_attention, get_attn_implementation(self.config), self.config, function), *args, **kwargs
        )


def _run_under_attention(name: str, config: Any, function: Callable, *args, **kwargs):
    saved = get_attn_implementation(config)
    set_attn_implementation(config, name)
    try:
        return function(*args, **kwargs)
    finally:
        set_attn_implementation(config, saved)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    return False
