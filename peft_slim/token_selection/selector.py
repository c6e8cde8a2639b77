"""Token selection's training forward, as hooks on a transformers model: select tokens, run the blocks, score.

A component any tuner attaches (TokenTune always, SlimFit with its ``token_selection`` field): ``attach`` refuses a
model it cannot make exact before changing anything, ``detach`` leaves the model as it was. A
``peft_slim.training_context.TrainingContext`` runs it at each forward of the model.
"""

from __future__ import annotations

import inspect
import warnings
import weakref
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..compat import (
    TRL_FUSED_HEAD_ARGUMENT,
    get_attn_implementation,
    is_fake_tensor,
    outside_fake_mode,
    set_attn_implementation,
)
from .attention import OUTSIDE_BLOCKS, REGISTERED_NAMES, SUPPORTED_IMPLEMENTATIONS
from .blocks import BlockRunner, find_blocks
from .chunked_loss import chunk_rows, chunked_head_loss
from .config import TokenSelectionConfig
from .fused_head import FUSED_METRICS_NOTE, check_fused_call, fused_output
from .heads import head_of, is_decoder
from .loss import IGNORE_INDEX, labelled_mean, selected_targets, selected_token_loss
from .outputs import check_output_flags
from .selection import (
    TokenSelection,
    check_token_mask,
    draw_selection,
    forced_positions,
    labelled_positions,
    selection_generator,
)


@dataclass
class _TrainingForward:
    """What one training forward carries from the model's pre-hook to its blocks and its end."""

    padding_mask: Any  # the forward's attention_mask, used when a [batch, seq] tensor
    labels: torch.Tensor | None
    token_mask: torch.Tensor | None
    num_items_in_batch: Any
    input_ids: Any = None  # where a classification head reads depends on them
    selection: TokenSelection | None = None
    head_input: torch.Tensor | None = None  # the selected hidden states, when the chunked loss takes the head's place
    head_output: Any = None  # what the head returned then (its logits over no position)
    fused: bool = False  # TRL's fused LM head asked for (`fused_lm_head=True`): answer in its output format


# Every attached selector (weakly): a config shared by several attached models keeps TokenTune's attention until the
# last of them detaches.
_ATTACHED: weakref.WeakSet = weakref.WeakSet()


def original_attention(config: Any) -> str | None:
    """The attention implementation ``config`` names, TokenTune's registered ones read as the original they run."""
    implementation = get_attn_implementation(config)
    return next((impl for impl, name in REGISTERED_NAMES.items() if name == implementation), implementation)


def _in_training_forward(selector: TokenSelector):
    """Whether ``selector`` (held weakly) is in a training forward now."""
    ref = weakref.ref(selector)

    def in_training_forward() -> bool:
        live = ref()
        return live is not None and live._state is not None

    return in_training_forward


# Config fields of models whose forward changes the head's logits before returning them (Gemma 2/3's soft-capping,
# Cohere's and Granite's scaling): the chunked loss, which calls the head itself, would miss that.
LOGIT_POSTPROCESSING_FIELDS = ("final_logit_softcapping", "logit_scale", "logits_scaling")


