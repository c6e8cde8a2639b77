"""Token selection's training forward, as hooks on a transformers model: select tokens, run blocks twice, score.

A component any tuner attaches (TokenTune always, SlimFit with its ``tokentune`` field): ``attach`` refuses a
model it cannot make exact before changing anything, ``detach`` leaves the model as it was.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import get_attn_implementation, set_attn_implementation
from .attention import REGISTERED_NAMES, SUPPORTED_IMPLEMENTATIONS
from .blocks import BlockRunner, find_blocks
from .config import TokenSelectionConfig
from .heads import head_kind, is_decoder
from .loss import IGNORE_INDEX, selected_token_loss
from .selection import TokenSelection, check_token_mask, draw_selection, forced_positions, selection_generator


@dataclass
class _TrainingForward:
    """What one training forward carries from the model's pre-hook to its blocks and its end."""

    padding_mask: torch.Tensor | None
    labels: torch.Tensor | None
    token_mask: torch.Tensor | None
    num_items_in_batch: Any
    attn_implementation: str
    selection: TokenSelection | None = None


def check_attention_implementation(model: nn.Module) -> None:
    implementation = get_attn_implementation(model.config)
    if implementation not in SUPPORTED_IMPLEMENTATIONS:
        raise ValueError(
            f"TokenTune needs attn_implementation in {SUPPORTED_IMPLEMENTATIONS}; "
            f"{type(model).__name__} uses {implementation!r}. Load it with attn_implementation='sdpa'."
        )


