"""Running each transformer block on all tokens without grad, and on the selected tokens with grad only in backward.

Hooks and a forward wrapper on each block, so the model keeps its structure and state-dict keys: the pre-hook runs
the block on every token under ``torch.no_grad()`` (the attention function records keys/values) and hands the block
the selected hidden states, with per-position arguments (mask rows, rotary embeddings, position ids) cut to them;
the wrapped forward returns the no-grad pass's values there, recomputed with grad in backward (``recompute.py``),
unless the block draws random numbers (dropout): then it runs with grad now, after a notice; the forward hook
scatters the selected outputs back into the no-grad outputs.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
from torch import nn
from transformers import Cache

from ..compat import (
    checkpointing_function,
    checkpointing_paused,
    get_attn_implementation,
    is_fake_tensor,
    set_attn_implementation,
    set_checkpointing_function,
)
from ..compression.classify import save_as
from .attention import PASS_KWARG, BlockPass, UnroutedCalls
from .invariant import NOT_SUPPORTED_FIX, check_selected_pass, layout, refusal
from .recompute import RandomOps, selected_pass
from .selection import TokenSelection

# Per-position block arguments and the dimension that indexes the query position.
_PER_POSITION_ARGS = {"attention_mask": -2, "position_embeddings": 1, "position_ids": 1, "per_layer_input": 1}


def find_blocks(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The model's stack of transformer blocks: the largest ModuleList of identical layers."""
    sizes = {
        (name, module): sum(p.numel() for p in module.parameters())
        for name, module in model.named_modules()
        if isinstance(module, nn.ModuleList) and len({type(child) for child in module}) == 1
    }
    best = max(sizes, key=sizes.get, default=None)  # the first of equal sizes
    if best is None or sizes[best] == 0:
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
        raise _uncuttable(value, name, block_name)
    dim, batch = dim % value.dim(), selection.index.shape[0]
    if value.shape[dim] == 1:  # one row for every query position (a [B, 1, 1, L] mask, say): any subset's too
        return value
    full = value.expand((batch,) + tuple(value.shape[1:])) if value.shape[0] != batch else value
    return selection.memo(("cut", id(value), dim), lambda: selection.gather(full, dim), source=value)


def _uncuttable(value: Any, name: str, block_name: str) -> ValueError:
    return ValueError(
        f"TokenTune cannot train {block_name} on a token subset: {NOT_SUPPORTED_FIX}. Its argument `{name}` is a "
        f"{type(value).__name__} (e.g. one mask per layer type), where token selection supports tensors only."
    )


def _check_cuttable(value: Any, name: str, block_name: str) -> None:
    """Refuse, before the block runs, a per-position argument ``_cut`` could not restrict (a dict, say)."""
    if isinstance(value, (tuple, list)):
        for item in value:
            _check_cuttable(item, name, block_name)
    elif value is not None and not isinstance(value, torch.Tensor) and _has_tensor(value):
        raise _uncuttable(value, name, block_name)