class TokenSelector:
    """Token selection's hooks on ``model``, active in training forwards only (train mode and grad enabled): the
    blocks as ``blocks.py`` runs them, the loss over the selected positions (a causal LM's head runs on them only),
    selections drawn from a generator seeded with ``config.seed`` plus the process's rank.
    """

    def __init__(self, model: nn.Module, config: TokenSelectionConfig):
        self.check(model)
        self.model = model
        self.config = config
        self.last_token_mask: torch.Tensor | None = None
        self.generator = selection_generator(config.seed)
        self._head = head_of(model)
        self._decoder = is_decoder(model)
        self._warned_cache = False
        self._warned_fused = False
        self._trainer_args: Any = None  # set_trainer_args
        self._state: _TrainingForward | None = None
        # Computed once: inspecting the signature on every forward cost ~19% of a tiny model's generate().
        self._forward_signature = inspect.signature(model.forward)
        self._chunked = config.chunked_loss and self._head.kind == "causal_lm" and not post_processes_logits(model)
        self._calling_head = False
        self._runner: BlockRunner | None = None
        self._handles: list = []
        self.reattach()

    def reattach(self) -> None:
        """Put this selector's hooks (back) on its model, keeping its generator: a model holding several adapters
        detaches an adapter's selector while another adapter is active, and reattaches it on switching back."""
        if self._runner is not None:
            return
        model = self.model
        blocks_name, blocks = find_blocks(model)
        self._runner = BlockRunner(blocks, self._selection_for, model.config)
        inside = {id(module) for module in blocks.modules()}
        in_training_forward = _in_training_forward(self)
        for name, module in model.named_modules():
            if id(module) not in inside:
                where = f"{type(model).__name__}.{name}" if name else type(model).__name__
                place = f"{where} ({type(module).__name__}, outside {blocks_name})"
                OUTSIDE_BLOCKS[module] = (place, in_training_forward)
        # The attention implementation is chosen here, once: TokenTune's registered function, which runs the
        # original one for every call outside a training forward's block passes (eval, generation, another model
        # sharing the config), until detach() restores the original name.
        self._attention = original_attention(model.config)
        set_attn_implementation(model.config, REGISTERED_NAMES[self._attention])
        _ATTACHED.add(self)
        self._handles = []
        if self._head.kind == "causal_lm":
            head = model.get_output_embeddings()
            self._handles.append(head.register_forward_pre_hook(self._before_head))
            self._handles.append(head.register_forward_hook(self._after_head))

    @property
    def trainer_args(self) -> Any:
        """The training arguments of the Trainer training the model now (``set_trainer_args``), or None."""
        return self._trainer_args

    def set_trainer_args(self, args: Any) -> None:
        """Tell the selector which Trainer trains the model (its ``TrainingArguments``; None once training ends):
        TRL's fused-LM-head call is exact under SFTTrainer only, and only the trainer's arguments say which.
        ``TokenTuneCallback`` calls it when training begins and ends."""
        self._trainer_args = args

    @classmethod
    def attach(cls, model: nn.Module, config: TokenSelectionConfig) -> TokenSelector:
        """Put token selection on ``model`` (a transformers model); ``detach()`` removes it."""
        return cls(model, config)

    @staticmethod
    def check(model: nn.Module) -> None:
        """Refuse a model whose attention or head token selection cannot make exact, before changing it."""
        implementation = original_attention(model.config)
        if implementation not in SUPPORTED_IMPLEMENTATIONS:
            raise ValueError(
                f"TokenTune needs attn_implementation in {SUPPORTED_IMPLEMENTATIONS}; "
                f"{type(model).__name__} uses {implementation!r}. Load it with attn_implementation='sdpa'."
            )
        head_of(model)
        find_blocks(model)

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The selection generator's state (with the inputs, it determines every later selection): restored by
        ``load_state_dict``, later draws repeat an uninterrupted run's."""
        return {"generator_state": self.generator.get_state()}

    def load_state_dict(self, state_dict: dict) -> None:
        """Restore the selection generator from ``state_dict()`` (of this process's rank)."""
        if not isinstance(state_dict, dict) or set(state_dict) != {"generator_state"}:
            found = sorted(state_dict) if isinstance(state_dict, dict) else type(state_dict).__name__
            raise ValueError(f"TokenSelector.load_state_dict expects {{'generator_state': ByteTensor}}, got {found}.")
        value = state_dict["generator_state"]
        current = self.generator.get_state()
        if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.shape != current.shape:
            found = f"{value.dtype} {tuple(value.shape)}" if isinstance(value, torch.Tensor) else type(value).__name__
            raise ValueError(
                "TokenSelector.load_state_dict: generator_state must be a uint8 tensor of shape "
                f"{tuple(current.shape)} (from TokenSelector.state_dict()), got {found}."
            )
        self.generator.set_state(value.cpu())

    @property
    def active(self) -> bool:
        return self.model.training and torch.is_grad_enabled()

    def detach(self) -> None:
        """Remove every hook: the model is as it was before ``attach``."""
        if self._runner is not None:
            self._runner.remove()
            self._runner = None
            for module in self.model.modules():
                OUTSIDE_BLOCKS.pop(module, None)
            _ATTACHED.discard(self)
            config = self.model.config
            shared = any(other.model.config is config for other in _ATTACHED)  # another model's selector uses it
            if not shared and get_attn_implementation(config) == REGISTERED_NAMES[self._attention]:
                set_attn_implementation(config, self._attention)
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _abort(self) -> None:
        """End the open training forward without its loss (it raised)."""
        self._state = None

    def _before_forward(self, model: nn.Module, args: tuple, kwargs: dict):
        """The start of every forward of the model (``TrainingContext`` calls it): in a training forward, the
        arguments checked and named, the labels taken for the selected-token loss."""
        token_mask = kwargs.pop("token_mask", None)
        self._state = None
        if not self.active:
            return args, kwargs
        implementation = get_attn_implementation(model.config)
        if implementation != REGISTERED_NAMES[self._attention]:
            raise ValueError(
                f"TokenTune: {type(model).__name__}'s attention implementation was changed to {implementation!r} "
                f"after token selection was attached (as {self._attention!r}), so its training forward would not "
                "run through TokenTune's attention. Wrap the model again after changing it (get_peft_model)."
            )
        # The head again: a pooling setting of the config may have been changed since the model was wrapped.
        self._head = head_of(model)
        # Name every argument, so that a positional attention mask or labels are found (and labels removed).
        kwargs = named_arguments(model, self._forward_signature, args, kwargs)
        check_output_flags(model.config, kwargs)
        # TRL's fused LM head would score every position; the model's own forward runs instead, the head on the
        # selected positions, and the end of the forward answers in the fused head's format (fused_head.py).
        fused = bool(kwargs.pop(TRL_FUSED_HEAD_ARGUMENT, False))
        if fused:
            check_fused_call(self._head.kind, kwargs, self._trainer_args)
            if not self._warned_fused:
                self._warned_fused = True
                warnings.warn(FUSED_METRICS_NOTE, UserWarning, stacklevel=2)
        labels = kwargs.get("labels")
        if kwargs.get("shift_labels") is not None and self._head.kind == "causal_lm":
            # The model's loss would read them in place of `labels`; the selected-token loss reads `labels`.
            raise ValueError(
                "TokenTune: pre-shifted `shift_labels` (context or sequence parallelism) are not supported with token "
                "selection; pass `labels` of shape [batch, seq]."
            )
        num_items = None
        if self._head.kind in ("causal_lm", "per_position") and labels is not None:
            source = "input_ids" if kwargs.get("input_ids") is not None else "inputs_embeds"
            check_label_shape(labels, _sequence_shape(kwargs), source)
            kwargs.pop("labels")
            num_items = kwargs.pop("num_items_in_batch", None)
        self._without_cache(model, kwargs)
        self._state = _TrainingForward(
            padding_mask=kwargs.get("attention_mask"),
            labels=labels,
            token_mask=token_mask,
            num_items_in_batch=num_items,
            input_ids=kwargs.get("input_ids"),
            fused=fused,
        )
        return (), kwargs

    def _without_cache(self, model: nn.Module, kwargs: dict) -> None:
        """No KV cache in training, as transformers does under gradient checkpointing (with a warning, once): each
        block's two passes would fill it twice. ``use_cache=False`` is passed whenever the forward takes it
        (decoders default to True), an empty cache is dropped, one holding positions (a continued prefix) refused.
        """
        asked = []
        if kwargs.get("use_cache"):
            asked.append("`use_cache=True`")
        for name in CACHE_ARGUMENTS:
            cache = kwargs.get(name)
            if cache is None:
                continue
            held = cached_positions(cache)
            if held != 0:
                raise ValueError(
                    f"TokenTune training cannot continue from a KV cache: `{name}` holds "
                    f"{'an unknown number of' if held is None else held} positions ({type(cache).__name__}). "
                    f"Train on the whole sequence without `{name}`, or call {type(model).__name__} in eval mode or "
                    "under torch.no_grad() to use the cache."
                )
            asked.append(f"an empty `{name}`")
            if name in self._forward_signature.parameters:
                kwargs[name] = None
            else:
                kwargs.pop(name)
        if "use_cache" in self._forward_signature.parameters or "use_cache" in kwargs:
            kwargs["use_cache"] = False
        if asked and not self._warned_cache:
            self._warned_cache = True
            verb = "is" if len(asked) == 1 else "are"
            dropped = " and dropping the cache" if len(asked) > 1 or "`use_cache=True`" not in asked else ""
            warnings.warn(
                f"{' and '.join(asked)} {verb} incompatible with TokenTune training (each block runs again for its "
                f"selected tokens, so a cache would be filled twice): setting `use_cache=False`{dropped}. The cache "
                "is still used in eval mode and under torch.no_grad(), e.g. by generate().",
                UserWarning,
                stacklevel=2,
            )

    def _selection_for(self, hidden: torch.Tensor, block_name: str) -> TokenSelection | None:
        state = self._state
        if state is None:
            return None
        if state.selection is None:
            check_block_input(hidden, _input_shape(state), block_name)
            # In a memory estimate (fake tensors: shapes only) the selection is drawn for real, from the real
            # inputs the planner passes: its size is what the estimate needs.
            with outside_fake_mode() if is_fake_tensor(hidden) else nullcontext():
                state.selection = TokenSelection.from_mask(self._select(state, hidden))
            self.last_token_mask = state.selection.mask
        return state.selection

    def _select(self, state: _TrainingForward, hidden: torch.Tensor) -> torch.Tensor:
        batch, length = hidden.shape[:2]
        device = hidden.device if hidden.device.type != "meta" else torch.device("cpu")  # (a memory estimate)
        real = torch.ones(batch, length, dtype=torch.bool, device=device)
        if isinstance(state.padding_mask, torch.Tensor) and tuple(state.padding_mask.shape) == (batch, length):
            real = state.padding_mask.to(device=device).bool()
        labels = state.labels
        if labels is not None and self._head.kind in ("causal_lm", "per_position"):
            check_label_shape(labels, (batch, length), "the hidden states")
        reads = self._head.read_positions(self.model.config, state.input_ids, batch, length, device)
        if state.token_mask is not None:
            return check_token_mask(state.token_mask, real, reads)
        keep_first = self._head.kind != "causal_lm" or self._decoder
        forced = forced_positions(real, keep_first=keep_first, keep_last=self._decoder and reads is None)
        if reads is not None:  # a classifier: the positions it reads too (and the first real token, never the last)
            forced |= reads
        labelled = None
        if labels is not None and labels.dim() == 2 and tuple(labels.shape) == (batch, length):
            labelled = labelled_positions(labels.to(device), causal=self._head.kind == "causal_lm")
        return draw_selection(self.config, real, forced, labelled, self.generator)

    def _before_head(self, head: nn.Module, args: tuple):
        state = self._state
        if state is None or state.selection is None or self._calling_head:
            return None
        hidden = args[0]
        if hidden.shape[1] != state.selection.mask.shape[1]:
            raise ValueError("TokenTune: the LM head must see every position in training (logits_to_keep=0).")
        selected = state.selection.gather(hidden, 1)
        # The loss runs the head itself, a chunk at a time; TRL's fused call needs the selected logits for its metrics.
        if self._chunked and state.labels is not None and not state.fused:
            state.head_input = selected
            return (selected[:, :0], *args[1:])
        return (selected, *args[1:])

    def _after_head(self, head: nn.Module, args: tuple, output: Any):
        state = self._state
        if state is not None and state.head_input is not None and state.head_output is None and not self._calling_head:
            state.head_output = output
        return None

    def _after_forward(self, model: nn.Module, args: tuple, kwargs: dict, output: Any):
        """The end of every forward (``TrainingContext`` calls it, also after an error): the selected-token loss."""
        state, self._state = self._state, None
        if state is None:
            return None
        if state.selection is None or state.labels is None or self._head.kind not in ("causal_lm", "per_position"):
            return None
        if output is None:  # the forward raised; always_call hooks still run
            return None
        logits = output["logits"] if isinstance(output, dict) else output[0]
        if state.head_input is not None:
            return self._finish_chunked(model, state, output, logits)
        if state.fused:
            aux_loss = output.get("aux_loss") if isinstance(output, dict) else None
            return fused_output(logits, state.labels.to(logits.device), state.selection, aux_loss)
        if self._head.kind == "per_position":
            logits = state.selection.gather(logits, 1)
        loss = selected_token_loss(
            logits,
            state.labels.to(logits.device),
            state.selection,
            shift=self._head.kind == "causal_lm",
            num_items_in_batch=state.num_items_in_batch,
        )
        return with_loss(output, loss)

    def _finish_chunked(self, model: nn.Module, state: _TrainingForward, output: Any, logits: Any):
        """The loss through ``chunked_head_loss``; the output's logits (over no position) become None."""
        if logits is not state.head_output:
            raise ValueError(
                f"TokenTune: {type(model).__name__}.forward changes the LM head's logits before returning them, so "
                "the chunked loss (which runs the head itself) would differ from the model's. Set "
                "chunked_loss=False in the TokenTune config (or SlimFitConfig.token_selection)."
            )
        hidden = state.head_input
        labels = state.labels.to(hidden.device)
        targets = selected_targets(labels, state.selection, shift=True)
        head = model.get_output_embeddings()
        parameters = [p for p in head.parameters() if p.requires_grad]

        def run_head(rows: torch.Tensor) -> torch.Tensor:
            self._calling_head = True  # the head's own hooks pass the rows through
            try:
                return head(rows)
            finally:
                self._calling_head = False

        hidden, targets_flat = hidden.reshape(-1, hidden.shape[-1]), targets.reshape(-1)
        # Only selected positions with a label reach the head: the others add nothing to the loss or its gradient,
        # and where answers are short they are most of the selection (the head would cost a fifth of the step).
        # On fake tensors (the planner) every row is kept: how many have a label is data.
        if not is_fake_tensor(targets_flat):
            scored = (targets_flat != IGNORE_INDEX).nonzero().squeeze(1)
            hidden, targets_flat = hidden.index_select(0, scored), targets_flat.index_select(0, scored)
        total = chunked_head_loss(
            run_head,
            parameters,
            hidden,
            targets_flat,
            chunk_rows(logits.shape[-1], hidden.shape[-1], hidden.shape[0]),
        )
        loss = labelled_mean(total, targets, labels, True, state.num_items_in_batch)
        return with_loss(output, loss, drop_logits=True)


