"""The SFT tasks of the benchmarks (SmolLM2-135M-Instruct's chat template, completion-only labels):

* ``qa``: the embedded chatterbot-corpus QA set, every 5th pair held out;
* ``pydocs``: the Python reference documentation CPython ships (``pydoc_data.topics``) as prompt/completion: the
  prompt names the topic and gives a paragraph's first sentence, the completion is the rest of the paragraph;
  every 5th topic is held out whole;
* ``longqa``: the QA set with long prompts (``longqa_rows``): each question follows training pairs given as
  examples until the prompt holds ``LONG_PROMPT_TOKENS`` tokens; the answer is at most a tenth of the row;
* ``pydocs-full``: continued pre-training on the same documentation, every position labelled: the paragraphs' text
  (no chat template) in rows of ``max_length`` tokens, held out by topic as ``pydocs``.
"""

from __future__ import annotations

import random
import statistics

IGNORE_INDEX = -100
HELD_OUT_EVERY = 5
LONG_PROMPT_TOKENS = 480  # longqa: a row's prompt (examples + question) holds at least this many tokens
# Per task, the default tokens per example and held-out examples.
TASK_DEFAULTS = {
    "qa": {"max_length": 64, "held_out": 48},
    "pydocs": {"max_length": 96, "held_out": 64},
    "longqa": {"max_length": 704, "held_out": 48},
    "pydocs-full": {"max_length": 256, "held_out": 16},
}


def tokenize(rows: list[dict], tokenizer, max_length: int) -> list[dict]:
    """``input_ids`` and ``labels`` (the assistant turns) of chat rows, as ``peft-slim train`` labels them, cut to
    ``max_length``; rows keeping no scored label are dropped, as the command drops them."""
    from peft_slim.cli import sft_data

    columns = sft_data.find_columns(rows)
    if columns.format == "prompt-completion":  # rendered as one user and one assistant turn, as the command does
        rows = [
            {
                "messages": [
                    {"role": "user", "content": r[columns.prompt]},
                    {"role": "assistant", "content": r[columns.completion]},
                ]
            }
            for r in rows
        ]
        columns = sft_data.find_columns(rows)
    dataset = sft_data.to_dataset(rows, columns, tokenizer)
    if "completion_mask" not in dataset.column_names:
        raise ValueError("the benchmarks' data sets are chat or prompt/completion rows, for a chat template")
    examples = []
    for row in dataset:
        ids, mask = row["input_ids"][:max_length], row["completion_mask"][:max_length]
        labels = [token if labelled else IGNORE_INDEX for token, labelled in zip(ids, mask)]
        if any(label != IGNORE_INDEX for label in labels[1:]):  # position 0's label is never scored
            examples.append({"input_ids": ids, "labels": labels})
    return examples


def split(examples: list[dict]) -> tuple[list[dict], list[dict]]:
    train = [e for i, e in enumerate(examples) if i % HELD_OUT_EVERY]
    held_out = [e for i, e in enumerate(examples) if not i % HELD_OUT_EVERY]
    return train, held_out


def pydocs_rows(held_out_every: int = 5) -> tuple[list[dict], list[dict]]:
    """Prompt/completion rows from the Python reference topics: (train, held-out), held out by topic."""
    from pydoc_data.topics import topics

    train, held_out = [], []
    for index, name in enumerate(sorted(topics)):
        for paragraph in topics[name].split("\n\n"):
            if "::=" in paragraph or paragraph.lstrip().startswith(">>>"):
                continue  # grammar rules and interpreter sessions: not prose
            text = " ".join(paragraph.split())
            first, sep, rest = text.partition(". ")
            if not sep or len(text.split()) < 20 or len(rest.split()) < 8:
                continue
            row = {
                "prompt": f"Continue the Python reference documentation on {name!r}: {first}.",
                "completion": rest,
            }
            (held_out if index % held_out_every == 0 else train).append(row)
    return train, held_out


def text_blocks(rows: list[dict], tokenizer, length: int) -> list[dict]:
    """The rows' text (prompt's sentence, then completion) run together and cut into ``length``-token examples, every
    position labelled."""
    text = "\n\n".join(r["prompt"].partition(": ")[2] + " " + r["completion"] for r in rows)
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    return [
        {"input_ids": ids[i : i + length], "labels": ids[i : i + length]} for i in range(0, len(ids) - length, length)
    ]