class BlockRunner:
    """Installs the two hooks on every block; ``current`` returns the active selection or None."""

    def __init__(self, blocks: nn.ModuleList, current: Callable[[torch.Tensor], TokenSelection | None], config: Any):
        self.current = current
        self.config = config  # the model config whose `_attn_implementation` routes attention to TokenTune
        self.blocks = blocks
        # One signature per block, taken once: inspecting it on every call is a hot-path cost. Keyed by id(), so a
        # copy (deepcopy, pickle) starts with none: its blocks are other objects (see __getstate__).
        self.signatures: dict[int, inspect.Signature] = {}
        self.handles = []
        self.warned_random = False
        self.warned_cache = False
        # (id(block), argument layout) whose selected pass was checked against the full pass (invariant.py), in the
        # forward and in its recomputation in backward. Keyed by id() as `signatures` is.
        self.checked: set = set()
        self.recompute_checked: set = set()
        for block in blocks:
            self.handles.append(block.register_forward_pre_hook(self._before, with_kwargs=True))
            self.handles.append(block.register_forward_hook(self._after, with_kwargs=True))
            block.forward = _BlockForward(block, self)

    def __getstate__(self) -> dict:
        return {**self.__dict__, "signatures": {}, "checked": set(), "recompute_checked": set()}

    def _signature(self, block: nn.Module) -> inspect.Signature:
        signature = self.signatures.get(id(block))
        if signature is None:
            signature = self.signatures[id(block)] = inspect.signature(_unwrapped_forward(block))
        return signature

    def remove(self) -> None:
        """Remove the hooks, the forward wrappers and ``_route_checkpoint_replay``: the blocks are as they were."""
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for block in self.blocks:
            wrapper = block.__dict__.get("forward")
            if isinstance(wrapper, _BlockForward):
                if wrapper.inner is None:
                    del block.forward
                else:
                    block.forward = wrapper.inner
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
        block_name = type(block).__name__
        selection = self.current(hidden, block_name)
        if selection is None:  # outside training forwards: nothing to bind
            return None
        bound = signature.bind(*args, **kwargs)
        block_pass = BlockPass(selection=selection)
        extra_name = next((p.name for p in params if p.kind is inspect.Parameter.VAR_KEYWORD), None)
        if extra_name is None:
            raise ValueError(
                f"TokenTune cannot train {block_name} on a token subset: {NOT_SUPPORTED_FIX}. Its forward takes no "
                "**kwargs, so its attention call cannot receive the block's token-selection state."
            )
        extra = dict(bound.arguments.get(extra_name, {}))
        bound.arguments[extra_name] = extra
        for arguments in (bound.arguments, extra):
            for name, value in list(arguments.items()):
                if isinstance(value, Cache):
                    arguments[name] = self._without_cache(block_name, name, value)
        for name in _PER_POSITION_ARGS:
            _check_cuttable(bound.arguments.get(name, extra.get(name)), name, block_name)
        extra[PASS_KWARG] = block_pass
        check_key = (id(block), layout(bound.arguments))

        full_args, full_kwargs = bound.args, bound.kwargs
        random_ops = RandomOps()
        UnroutedCalls.names = unrouted = []
        try:
            with torch.no_grad(), random_ops:
                full_output = block.forward(*full_args, **full_kwargs)
        finally:
            UnroutedCalls.names = None
        full_hidden = full_output[0] if isinstance(full_output, (tuple, list)) else full_output
        if block_pass.full_calls != 1 or not isinstance(full_hidden, torch.Tensor):
            raise ValueError(_calls_refusal(block_name, block_pass.full_calls, unrouted))
        if full_hidden.shape[:2] != hidden.shape[:2]:
            raise ValueError(
                f"TokenTune cannot train {block_name} on a token subset: {NOT_SUPPORTED_FIX}. It returns hidden "
                f"states of shape {tuple(full_hidden.shape)} for an input of shape {tuple(hidden.shape)}, where token "
                "selection needs one output position per input position."
            )

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
        block_pass.recompute_in_backward = random_ops.found is None
        if check_key not in self.checked and not is_fake_tensor(hidden):  # a memory estimate: shapes only
            self._check_selected_pass(block, bound, (full_args, full_kwargs), block_pass, random_ops.found)
            self.checked.add(check_key)
        if check_key not in self.recompute_checked:
            block_pass.check_recompute = check_key
        if not block_pass.recompute_in_backward:
            if not self.warned_random:
                self.warned_random = True
                warnings.warn(
                    f"TokenTune: {block_name} draws random numbers in training ({random_ops.found}: dropout, say), "
                    "so its selected tokens run a second forward with grad (a slower step). Set the dropout "
                    "probabilities to 0 (model config, LoRA's lora_dropout) for TokenTune's one-forward step.",
                    UserWarning,
                    stacklevel=1,
                )
            self._route_checkpoint_replay(block)
        return bound.args, bound.kwargs

    def run_selected(self, block: nn.Module, args: tuple, kwargs: dict, block_pass: BlockPass):
        """The block's output on the selected tokens: the no-grad pass's values, recomputed with grad in backward.
        The autograd node holds the block weakly: a graph kept after training (a stored loss) must not keep the model.
        """
        full = block_pass.full_output
        full_hidden = full[0] if isinstance(full, (tuple, list)) else full
        output = block_pass.selection.gather(full_hidden, 1)
        parameters = [p for p in block.parameters() if p.requires_grad]
        config = self.config
        attention = get_attn_implementation(config)
        # Every token's keys and values enter the recomputed attention, but the selected ones are recomputed there:
        # only the unselected ones are kept (by the autograd node only).
        selection, shapes = block_pass.selection, (block_pass.key.shape, block_pass.value.shape)
        key, value = selection.unselected_part(block_pass.key, 2), selection.unselected_part(block_pass.value, 2)
        save_as("attention", key, value)  # compressed as attention tensors, though the block saves them
        block_pass.key = block_pass.value = None
        block_ref = weakref.ref(block)

        def run(arguments: tuple) -> Any:
            block = block_ref()
            args, kwargs, key, value = arguments
            block_pass.key = selection.with_unselected(key, shapes[0], 2)
            block_pass.value = selection.with_unselected(value, shapes[1], 2)
            forward = _unwrapped_forward(block)
            try:
                with checkpointing_paused(block):
                    return _run_under_attention(attention, config, forward, *args, **kwargs)
            finally:
                block_pass.key = block_pass.value = None

        check = None
        if block_pass.check_recompute is not None:
            check = _RecomputeCheck(self, type(block).__name__, output, block_pass.check_recompute)
        hidden = selected_pass(run, output, (args, kwargs, key, value), parameters, check)
        return type(full)((hidden, *full[1:])) if isinstance(full, (tuple, list)) else hidden

    def _check_selected_pass(self, block, bound, full_call: tuple, block_pass: BlockPass, random_op: str | None):
        """TokenTune's one assumption about ``block`` (invariant.py): its selected pass, run now without grad, gives
        the full pass's outputs at the selected tokens. A block that draws random numbers runs both passes again in
        eval mode for it (dropout off), since its training-mode draws differ between any two runs."""
        name, selection, forward = type(block).__name__, block_pass.selection, _unwrapped_forward(block)
        if random_op is None:
            full, check_pass = block_pass.full_output, block_pass
        else:
            check_pass = BlockPass(selection=selection)
        args, kwargs = bound.args, {**bound.kwargs, PASS_KWARG: check_pass}
        with _eval_mode(block if random_op is not None else None):
            if random_op is not None:
                with torch.no_grad():
                    full = forward(*full_call[0], **{**full_call[1], PASS_KWARG: check_pass})
                check_pass.phase = "selected"
            full_hidden = full[0] if isinstance(full, (tuple, list)) else full
            expected = selection.gather(full_hidden, 1)
            check_selected_pass(name, lambda: forward(*args, **kwargs), expected, selection)

    def _without_cache(self, block_name: str, name: str, cache: Cache) -> None:
        """An empty KV cache the model made itself (its forward may take no `use_cache`, its config default to True)
        is dropped: the block computes the same without it, and does not fill it twice. One holding positions is
        refused."""
        try:
            held = int(cache.get_seq_length())
        except Exception:  # noqa: BLE001 - no get_seq_length: how much it holds cannot be told
            held = None
        if held != 0:
            raise ValueError(
                f"TokenTune cannot train {block_name} on top of a KV cache: call the model in training without "
                f"`past_key_values` (or in eval mode / under torch.no_grad() to use it). Its `{name}` holds "
                f"{'an unknown number of' if held is None else held} positions, which the block's two passes would "
                "each extend."
            )
        if not self.warned_cache:
            self.warned_cache = True
            warnings.warn(
                f"TokenTune: the model passes an empty KV cache to {block_name} in training (its config's "
                "`use_cache`); it is not used in a training forward, which runs each block twice. Set "
                "`model.config.use_cache = False` to silence this.",
                UserWarning,
                stacklevel=1,
            )
        return None

    def _route_checkpoint_replay(self, block: nn.Module) -> None:
        """Make a gradient-checkpointing replay of the selected pass (``block._gradient_checkpointing_func``, run in
        backward after the forward restored ``config._attn_implementation``) use TokenTune's attention too: under the
        original name it would miss the recorded keys/values."""
        checkpoint_func = checkpointing_function(block)
        if checkpoint_func is None or getattr(checkpoint_func, "_tokentune_replay", False):
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