def with_loss(output: Any, loss: torch.Tensor, drop_logits: bool = False) -> Any:
    """``output`` (a ``ModelOutput`` or a tuple without a loss) with ``loss`` first; ``drop_logits``: its logits
    (over no position, when the chunked loss ran the head) become None, and leave the tuple."""
    if isinstance(output, dict):
        fields = {key: value for key, value in output.items() if key != "loss"}
        if drop_logits:
            fields["logits"] = None
        return type(output)(loss=loss, **fields)
    return (loss, *output[1:]) if drop_logits else (loss, *output)


def post_processes_logits(model: nn.Module) -> bool:
    """Whether ``model``'s config names a known change of the head's logits (see LOGIT_POSTPROCESSING_FIELDS)."""
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return any(getattr(config, name, None) is not None for name in LOGIT_POSTPROCESSING_FIELDS)


CACHE_ARGUMENTS = ("cache", "past_key_values")  # transformers 5's name, and the deprecated one it still accepts


def cached_positions(cache: Any) -> int | None:
    """How many positions ``cache`` already holds; None when that cannot be told."""
    try:
        return int(cache.get_seq_length())
    except Exception:  # no get_seq_length, or e.g. a cache of linear-attention layers only
        return None


def _sequence_shape(kwargs: dict) -> tuple[int, ...] | None:
    """[batch, seq] of the forward's input (input_ids or inputs_embeds), or None for other inputs."""
    for name in ("input_ids", "inputs_embeds"):
        value = kwargs.get(name)
        if isinstance(value, torch.Tensor) and value.dim() >= 2:
            return tuple(value.shape[:2])
    return None


