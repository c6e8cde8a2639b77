"""The LM head and cross-entropy over the selected rows, a chunk of rows at a time: no ``[rows, vocab]`` logits kept.

The selected positions' logits cost, per row, the vocabulary several times over in fp32 (their fp32 copy, the
log-softmax saved for backward, its gradient): on a 128k-token vocabulary, most of what TokenTune keeps outside the
blocks. The forward computes each chunk's summed cross-entropy and drops its logits; the backward recomputes them
through the head module itself (so LoRA on the head, tied embeddings, hooks and autocast behave as in the forward),
under the forward's RNG state (a LoRA head's dropout draws the same mask). The gradient equals the materialised one:
the same operations per row, the head's parameter gradients summed over chunks in fp32 and rounded once.

Each chunk's fp32 logits are turned into log-probabilities in place, and in backward into their gradient in place
(PyTorch's own log-softmax and its backward, writing over their input): the forward holds one vocabulary-sized row
per row of the chunk instead of two, the backward two instead of three. The forward runs twice the backward's rows
a chunk (the same bytes; the head reads its weight once per chunk): its chunks set only the loss's summation order,
the backward's chunks its gradients.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from ..compat import run_device_type
from .loss import IGNORE_INDEX

# Each chunk reads the whole head weight (vocab x hidden) for rows x vocab x hidden multiply-adds, so with few rows
# the head runs at the speed of reading its weight. Larger chunks trade peak for time: on SmolLM2-135M steps
# (benchmarks/results/chunk_rule), 128 rows instead of 16 took 10% less time where 100-300 rows reach the head, none
# on QA or long prompts, and raised the step peak from 0.61x to 0.83x of the baseline's on QA and from 0.49x to 0.83x
# on docs. Memory comes first here: 16, until a rule is measured that keeps the peak.
MIN_CHUNK_ROWS = 16


def chunk_rows(vocab: int, hidden_size: int, total_rows: int) -> int:
    """Rows per chunk: the rows split into about ``vocab / hidden_size`` chunks, so that one chunk's fp32 logits
    take about the bytes of all the rows' hidden states in fp32 (what the loss keeps anyway), and never fewer than
    ``MIN_CHUNK_ROWS`` rows (the head reads its weight once per chunk)."""
    chunks = max(1, math.ceil(vocab / hidden_size))
    return max(MIN_CHUNK_ROWS, math.ceil(total_rows / chunks))


def chunked_head_loss(
    head: Callable[[torch.Tensor], torch.Tensor],
    parameters: Sequence[torch.Tensor],
    hidden: torch.Tensor,
    targets: torch.Tensor,
    rows: int,
) -> torch.Tensor:
    """Sum over rows of ``cross_entropy(head(hidden).float(), targets)`` (-100 ignored), differentiable in ``hidden``
    ``[rows_total, hidden_size]`` and ``parameters`` (the head's, that require grad), without keeping the logits:
    ``head`` runs on ``rows`` rows at a time, in the forward and again in the backward.
    """
    if hidden.dim() != 2 or targets.shape != hidden.shape[:1]:
        raise ValueError(
            f"chunked_head_loss: hidden must be [rows, hidden_size] and targets [rows], got {tuple(hidden.shape)} "
            f"and {tuple(targets.shape)}."
        )
    return _ChunkedHeadLoss.apply(head, rows, hidden, targets, *parameters)


# The forward's rows a chunk over the backward's: its chunk holds one fp32 vocabulary-sized row per row (the
# log-probabilities written over the logits), the backward's two (those and the gradient of the loss in them).
FORWARD_CHUNK_FACTOR = 2


def _log_probabilities(logits: torch.Tensor) -> torch.Tensor:
    """The fp32 log-softmax of ``logits`` over the vocabulary, written over ``logits.float()`` (a new tensor when
    the logits are of a lower precision, the logits themselves in fp32): what ``F.cross_entropy`` computes first."""
    scores = logits.float()
    return torch._log_softmax(scores, -1, False, out=scores)


def _chunk_loss(head, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The summed cross-entropy of one chunk without grad: ``F.cross_entropy``'s log-softmax and NLL loss, the
    log-softmax written over the logits (nothing else holds them: the head ran inside this function)."""
    return F.nll_loss(_log_probabilities(head(hidden)), targets, ignore_index=IGNORE_INDEX, reduction="sum")


def _chunk_logits_gradient(logits: torch.Tensor, targets: torch.Tensor, grad_total: torch.Tensor) -> torch.Tensor:
    """The gradient of ``grad_total * cross_entropy(logits.float(), targets, reduction="sum")`` in ``logits``, as
    autograd computes it (the NLL loss's backward: ``-grad_total`` at each row's target; then the log-softmax's
    backward kernel), written over the log-probabilities. ``logits``' values are overwritten in fp32: the head's
    backward does not read them (a head whose backward does fails autograd's in-place check, loudly)."""
    log_probs = _log_probabilities(logits.detach())
    grad = torch.zeros_like(log_probs)  # written without data-dependent shapes: the planner traces it on fake tensors
    at_target = torch.where(targets != IGNORE_INDEX, -grad_total.to(grad.dtype), 0.0)
    grad.scatter_(1, targets.clamp(min=0).unsqueeze(1), at_target.unsqueeze(1))
    gradient = torch._log_softmax_backward_data(grad, log_probs, -1, log_probs.dtype, out=log_probs)
    del grad
    return gradient.to(logits.dtype)


class _ChunkedHeadLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, head, rows, hidden, targets, *parameters):
        device = run_device_type(hidden)
        ctx.head, ctx.rows, ctx.device = head, rows, hidden.device
        # the recomputation runs in backward, outside the forward's autocast: it enters the same one
        ctx.autocast = (device, torch.is_autocast_enabled(device), torch.get_autocast_dtype(device))
        ctx.rng = torch.get_rng_state(), torch.cuda.get_rng_state(hidden.device) if device == "cuda" else None
        ctx.save_for_backward(hidden, targets, *parameters)
        total = torch.zeros((), dtype=torch.float32, device=hidden.device)
        step = rows * FORWARD_CHUNK_FACTOR
        for start in range(0, hidden.shape[0], step):
            total += _chunk_loss(head, hidden[start : start + step], targets[start : start + step])
        return total

    @staticmethod
    def backward(ctx, grad_total):
        hidden, targets, *parameters = ctx.saved_tensors
        wants_hidden = ctx.needs_input_grad[2]
        grad_hidden = torch.empty_like(hidden) if wants_hidden else None
        trained = [i for i, p in enumerate(parameters) if ctx.needs_input_grad[4 + i]]
        sums = {i: torch.zeros(parameters[i].shape, dtype=torch.float32, device=parameters[i].device) for i in trained}
        kind, enabled, dtype = ctx.autocast
        cuda = ctx.device.type == "cuda"
        with torch.random.fork_rng(devices=[ctx.device] if cuda else []), torch.enable_grad():
            torch.set_rng_state(ctx.rng[0])
            if cuda:
                torch.cuda.set_rng_state(ctx.rng[1], ctx.device)
            for start in range(0, hidden.shape[0], ctx.rows):
                chunk = hidden[start : start + ctx.rows].detach().requires_grad_(wants_hidden)
                with torch.autocast(kind, dtype=dtype, enabled=enabled):
                    logits = ctx.head(chunk)
                gradient = _chunk_logits_gradient(logits, targets[start : start + ctx.rows], grad_total)
                inputs = ([chunk] if wants_hidden else []) + [parameters[i] for i in trained]
                grads = torch.autograd.grad(logits, inputs, gradient, allow_unused=True)
                del logits, gradient
                if wants_hidden:
                    grad_hidden[start : start + ctx.rows] = grads[0] if grads[0] is not None else 0
                for i, grad in zip(trained, grads[wants_hidden:]):
                    if grad is not None:
                        sums[i] += grad
        grad_parameters = [sums[i].to(p.dtype) if i in sums else None for i, p in enumerate(parameters)]
        return (None, None, grad_hidden, None, *grad_parameters)
