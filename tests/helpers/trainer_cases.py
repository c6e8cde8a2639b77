"""A word-level tokenizer over the tiny models' vocabulary, short random texts and TrainingArguments: the inputs of
the tests that run transformers.Trainer."""

from __future__ import annotations

import pytest
import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, TrainingArguments

from helpers.tiny_models import VOCAB, trainer_kwargs

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