def _input_shape(state: _TrainingForward) -> tuple[int, int] | None:
    """[batch, seq] of the training forward's input, where its arguments tell it (input_ids, a [batch, seq] mask)."""
    for value in (state.input_ids, state.padding_mask):
        if isinstance(value, torch.Tensor) and value.dim() == 2:
            return tuple(value.shape)
    return None


def check_block_input(hidden: Any, sequence: tuple[int, int] | None, block_name: str) -> None:
    """The blocks' input must be [batch, seq, hidden], one position per input token: checked before labels are
    compared with it, so that a model of another layout is not refused for correct labels."""
    shape = tuple(hidden.shape) if isinstance(hidden, torch.Tensor) else None
    if shape is not None and len(shape) == 3 and (sequence is None or shape[:2] == tuple(sequence)):
        return
    given = f"for an input of [batch, seq] = {tuple(sequence)}" if sequence is not None else "for its input"
    raise ValueError(
        f"TokenTune cannot train {block_name} on a token subset: train this model without token selection (LoRA, "
        f"or SlimFit without `token_selection`). Its input hidden states have shape "
        f"{shape if shape is not None else type(hidden).__name__} {given}, where token selection needs [batch, seq, "
        "hidden] with one position per input token (this model adds positions, joins streams or orders the axes "
        "otherwise)."
    )