class _BlockForward:
    """A block's ``forward`` while token selection is attached: a training forward's selected pass goes to
    ``BlockRunner.run_selected``, every other call to the block's own forward (``inner``, one the instance already
    had, as accelerate's device hooks set, else the class's). An object, so a deep copy refers to the copy's block.
    """

    def __init__(self, block: nn.Module, runner: BlockRunner):
        self.block = block
        self.runner = runner
        self.inner = block.__dict__.get("forward")

    @property
    def __signature__(self) -> inspect.Signature:
        return inspect.signature(self.forward)

    @property
    def forward(self) -> Callable:
        return self.inner if self.inner is not None else partial(type(self.block).forward, self.block)

    def __call__(self, *args, **kwargs):
        block_pass: BlockPass | None = kwargs.get(PASS_KWARG)
        if block_pass is None or block_pass.phase != "selected" or not block_pass.recompute_in_backward:
            return self.forward(*args, **kwargs)
        return self.runner.run_selected(self.block, args, kwargs, block_pass)


def _unwrapped_forward(block: nn.Module) -> Callable:
    forward = block.forward
    return forward.forward if isinstance(forward, _BlockForward) else forward


class _ReplayUnderSameAttention:
    """``checkpoint_func`` whose function (first run and backward replay) sees today's attention name. An object
    rather than a closure, so that a block deep-copies (the copy's refers to the copy's config) and pickles."""

    _tokentune_replay = True

    def __init__(self, checkpoint_func: Callable, config: Any):
        self.__wrapped__ = checkpoint_func
        self.config = config

    def __call__(self, function, *args, **kwargs):
        return self.__wrapped__(
            partial(_run_under_attention, get_attn_implementation(self.config), self.config, function), *args, **kwargs
        )


