"""Shared helpers of the TRL tests: a tiny tokenizer with EOS and a chat template, SFT data, one SFTTrainer step.

The reference is independent of TokenTune, of TRL's loss code and of its packing: each document runs on its
own (a packed row is split at its ``position_ids`` resets) under the equivalent definition of methods.md
(tests/helpers/reference.py), and its selected-token cross-entropy is recomputed by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from helpers.reference import reference_forward
from helpers.tiny_models import ONE_SGD_STEP, VOCAB, trainer_kwargs
from helpers.trainer_cases import AppliedGradient, load, trainable  # noqa: F401 (the TRL tests import them here)
from peft_slim import SlimFitCallback, SlimFitConfig, TokenTuneCallback
from peft_slim.slimfit import find_slimfit
from peft_slim.tokentune import find_token_selector

datasets = pytest.importorskip("datasets")
trl = pytest.importorskip("trl")

# User turns start with w4, assistant turns with w5; the assistant's text and its [EOS] are what it must learn.
CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}w4 {{ m['content'] }} "
    "{% else %}w5 {% generation %}{{ m['content'] }} [EOS]{% endgeneration %} {% endif %}{% endfor %}"
    "{% if add_generation_prompt %}w5 {% endif %}"
)


def sft_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary, with EOS and a chat template, built in code."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[UNK]": 2, "[EOS]": 3, **{f"w{i}": i for i in range(4, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", bos_token="[BOS]", unk_token="[UNK]", eos_token="[EOS]"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def _words(generator: torch.Generator, count: int) -> str:
    return " ".join(f"w{int(i)}" for i in torch.randint(6, VOCAB, (count,), generator=generator))


def sft_dataset(kind: str, n: int = 4, seed: int = 0):
    """``n`` examples of plain text ("text"), prompt-completion ("completion") or chat ("chat") data."""
    generator = torch.Generator().manual_seed(seed)
    pairs = [tuple(int(x) for x in row) for row in torch.randint(3, 9, (n, 2), generator=generator)]
    if kind == "text":
        return datasets.Dataset.from_dict({"text": [_words(generator, a + b) for a, b in pairs]})
    if kind == "completion":
        prompts = [_words(generator, a) for a, _ in pairs]
        completions = [" " + _words(generator, b) for _, b in pairs]
        return datasets.Dataset.from_dict({"prompt": prompts, "completion": completions})
    if kind == "chat":
        chats = [
            [
                {"role": "user", "content": _words(generator, a)},
                {"role": "assistant", "content": _words(generator, b)},
                {"role": "user", "content": _words(generator, 2)},
                {"role": "assistant", "content": _words(generator, 2)},
            ]
            for a, b in pairs
        ]
        return datasets.Dataset.from_dict({"messages": chats})
    raise ValueError(kind)


def sft_args(tmp_path, **overrides):
    """One optimizer step: SGD, lr=1, no clipping or decay, so the applied update is the gradient itself."""
    # bf16=False: TRL defaults to bf16 autocast, on CPU too; the bf16 test turns it on.
    args = trainer_kwargs(tmp_path, **ONE_SGD_STEP, max_length=64, dataset_num_proc=None, bf16=False)
    return trl.SFTConfig(**args | overrides)


class ForwardRecorder:
    """Every training forward of a PeftModel: its keyword inputs (cloned) and the selection TokenTune drew."""

    def __init__(self, peft_model, selects: bool = True):
        self.peft_model = peft_model
        self.selects = selects
        self.calls: list[dict] = []
        self.handle = peft_model.register_forward_hook(self._record, with_kwargs=True)

    def _record(self, module, args, kwargs, output):
        if not (module.training and torch.is_grad_enabled()):
            return
        inputs = {k: v.detach().clone() for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        mask = find_token_selector(self.peft_model).last_token_mask if self.selects else None
        self.calls.append({"inputs": inputs, "mask": None if mask is None else mask.detach().clone()})

    def remove(self):
        self.handle.remove()


def documents(inputs: dict) -> list[tuple[int, slice]]:
    """(row, span) of every document: a row of a padded batch, or each packed document of a padding-free row."""
    if "attention_mask" in inputs:
        return [(row, slice(0, inputs["input_ids"].shape[1])) for row in range(inputs["input_ids"].shape[0])]
    spans = []
    for row, positions in enumerate(inputs["position_ids"]):
        starts = (positions == 0).nonzero().flatten().tolist() + [positions.numel()]
        spans += [(row, slice(a, b)) for a, b in zip(starts[:-1], starts[1:])]
    return spans


def reference_terms(peft_model, call: dict, autocast: bool = False):
    """Per document: (CE sum over selected labelled positions [with graph], selected count, entropy sum, correct).

    A position t is scored on labels[t + 1]; it counts when t is selected and that label is not -100. Runs in
    eval mode under the equivalent definition, so gradients reach the selected positions only.
    """
    inner = peft_model.base_model.model
    blocks = inner.model.layers
    inputs, mask = call["inputs"], call["mask"]
    terms = []
    for row, span in documents(inputs):
        ids = inputs["input_ids"][row : row + 1, span]
        labels = inputs["labels"][row, span]
        selected = mask[row : row + 1, span]
        extra = {}
        if "attention_mask" in inputs:
            extra["attention_mask"] = inputs["attention_mask"][row : row + 1, span]
        with reference_forward(inner, blocks, selected), torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            logits = peft_model(input_ids=ids, **extra).logits[0].float()
        scored = selected[0, :-1] & (labels[1:] != -100)
        targets = labels[1:][scored]
        picked = logits[:-1][scored]
        ce = F.cross_entropy(picked, targets, reduction="sum") if len(targets) else logits.sum() * 0
        log_p = torch.log_softmax(picked.detach(), dim=-1)
        entropy = -(log_p.exp() * log_p).sum()
        correct = (picked.detach().argmax(-1) == targets).sum()
        terms.append((ce, int(scored.sum()), float(entropy), int(correct)))
    return terms


def reference_step(peft_model, calls: list[dict], autocast: bool = False):
    """TokenTune's definition over one accumulated step, and its gradient.

    Each micro-batch k contributes its selected-token mean m_k times its share of the labelled positions
    (labelled_k / N, N over the whole step), as TokenTune does under Trainer. Also returns the mean over
    micro-batches of the entropy and top-1 accuracy means over selected labelled positions.
    """
    peft_model.eval()
    peft_model.zero_grad(set_to_none=True)
    labelled = [int((call["inputs"]["labels"][:, 1:] != -100).sum()) for call in calls]
    total, entropies, accuracies = 0.0, [], []
    for call, count in zip(calls, labelled):
        terms = reference_terms(peft_model, call, autocast)
        n_selected = max(sum(t[1] for t in terms), 1)
        loss = sum(t[0] for t in terms) / n_selected * count / sum(labelled)
        loss.backward()
        total += loss.item()
        entropies.append(sum(t[2] for t in terms) / n_selected)
        accuracies.append(sum(t[3] for t in terms) / n_selected)
    grads = {n: p.grad.detach().clone() for n, p in peft_model.named_parameters() if p.grad is not None}
    peft_model.zero_grad(set_to_none=True)
    peft_model.train()
    return total, grads, sum(entropies) / len(entropies), sum(accuracies) / len(accuracies)


def run_sft_step(tmp_path, dataset, model=None, peft_config=None, selects: bool = True, **overrides):
    """One optimizer step of trl.SFTTrainer (with TokenTuneCallback when the model selects tokens, as token
    selection under SFTTrainer needs, and SlimFitCallback for SlimFit); returns the trainer, its logs, the recorded
    calls and gradient."""
    tokenizer = sft_tokenizer()
    callbacks = [TokenTuneCallback()] if selects else []
    if isinstance(peft_config, SlimFitConfig) or (model is not None and find_slimfit(model)):
        callbacks.append(SlimFitCallback())
    trainer = trl.SFTTrainer(
        model=model,
        args=sft_args(tmp_path, **overrides),
        train_dataset=dataset,
        processing_class=tokenizer,
        peft_config=peft_config,
        callbacks=callbacks or None,
    )
    peft_model = trainer.model
    recorder = ForwardRecorder(peft_model, selects=selects)
    applied = AppliedGradient(peft_model)
    trainer.add_callback(applied)
    before = trainable(peft_model)
    trainer.train()
    recorder.remove()
    logs = [entry for entry in trainer.state.log_history if "loss" in entry]
    assert len(logs) == 1 and len(applied.steps) == 1
    return trainer, logs[0], recorder.calls, applied.steps[0], before