class TokenSelector:
    """Token selection's hooks on ``model``, active in training forwards only (train mode and grad enabled).

    Every block runs on all tokens without gradient tracking, then again on the selected tokens with it;
    unselected keys and values enter attention as constants. The loss covers selected positions only, and
    a causal LM's head runs only on them. Selections are drawn from a generator seeded with
    ``config.seed`` plus the process's rank.
    """

    def __init__(self, model: nn.Module, config: TokenSelectionConfig):
        self.check(model)
        self.model = model
        self.config = config
        self.last_token_mask: torch.Tensor | None = None
        self.generator = selection_generator(config.seed)
        self._head = head_kind(model)
        self._decoder = is_decoder(model)
        self._state: _TrainingForward | None = None
        # Computed once: inspecting the signature on every forward cost ~19% of a tiny model's generate().
        self._forward_signature = inspect.signature(model.forward)
        _, blocks = find_blocks(model)
        self._runner: BlockRunner | None = BlockRunner(blocks, self._selection_for, model.config)
        self._handles = [
            model.register_forward_pre_hook(self._before_forward, with_kwargs=True),
            model.register_forward_hook(self._after_forward, with_kwargs=True, always_call=True),
        ]
        if self._head == "causal_lm":
            self._handles.append(model.get_output_embeddings().register_forward_pre_hook(self._before_head))

    @classmethod
    def attach(cls, model: nn.Module, config: TokenSelectionConfig) -> TokenSelector:
        """Put token selection on ``model`` (a transformers model); ``detach()`` removes it."""
        return cls(model, config)

    @staticmethod
    def check(model: nn.Module) -> None:
        """Refuse a model whose attention or head token selection cannot make exact, before changing it."""
        check_attention_implementation(model)
        head_kind(model)
        find_blocks(model)

    @property
    def active(self) -> bool:
        return self.model.training and torch.is_grad_enabled()

    def detach(self) -> None:
        """Remove every hook: the model is as it was before ``attach``."""
        if self._runner is not None:
            self._runner.remove()
            self._runner = None
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _before_forward(self, model: nn.Module, args: tuple, kwargs: dict):
        token_mask = kwargs.pop("token_mask", None)
        self._state = None
        if not self.active:
            return args, kwargs
        implementation = get_attn_implementation(model.config)
        if implementation not in SUPPORTED_IMPLEMENTATIONS:
            raise ValueError(
                f"TokenTune needs attn_implementation in {SUPPORTED_IMPLEMENTATIONS}, got {implementation!r}."
            )
        # Name every argument, so that a positional attention mask or labels are found (and labels removed).
        kwargs = named_arguments(model, self._forward_signature, args, kwargs)
        args = ()
        padding_mask = kwargs.get("attention_mask")
        labels = kwargs.get("labels")
        num_items = None
        if self._head in ("causal_lm", "per_position") and labels is not None:
            kwargs.pop("labels")
            num_items = kwargs.pop("num_items_in_batch", None)
        # No KV cache in training: the full pass would write every key/value into it and the selected pass
        # would then attend over a cache longer than the sequence (decoders default to use_cache=True).
        if "use_cache" in self._forward_signature.parameters:
            kwargs["use_cache"] = False
        self._state = _TrainingForward(
            padding_mask=padding_mask if isinstance(padding_mask, torch.Tensor) and padding_mask.dim() == 2 else None,
            labels=labels,
            token_mask=token_mask,
            num_items_in_batch=num_items,
            attn_implementation=implementation,
        )
        set_attn_implementation(model.config, REGISTERED_NAMES[implementation])
        return args, kwargs

    def _selection_for(self, hidden: torch.Tensor) -> TokenSelection | None:
        state = self._state
        if state is None:
            return None
        if state.selection is None:
            state.selection = TokenSelection.from_mask(self._select(state, hidden))
            self.last_token_mask = state.selection.mask
        return state.selection

    def _select(self, state: _TrainingForward, hidden: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        device = hidden.device
        real = torch.ones(batch, length, dtype=torch.bool, device=device)
        if state.padding_mask is not None and tuple(state.padding_mask.shape) == (batch, length):
            real = state.padding_mask.to(device=device).bool()
        forced = torch.zeros_like(real)
        if self._head != "causal_lm" or self._decoder:
            forced = forced_positions(real, keep_first=True, keep_last=self._decoder)
        if state.token_mask is not None:
            return check_token_mask(state.token_mask, real, forced if self._head == "classification" else None)
        labelled = None
        labels = state.labels
        if labels is not None and labels.dim() == 2 and tuple(labels.shape) == (batch, length):
            labelled = labels.to(device) != IGNORE_INDEX
            if self._head == "causal_lm":
                labelled = torch.cat([labelled[:, 1:], torch.zeros_like(labelled[:, :1])], dim=1)
        return draw_selection(self.config, real, forced, labelled, self.generator)

    def _before_head(self, head: nn.Module, args: tuple):
        state = self._state
        if state is None or state.selection is None:
            return None
        hidden = args[0]
        if hidden.shape[1] != state.selection.mask.shape[1]:
            raise ValueError("TokenTune: the LM head must see every position in training (logits_to_keep=0).")
        return (state.selection.gather(hidden, 1), *args[1:])

    def _after_forward(self, model: nn.Module, args: tuple, kwargs: dict, output: Any):
        state, self._state = self._state, None
        if state is None:
            return None
        return self._finish_forward(model, state, output)

    def _finish_forward(self, model: nn.Module, state: _TrainingForward, output: Any):
        set_attn_implementation(model.config, state.attn_implementation)
        if state.selection is None or state.labels is None or self._head not in ("causal_lm", "per_position"):
            return None
        if output is None:  # the forward raised; always_call hooks still run
            return None
        logits = output["logits"] if isinstance(output, dict) else output[0]
        if self._head == "per_position":
            logits = state.selection.gather(logits, 1)
        loss = selected_token_loss(
            logits,
            state.labels.to(logits.device),
            state.selection,
            shift=self._head == "causal_lm",
            num_items_in_batch=state.num_items_in_batch,
        )
        if isinstance(output, dict):
            fields = {key: value for key, value in output.items() if key != "loss"}
            return type(output)(loss=loss, **fields)
        return (loss, *output)


def named_arguments(model: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """``args`` and ``kwargs`` of ``model.forward`` (whose signature is ``signature``) as one dict of keywords."""
    if not args:
        return kwargs
    bound = signature.bind(*args, **kwargs)
    named = {}
    for name, value in bound.arguments.items():
        if bound.signature.parameters[name].kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif bound.signature.parameters[name].kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"TokenTune: {type(model).__name__}.forward takes *args; pass inputs by keyword.")
        else:
            named[name] = value
    return named
