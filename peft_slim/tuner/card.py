"""peft_slim's section of a saved adapter's model card (``README.md``): its tags and how to load the adapter."""

from __future__ import annotations

import re
from typing import Any

import transformers
from huggingface_hub import ModelCard

from .config import METHOD_CONFIG_NAME

CARD_NAME = "README.md"
CARD_START = "<!-- peft_slim: loading (written by peft_slim.save_pretrained; kept up to date on every save) -->"
CARD_END = "<!-- /peft_slim -->"


def card_section(peft_model: Any) -> str:
    """The card's "how to load" section: with plain PEFT, and with the method to continue training."""
    tuner = peft_model.base_model
    config = tuner._config
    base_cls = type(peft_model.get_base_model())
    # `transformers` for a class it exports (the usual case), else the module that defines it
    module = "transformers" if getattr(transformers, base_cls.__name__, None) is base_cls else base_cls.__module__
    base_ref = config.base_model_name_or_path or "<the base model it was trained from>"
    adapter_ref = "<the folder or Hub id of this adapter>"
    lines = [
        f"This is a plain PEFT **LoRA** adapter, trained with peft_slim's **{tuner.method_name}** (its settings "
        f"are in `{METHOD_CONFIG_NAME}`). It loads without peft_slim:",
        "",
        "```python",
        "from peft import PeftModel",
        f"from {module} import {base_cls.__name__}",
        "",
        f'base = {base_cls.__name__}.from_pretrained("{base_ref}")',
        f'model = PeftModel.from_pretrained(base, "{adapter_ref}")',
        "```",
        "",
        f"To continue training with {tuner.method_name} and the same settings: "
        f'`peft_slim.from_pretrained(base, "{adapter_ref}", is_trainable=True)`.',
    ]
    return "\n".join([CARD_START, "## Loading this adapter (peft_slim)", "", *lines, CARD_END])


def add_card_section(path: str, peft_model: Any) -> None:
    """Add peft_slim's tags and loading section to the model card at ``path`` (replacing an older section)."""
    card = ModelCard.load(path)
    tuner = peft_model.base_model
    card.data.tags = list(dict.fromkeys([*(card.data.tags or []), "lora", "peft_slim", tuner.method_name.lower()]))
    section = card_section(peft_model)
    pattern = re.compile(re.escape(CARD_START) + r".*?" + re.escape(CARD_END), re.DOTALL)
    text = card.text
    if pattern.search(text):
        text = pattern.sub(lambda _: section, text, count=1)
    else:  # after the title, if the card starts with one
        head, newline, rest = text.lstrip("\n").partition("\n")
        text = f"{head}\n\n{section}\n{rest}" if head.startswith("# ") else f"{section}\n\n{text}"
    card.text = text
    card.save(path)