def longqa_rows(rows: list[dict], tokenizer) -> tuple[list[dict], list[dict]]:
    """Chat rows of the QA set with long prompts: (train, held-out), split as ``qa`` (every 5th pair held out).

    A row's user turn gives training pairs as examples (``Q: ...`` / ``A: ...``, a fixed shuffle that skips the row's
    own pair) until it holds ``LONG_PROMPT_TOKENS`` tokens, then the row's question; the assistant turn is its answer.
    Pairs whose answer would be more than a tenth of the row are left out.
    """
    pairs = [(row["messages"][0]["content"], row["messages"][1]["content"]) for row in rows]
    train_pairs = [pair for i, pair in enumerate(pairs) if i % HELD_OUT_EVERY]
    order = random.Random(0).sample(range(len(train_pairs)), len(train_pairs))
    example_text = [f"Q: {train_pairs[i][0]}\nA: {train_pairs[i][1]}\n\n" for i in order]
    example_tokens = [len(tokenizer(text, add_special_tokens=False)["input_ids"]) for text in example_text]
    train, held_out, cursor = [], [], 0
    for index, (question, answer) in enumerate(pairs):
        prompt, tokens = "Answer the last question in the style of these examples.\n\n", 0
        while tokens < LONG_PROMPT_TOKENS:
            if train_pairs[order[cursor]] != (question, answer):
                prompt, tokens = prompt + example_text[cursor], tokens + example_tokens[cursor]
            cursor = (cursor + 1) % len(order)
        answer_tokens = len(tokenizer(answer, add_special_tokens=False)["input_ids"])
        if answer_tokens * 10 > tokens + answer_tokens:
            continue
        row = {
            "messages": [
                {"role": "user", "content": f"{prompt}Q: {question}"},
                {"role": "assistant", "content": answer},
            ]
        }
        (train if index % HELD_OUT_EVERY else held_out).append(row)
    return train, held_out


def spread_pick(items: list, n: int) -> list:
    """``n`` items spread evenly over ``items`` (all of them when there are fewer)."""
    if len(items) <= n:
        return list(items)
    return [items[i * len(items) // n] for i in range(n)]


def task_data(
    task: str,
    tokenizer,
    max_length: int | None = None,
    held: int | None = None,
    train_examples: int = 600,
    quick: bool = False,
) -> tuple[list[dict], list[dict], str]:
    """Tokenised (train, held-out) examples of ``task`` and its description; ``max_length`` and ``held`` (held-out
    examples, 0: all) default to the task's (``TASK_DEFAULTS``); ``quick``: at most ``train_examples`` of QA."""
    from peft_slim.cli import sft_data

    if task not in TASK_DEFAULTS:
        raise ValueError(f"task {task!r} is not one of {sorted(TASK_DEFAULTS)}.")
    max_length = TASK_DEFAULTS[task]["max_length"] if max_length is None else max_length
    held = TASK_DEFAULTS[task]["held_out"] if held is None else held
    if task == "qa":
        rows = sft_data.read_rows(None, "train")
        examples = tokenize(rows, tokenizer, max_length)
        train, held_out = split(examples)
        held_out = held_out[:held] if held else held_out
        if quick:
            train = train[:train_examples]
        return train, held_out, f"chatterbot-corpus QA ({len(train)} train / {len(held_out)} held-out pairs)"
    if task == "longqa":
        train_rows, held_rows = longqa_rows(sft_data.read_rows(None, "train"), tokenizer)
        held_rows = held_rows[:held] if held else held_rows
        if quick:
            train_rows = train_rows[:train_examples]
        train = tokenize(train_rows, tokenizer, max_length)
        held_out = tokenize(held_rows, tokenizer, max_length)
        lengths = [len(e["input_ids"]) for e in train]
        answers = [sum(label != IGNORE_INDEX for label in e["labels"]) / len(e["labels"]) for e in train]
        return (
            train,
            held_out,
            (
                f"chatterbot-corpus QA with long prompts ({len(train)} train / {len(held_out)} held-out pairs; "
                f"{min(lengths)}-{max(lengths)} tokens a row, the answer {statistics.mean(answers):.1%} of it)"
            ),
        )
    train_rows, held_rows = pydocs_rows()
    if task == "pydocs-full":
        train = text_blocks(train_rows, tokenizer, max_length)[:train_examples]
        held_out = text_blocks(held_rows, tokenizer, max_length)
        held_out = spread_pick(held_out, held) if held else held_out
        return (
            train,
            held_out,
            f"Python reference docs as plain text, every position labelled ({len(train)} train / {len(held_out)} "
            "held-out rows, held-out topics never trained on)",
        )
    train_rows = spread_pick(train_rows, train_examples)
    held_rows = spread_pick(held_rows, held) if held else held_rows
    train = tokenize(train_rows, tokenizer, max_length)
    held_out = tokenize(held_rows, tokenizer, max_length)
    return (
        train,
        held_out,
        (
            f"Python reference docs, first sentence -> rest of paragraph ({len(train)} train / {len(held_out)} "
            "held-out paragraphs, held-out topics never trained on)"
        ),
    )
