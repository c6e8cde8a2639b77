"""A word-level tokenizer over the tiny models' vocabulary, short random texts and TrainingArguments: the inputs of
the tests that run transformers.Trainer."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    DataCollatorForLanguageModeling,
    PreTrainedTokenizerFast,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from helpers.tiny_models import LORA_TARGETS, VOCAB, FullFineTuned, build, trainer_kwargs
from peft_slim import SlimFitCallback, TokenTuneConfig

datasets = pytest.importorskip("datasets")


def make_tokenizer() -> PreTrainedTokenizerFast:
    """A word-level tokenizer over the tiny models' vocabulary, built in code (no hub)."""
    vocab = {"[PAD]": 0, "[BOS]": 1, "[UNK]": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="[PAD]", bos_token="[BOS]", unk_token="[UNK]")


def make_dataset(tokenizer, lengths: list[int], seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    texts = [
        " ".join(f"w{int(i)}" for i in torch.randint(3, VOCAB, (length,), generator=generator)) for length in lengths
    ]
    encoded = tokenizer(texts)
    return datasets.Dataset.from_dict({"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]})


def training_args(tmp_path, **overrides) -> TrainingArguments:
    return TrainingArguments(**trainer_kwargs(tmp_path, **overrides))


STEPS = 6  # selection_trainer's steps


def selection_trainer(output_dir, model, callbacks=(), **overrides) -> Trainer:
    """A Trainer over 12 short texts of different lengths: ``STEPS`` AdamW steps of one micro-batch at a constant
    lr of 1e-2, weight decay 0.1; ``overrides`` change TrainingArguments."""
    tokenizer = make_tokenizer()
    # Rows of different lengths: a selection drawn for one batch would not fit another.
    dataset = make_dataset(tokenizer, [9, 7, 12, 8, 10, 6, 11, 5, 13, 9, 7, 12])
    args = dict(
        max_steps=STEPS,
        learning_rate=1e-2,
        weight_decay=0.1,
        gradient_accumulation_steps=1,
        lr_scheduler_type="constant",
        logging_steps=100,
    )
    args.update(overrides)
    return Trainer(
        model=model,
        args=training_args(output_dir, **args),
        train_dataset=dataset,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=list(callbacks),
    )


def tokentune_llama():
    """A tiny Llama with TokenTune + LoRA and a fixed selection seed."""
    config = TokenTuneConfig(
        task_type="CAUSAL_LM",
        token_ratio=0.3,
        seed=7,
        lora=LoraConfig(r=4, lora_alpha=8, target_modules=LORA_TARGETS["llama"], init_lora_weights=False),
    )
    return get_peft_model(build("llama", seed=0), config)


def slimfit_trainer(tmp_path, model, steps: int, callbacks=(), evaluate: bool = False, **overrides) -> Trainer:
    """A Trainer with SlimFitCallback (and ``callbacks``) over 16 short texts: ``steps`` AdamW steps of one
    micro-batch at a constant lr of 1e-2, weight decay 0.1; with ``evaluate``, 4 other texts to evaluate on."""
    tokenizer = make_tokenizer()
    args = training_args(
        tmp_path,
        max_steps=steps,
        learning_rate=1e-2,
        weight_decay=0.1,
        gradient_accumulation_steps=1,
        lr_scheduler_type="constant",
        **overrides,
    )
    return Trainer(
        model=model.get_base_model() if isinstance(model, FullFineTuned) else model,
        args=args,
        train_dataset=make_dataset(tokenizer, [9, 7, 12, 8] * 4),
        eval_dataset=make_dataset(tokenizer, [10, 6, 11, 9], seed=1) if evaluate else None,
        data_collator=DataCollatorForLanguageModeling(tokenizer, mlm=False),
        callbacks=[SlimFitCallback(), *callbacks],
    )


class AppliedGradient(TrainerCallback):
    """The gradients Trainer is about to apply, read just before the optimizer step."""

    def __init__(self, peft_model):
        self.peft_model = peft_model
        self.steps: list[dict[str, torch.Tensor]] = []

    def on_pre_optimizer_step(self, args, state, control, **kwargs):
        self.steps.append(
            {n: p.grad.detach().clone() for n, p in self.peft_model.named_parameters() if p.grad is not None}
        )


def trainable(peft_model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in peft_model.named_parameters() if p.requires_grad}


def load(peft_model, values: dict[str, torch.Tensor]) -> None:
    with torch.no_grad():
        for name, param in peft_model.named_parameters():
            if name in values:
                param.copy_(values[name])