def _run_under_attention(name: str, config: Any, function: Callable, *args, **kwargs):
    """``function`` run with ``config`` naming attention ``name``, as the forward did: the name it has while token
    selection is attached, so nothing is written unless it was detached before this backward."""
    saved = get_attn_implementation(config)
    if saved == name:
        return function(*args, **kwargs)
    set_attn_implementation(config, name)
    try:
        return function(*args, **kwargs)
    finally:
        set_attn_implementation(config, saved)


def _has_tensor(value: Any) -> bool:
    if isinstance(value, torch.Tensor):
        return True
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (tuple, list)):
        return any(_has_tensor(v) for v in value)
    return False


def _calls_refusal(block_name: str, calls: int, unrouted: list[str]) -> str:
    """Why a block whose full pass saw ``calls`` (not 1) attention calls cannot be trained, and what to do."""
    start = f"TokenTune cannot train {block_name} on a token subset: {NOT_SUPPORTED_FIX}."
    if calls == 0 and unrouted:
        return (
            f"{start} Its attention ({', '.join(dict.fromkeys(unrouted))}) calls transformers' attention function, "
            "but the layer does not pass its keyword arguments down to it, so token selection cannot reach the call."
        )
    if calls == 0:
        return (
            f"{start} It computes no attention through transformers' attention-function registry (a layer without "
            "attention, or one that computes it itself), which token selection needs to keep the unselected tokens' "
            "keys and values constant."
        )
    return (
        f"{start} It makes {calls} attention calls through transformers' attention-function registry, where token "
        "selection supports exactly one self-attention call per block."
    )


class _RecomputeCheck:
    """The first recomputation in backward of a block's selected pass for an argument layout must give an output of
    the forward's shape and dtype, as torch.utils.checkpoint checks its recomputation: a mismatch is refused before
    the optimizer step, not a crash deep in autograd. (Values are compared in the forward, where both passes see
    exact inputs: in backward, activation compression may have rounded them.)"""

    def __init__(self, runner: BlockRunner, block_name: str, expected: torch.Tensor, key):
        self.runner, self.block_name, self.key = runner, block_name, key
        self.shape, self.dtype = tuple(expected.shape), expected.dtype

    def __call__(self, recomputed: Any) -> None:
        recomputed = recomputed[0] if isinstance(recomputed, (tuple, list)) else recomputed
        found = (tuple(recomputed.shape), recomputed.dtype) if isinstance(recomputed, torch.Tensor) else recomputed
        if found != (self.shape, self.dtype):
            what = f"its output is {found}, where the forward's was {(self.shape, self.dtype)}"
            raise refusal(self.block_name, what, "recomputed in backward")
        self.runner.recompute_checked.add(self.key)


class _eval_mode:
    """``module`` (and its submodules) in eval mode inside, each restored to its own mode after; None: nothing."""

    def __init__(self, module: nn.Module | None):
        self.module = module

    def __enter__(self):
        self.modes = [] if self.module is None else [(m, m.training) for m in self.module.modules()]
        for module, _ in self.modes:
            module.training = False

    def __exit__(self, *exc):
        for module, mode in self.modes:
            module.training = mode
