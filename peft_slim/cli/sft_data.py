"""Supervised fine-tuning data for ``peft-slim train``: read a dataset, find its format, tokenise it with loss labels.

Three formats, recognised by their columns: plain text (``text``: every token is a target), prompt/completion
(``prompt`` + ``completion``) and chat (``messages``: a list of ``{"role", "content"}``). With completion-only
loss (the default) the prompt, and in a chat everything but the assistant turns, is labelled -100, so the loss
and TokenTune's label-first selection see only the answers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

IGNORE_INDEX = -100
DEFAULT_DATASET = "chatterbot_qa.jsonl"  # under peft_slim/data/, with its licence file
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}
FORMATS = ("text", "prompt-completion", "messages")


class DataError(ValueError):
    """A dataset the command cannot use; the message names the flag to change."""


@dataclass
class Columns:
    """Which columns hold the data, and in which format."""

    format: str
    text: str | None = None
    prompt: str | None = None
    completion: str | None = None
    messages: str | None = None


def default_dataset_path() -> Path:
    return Path(str(resources.files("peft_slim") / "data" / DEFAULT_DATASET))


def read_rows(dataset: str | None, split: str) -> list[dict]:
    """The rows of the embedded default (``dataset=None``), of a local file or folder, or of a hub dataset."""
    if dataset is None:
        with default_dataset_path().open(encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    path = Path(dataset)
    try:
        import datasets
    except ImportError as error:  # the `train` extra installs it
        raise DataError(
            f"--dataset {dataset!r} needs the `datasets` package: pip install 'peft-slim[train]'."
        ) from error
    try:
        if path.is_file():
            builder = FILE_BUILDERS.get(path.suffix.lower())
            if builder is None:
                raise DataError(
                    f"--dataset {dataset!r}: unknown file type {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}."
                )
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train")
        else:
            loaded = datasets.load_dataset(dataset, split=split)
    except DataError:
        raise
    except Exception as error:
        raise DataError(
            f"--dataset {dataset!r} (--dataset-split {split!r}) could not be loaded: {error}. Give a local "
            f"json/jsonl/csv/parquet file, a dataset folder, or a hub dataset id reachable from here."
        ) from error
    return list(loaded)


def find_columns(rows: list[dict], text=None, prompt=None, completion=None, messages=None) -> Columns:
    """The format of ``rows``: the column flags given, else the first of messages, prompt + completion, text."""
    if not rows:
        raise DataError("--dataset has no rows.")
    present = set(rows[0])
    given = {"--text-column": text, "--prompt-column": prompt, "--completion-column": completion}
    given["--messages-column"] = messages
    for flag, column in given.items():
        if column is not None and column not in present:
            raise DataError(f"{flag} {column!r}: the dataset has no such column (columns: {sorted(present)}).")
    if messages is not None:
        return Columns("messages", messages=messages)
    if prompt is not None or completion is not None:
        prompt, completion = prompt or "prompt", completion or "completion"
        for flag, column in (("--prompt-column", prompt), ("--completion-column", completion)):
            if column not in present:
                raise DataError(f"{flag} {column!r}: the dataset has no such column (columns: {sorted(present)}).")
        return Columns("prompt-completion", prompt=prompt, completion=completion)
    if text is not None:
        return Columns("text", text=text)
    if "messages" in present:
        return Columns("messages", messages="messages")
    if {"prompt", "completion"} <= present:
        return Columns("prompt-completion", prompt="prompt", completion="completion")
    if "text" in present:
        return Columns("text", text="text")
    raise DataError(
        f"--dataset: no column says its format (columns: {sorted(present)}); expected `messages`, `prompt` + "
        "`completion`, or `text`. Name yours with --messages-column, --prompt-column/--completion-column or "
        "--text-column."
    )


def _chat_pieces(tokenizer, messages: list[dict]) -> list[tuple[str, bool]]:
    """The chat template's text cut into (piece, is_assistant_turn) pieces, in order.

    Each assistant turn is what the template adds between the conversation before it rendered with the
    generation prompt and the conversation up to it; templates that do not render prefixes this way are refused.
    """
    if not isinstance(messages, list) or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise DataError(f"--messages-column: expected a list of {{'role', 'content'}} dicts, got {messages!r:.200}.")
    if not any(m["role"] == "assistant" for m in messages):
        raise DataError(f"--messages-column: a conversation has no assistant turn to learn: {messages!r:.200}.")

    def render(turns, generation_prompt=False):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    pieces, done = [], ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:index], generation_prompt=True), render(messages[: index + 1])
        if not before.startswith(done) or not upto.startswith(before):
            raise DataError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation, so "
                "the assistant turns cannot be located; pass --no-completion-only-loss to train on every token."
            )
        pieces += [(before[len(done) :], False), (upto[len(before) :], True)]
        done = upto
    pieces.append((render(messages)[len(done) :], False))
    return [(text, labelled) for text, labelled in pieces if text]


def _pieces(row: dict, columns: Columns, tokenizer, chat_template: bool) -> list[tuple[str, bool]]:
    if columns.format == "text":
        return [(str(row[columns.text]), True)]
    if columns.format == "prompt-completion":
        prompt, completion = str(row[columns.prompt]), str(row[columns.completion])
        if chat_template:
            messages = [{"role": "user", "content": prompt}, {"role": "assistant", "content": completion}]
            return _chat_pieces(tokenizer, messages)
        return [(prompt, False), (completion, True)]
    return _chat_pieces(tokenizer, row[columns.messages])


def tokenize(
    rows: list[dict],
    columns: Columns,
    tokenizer,
    max_length: int,
    completion_only: bool = True,
    chat_template: bool | None = None,
) -> tuple[list[dict], int]:
    """``input_ids`` and ``labels`` per row, cut to ``max_length``; also how many rows were dropped because no
    labelled token was left within ``max_length``.

    ``chat_template``: render prompt/completion rows with the tokenizer's chat template (None: when it has one;
    chat rows always use it). Without the template an end-of-sequence token ends each completion or text.
    """
    has_template = getattr(tokenizer, "chat_template", None) is not None
    if chat_template is None:
        chat_template = has_template
    if (chat_template or columns.format == "messages") and not has_template:
        raise DataError(
            "the tokenizer has no chat template: chat (`messages`) data cannot be rendered, and "
            "prompt/completion data needs --no-chat-template."
        )
    examples, dropped = [], 0
    for row in rows:
        pieces = _pieces(row, columns, tokenizer, chat_template)
        if not chat_template and columns.format != "messages" and tokenizer.eos_token is not None:
            pieces.append((tokenizer.eos_token, True))
        input_ids, labels = [], []
        for text, labelled in pieces:
            ids = tokenizer(text, add_special_tokens=False)["input_ids"]
            input_ids += ids
            labels += ids if (labelled or not completion_only) else [IGNORE_INDEX] * len(ids)
        input_ids, labels = input_ids[:max_length], labels[:max_length]
        # A causal LM predicts position t from t-1: the first position's label is never scored.
        if all(label == IGNORE_INDEX for label in labels[1:]):
            dropped += 1
            continue
        examples.append({"input_ids": input_ids, "labels": labels})
    if not examples:
        raise DataError(f"--max-length {max_length}: no example keeps a labelled token; raise --max-length.")
    return examples, dropped


def collate(examples: list[dict], pad_token_id: int) -> dict:
    """Right-pad a batch to its longest example: ``input_ids``, ``attention_mask`` and ``labels`` (-100 on padding)."""
    import torch

    longest = max(len(example["input_ids"]) for example in examples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for example in examples:
        pad = longest - len(example["input_ids"])
        batch["input_ids"].append(example["input_ids"] + [pad_token_id] * pad)
        batch["attention_mask"].append([1] * len(example["input_ids"]) + [0] * pad)
        batch["labels"].append(example["labels"] + [IGNORE_INDEX] * pad)
    return {key: torch.tensor(value, dtype=torch.long) for key, value in batch.items()}
