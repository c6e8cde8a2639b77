"""A tiny random Llama with a byte-level BPE tokenizer and a chat template, saved like a hub model: what the
command-line tests train with ``peft-slim train --model``."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaForCausalLM, PreTrainedTokenizerFast

from helpers.tiny_models import decoder_config

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
QA = [
    ("What is the capital of France?", "Paris is the capital."),
    ("Who wrote Hamlet?", "William Shakespeare wrote it."),
    ("How many legs has a spider?", "A spider has eight legs."),
    ("What colour is the sky?", "The sky is blue on a clear day."),
    ("What is two plus two?", "Two plus two is four."),
    ("Which planet is red?", "Mars is the red planet."),
]


def save_tiny_chat_llama(folder: Path) -> Path:
    """A 2-layer random Llama and a byte-level BPE tokenizer with a chat template, saved into ``folder``."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    specials = ["<|end|>", "<|user|>", "<|assistant|>", "<|system|>"]
    texts = [q + " " + a for q, a in QA] * 5
    tokenizer.train_from_iterator(
        texts,
        trainers.BpeTrainer(
            vocab_size=200, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>", chat_template=CHAT_TEMPLATE)
    fast.save_pretrained(folder)
    torch.manual_seed(0)
    config = decoder_config(vocab_size=len(fast), eos_token_id=fast.eos_token_id, pad_token_id=fast.eos_token_id)
    LlamaForCausalLM(config).save_pretrained(folder)
    return folder
