"""Shared helpers of the planner, recipe and command-line tests: the planner's small Llama config and
``peft-slim train``'s own parsing of its flags."""

from __future__ import annotations

import argparse

import transformers

from peft_slim.cli.train import parse_flags


def llama_config(**extra) -> transformers.LlamaConfig:
    """A small Llama's config (the planner estimates from the config alone), ``extra`` fields changed or added."""
    values = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4)
    values.update(num_key_value_heads=2, vocab_size=500, architectures=["LlamaForCausalLM"])
    return transformers.LlamaConfig(**{**values, **extra})


def checked_train_args(flags: list[str]) -> argparse.Namespace:
    """``flags`` parsed and checked by the real ``peft-slim train`` code."""
    return parse_flags(flags)
