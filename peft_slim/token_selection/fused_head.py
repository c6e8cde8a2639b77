"""TRL's fused LM head in a token-selection training forward: SFTTrainer's loss, gradient and metrics, exactly.

TRL (>= 1.0) calls ``model(..., labels=labels, fused_lm_head=True)`` for per-token fields of shape [batch, seq - 1]
(zero where the next-token label is -100) instead of logits. ``SFTTrainer``'s loss is ``-log_probs.sum() / n``,
``n`` being Trainer's ``num_items_in_batch`` or else ``label_mask.sum()``; it logs ``entropy.sum()`` and
``is_top1.sum()`` over ``label_mask.sum()`` as ``entropy`` and ``mean_token_accuracy``.

So that these sums give TokenTune's definition, ``label_mask`` marks every labelled position and each field holds,
at the selected labelled positions only, the value times ``w = labelled / selected`` (of the micro-batch): the loss
is then the selected-token mean (times the micro-batch's share of the labelled positions under
``num_items_in_batch``, as under ``transformers.Trainer``), both metrics means over the selected labelled positions,
and the gradient flows through the selected positions only.

Other trainers (DPO, GRPO, ...) and ``loss_type="dft"`` need every completion token's value with gradient: refused,
as is a fused training call without the trainer's arguments (``TokenTuneCallback`` gives them at ``on_train_begin``).
"""

from __future__ import annotations

from typing import Any

import torch

from ..compat import TRL_FUSED_HEAD_ARGUMENT, trl_fused_output_cls
from .loss import IGNORE_INDEX, selected_targets
from .selection import TokenSelection

FUSED_METRICS_NOTE = (
    "TokenTune under trl.SFTTrainer: the loss is TokenTune's selected-token mean, and the `entropy` and "
    "`mean_token_accuracy` logged in training are means over the selected labelled positions only (the only ones "
    "whose logits a TokenTune forward computes), not over every answer token; evaluation covers every position."
)
_ALTERNATIVES = (
    "Use trl.SFTTrainer (loss_type='nll'), or train a LoRA adapter without token selection (a TokenTune + LoRA SFT "
    "run saved a plain LoRA adapter, which continues there with PeftModel.from_pretrained(..., is_trainable=True))."
)


def _trainer_name(args: Any) -> str:
    """The trainer a TrainingArguments class belongs to: TRL names them alike (DPOConfig for DPOTrainer)."""
    name = type(args).__name__
    return name[: -len("Config")] + "Trainer" if name.endswith("Config") else f"the Trainer of {name}"


def _is_sft_config(args: Any) -> bool:
    try:
        from trl import SFTConfig
    except ImportError:
        return False
    return isinstance(args, SFTConfig)


def check_fused_call(head_kind: str, kwargs: dict, trainer_args: Any) -> None:
    """Refuse a ``fused_lm_head=True`` training forward that token selection cannot make exact; ``trainer_args``
    are those ``TokenTuneCallback`` recorded (None without it): they say which objective the call feeds."""
    if head_kind != "causal_lm":
        raise ValueError(
            f"TokenTune: `{TRL_FUSED_HEAD_ARGUMENT}=True` (TRL's fused LM head) needs a causal LM; this model's head "
            f"is {head_kind!r}."
        )
    if trainer_args is None:
        raise ValueError(
            "TokenTune: pass `callbacks=[peft_slim.TokenTuneCallback()]` to trl.SFTTrainer (a training forward with "
            f"`{TRL_FUSED_HEAD_ARGUMENT}=True` needs the trainer's arguments). Outside SFTTrainer call the model in "
            f"eval mode, under torch.no_grad() or without `{TRL_FUSED_HEAD_ARGUMENT}`; for DPO, GRPO and the other "
            "TRL trainers train a LoRA adapter without token selection."
        )
    name = _trainer_name(trainer_args)
    if not _is_sft_config(trainer_args):
        raise ValueError(
            f"TokenTune: {name} is not supported with token selection: it reads every completion token's "
            "log-probability (TRL's fused LM head), which token selection computes for the selected positions "
            "only. " + _ALTERNATIVES
        )
    loss_type = getattr(trainer_args, "loss_type", "nll")
    if loss_type != "nll":
        raise ValueError(
            f"TokenTune: {name} with loss_type={loss_type!r} is not supported with token selection: it weights each "
            "token by its probability, which token selection computes for the selected positions only. Use "
            "loss_type='nll' (the default)."
        )
    if not isinstance(kwargs.get("labels"), torch.Tensor):
        raise ValueError(f"TokenTune: `{TRL_FUSED_HEAD_ARGUMENT}=True` needs `labels` (a [batch, seq] tensor).")


def fused_output(logits: torch.Tensor, labels: torch.Tensor, selection: TokenSelection, aux_loss: Any = None):
    """TRL's fused-head output for a token-selection forward (see the module docstring); ``logits`` are [B, n, V]."""
    batch, length = labels.shape
    targets = selected_targets(labels, selection, shift=True)  # [B, n]: the next token of each selected slot
    scored = targets != IGNORE_INDEX
    log_softmax = torch.log_softmax(logits.float(), dim=-1)
    log_probs = log_softmax.gather(-1, targets.clamp(min=0).unsqueeze(-1)).squeeze(-1)
    with torch.no_grad():
        entropy = -(log_softmax.exp() * log_softmax).sum(-1)
        is_top1 = (logits.argmax(-1) == targets).to(log_probs.dtype)
    label_mask = labels[:, 1:] != IGNORE_INDEX
    weight = label_mask.sum() / scored.sum().clamp(min=1)
    # A slot's position p scores the label at p + 1, i.e. column p of the [B, seq - 1] fields; a slot at the last
    # position scores nothing (clamped onto an existing column, adding zero).
    columns = selection.index.clamp(max=max(length - 2, 0))

    def spread(values: torch.Tensor) -> torch.Tensor:
        values = torch.where(scored, values * weight, 0.0)
        if length < 2:
            return values.new_zeros(batch, 0) + values.sum() * 0  # connected to the graph, like TRL's
        return values.new_zeros(batch, length - 1).scatter_add(1, columns, values)

    log_probs = spread(log_probs)
    loss = -log_probs.sum() / label_mask.sum().clamp(min=1)
    return trl_fused_output_cls()(
        loss=loss,
        log_probs=log_probs,
        entropy=spread(entropy),
        is_top1=spread(is_top1),
        label_mask=label_mask,
        aux_loss=aux_loss,
    )
