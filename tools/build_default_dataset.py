"""Rebuild peft_slim/data/chatterbot_qa.jsonl, the dataset `peft-slim train` uses when given none.

Source: the English part of chatterbot-corpus 1.3.3 (BSD-3-Clause, see peft_slim/data/LICENSE.chatterbot-corpus),
``pip install --no-deps chatterbot-corpus``. One example per distinct question: its first answer, as a user /
assistant exchange (`messages`), with the corpus category; answers longer than 400 characters are left out.
Run: ``python tools/build_default_dataset.py``.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import yaml

MAX_ANSWER_CHARS = 400
OUTPUT = Path(__file__).resolve().parents[1] / "peft_slim" / "data" / "chatterbot_qa.jsonl"


def main() -> None:
    root = Path(importlib.util.find_spec("chatterbot_corpus").submodule_search_locations[0]) / "data" / "english"
    rows, seen = [], set()
    for path in sorted(root.glob("*.yml")):
        corpus = yaml.safe_load(path.read_text(encoding="utf-8"))
        for conversation in corpus["conversations"]:
            if len(conversation) < 2 or not all(isinstance(turn, str) for turn in conversation[:2]):
                continue
            question, answer = (" ".join(turn.split()) for turn in conversation[:2])
            if not question or not answer or len(answer) > MAX_ANSWER_CHARS or question in seen:
                continue
            seen.add(question)
            messages = [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]
            rows.append({"messages": messages, "category": path.stem})
    OUTPUT.write_text("".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows), encoding="utf-8")
    print(f"{len(rows)} examples -> {OUTPUT}")


if __name__ == "__main__":
    main()