def check_label_shape(labels: Any, sequence: tuple[int, ...] | None, source: str) -> None:
    """Labels of a per-position head (causal LM, token classification, masked LM) must be [batch, seq]."""
    if sequence is None:
        return
    shape = tuple(labels.shape) if isinstance(labels, torch.Tensor) else None
    if shape != tuple(sequence):
        raise ValueError(
            f"TokenTune: labels has shape {shape if shape is not None else type(labels).__name__}, but {source} "
            f"has shape [batch, seq] = {tuple(sequence)}; a per-position head needs one label per position "
            "(-100 where none), i.e. labels of exactly that shape."
        )


def named_arguments(model: nn.Module, signature: inspect.Signature, args: tuple, kwargs: dict) -> dict:
    """``args`` and ``kwargs`` of ``model.forward`` (whose signature is ``signature``) as one dict of keywords."""
    if not args:
        return kwargs
    bound = signature.bind(*args, **kwargs)
    named = {}
    for name, value in bound.arguments.items():
        kind = signature.parameters[name].kind
        if kind is inspect.Parameter.VAR_KEYWORD:
            named.update(value)
        elif kind is inspect.Parameter.VAR_POSITIONAL:
            raise ValueError(f"TokenTune: {type(model).__name__}.forward takes *args; pass inputs by keyword.")
        else:
            named[name] = value
    return named
