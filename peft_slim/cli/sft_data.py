"""Supervised fine-tuning data for ``peft-slim train``: read a dataset, find its format (``text``, ``prompt`` +
``completion``, or chat ``messages``), check every row naming file, line and column (TRL checks none), and hand
the rows to ``SFTTrainer`` in its formats (chat rows labelled here, at the assistant turns).
"""

from __future__ import annotations

import csv
import io
import json
import re
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

DEFAULT_DATASET = "chatterbot_qa.jsonl"  # under peft_slim/data/, with its licence file
FILE_BUILDERS = {".json": "json", ".jsonl": "json", ".csv": "csv", ".parquet": "parquet"}


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


class Rows(list):
    """The rows of a dataset, with where each came from (for messages that point at a row)."""

    def __init__(self, rows, source: str, lines: list[int] | None = None, note: str | None = None):
        super().__init__(rows)
        self.source, self.lines, self.note = source, lines, note  # note: what was left out of the file, if anything

    def where(self, index: int) -> str:
        """'<source>, line 7' (JSON lines: the file's 1-based line) or '<source>, row 7' (1-based)."""
        if self.lines is not None and index < len(self.lines):
            return f"{self.source}, line {self.lines[index]}"
        return f"{self.source}, row {index + 1}"


def _where(rows, index: int) -> str:
    return rows.where(index) if isinstance(rows, Rows) else f"row {index + 1}"


def _check_utf8(path: Path) -> bytes:
    """The file's bytes; a byte sequence that is not UTF-8 is refused naming the file, its line and the encoding."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        raise DataError(
            f"--dataset {str(path)!r}, line {line}: not valid UTF-8 (byte {data[error.start]:#04x} at offset "
            f"{error.start}); json, jsonl and csv data must be UTF-8 encoded: re-encode the file, e.g. "
            f"`iconv -f latin1 -t utf-8`."
        ) from None
    return data


def _bad_text(value) -> str | None:
    """The first string (key or value) in ``value`` that has no UTF-8 form (a lone surrogate escape such as
    ``"\\ud800"``, which JSON parses but Arrow cannot store), or None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return value
        return None
    items = [item for pair in value.items() for item in pair] if isinstance(value, dict) else value
    if not isinstance(items, list):
        return None
    return next((bad for item in items if (bad := _bad_text(item)) is not None), None)


def _paths(value, prefix: str = ""):
    """(field such as ``messages[].content``, JSON type) of every non-null value in ``value``."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, f"{prefix}.{key}" if prefix else key)
    elif isinstance(value, list):
        yield prefix, "list"
        for item in value:
            yield from _paths(item, prefix + "[]")
    elif value is not None:
        yield prefix, type(value).__name__


class _DuplicateKey(ValueError):
    """A JSON object naming a key twice (``json`` and the ``json`` builder would keep only one of the values)."""

    def __init__(self, key: str, line: int | None = None):
        super().__init__(key, line)
        self.key, self.line = key, line


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    seen = set()
    for key, _ in pairs:
        if key in seen:
            raise _DuplicateKey(key)
        seen.add(key)
    return dict(pairs)


def _json_values(text: str):
    """(1-based line it starts on, value) of each row of a JSON text: a JSON array's items, else each top-level value
    (JSON lines). Raises ``_DuplicateKey`` (with the line) or ``json.JSONDecodeError``."""
    decoder, space = json.JSONDecoder(object_pairs_hook=_unique_keys), re.compile(r"\s*")
    position, line, counted = space.match(text).end(), 1, 0
    array = text.startswith("[", position)
    if array:
        position = space.match(text, position + 1).end()
    while position < len(text) and not (array and text.startswith("]", position)):
        line, counted = line + text.count("\n", counted, position), position
        try:
            value, end = decoder.raw_decode(text, position)
        except _DuplicateKey as error:
            raise _DuplicateKey(error.key, line) from None
        yield line, value
        position = space.match(text, end).end()
        if array and text.startswith(",", position):
            position = space.match(text, position + 1).end()


def _scan_json(dataset: str, text: str) -> tuple[list[int] | None, str | None]:
    """The line each row of a JSON (lines) file starts on (None: not valid JSON), and where the ``json`` builder,
    should it fail, goes wrong (the first row not an object, or with a field of another type than on an earlier row).
    A key repeated in one object is refused here: the builder would not say where, or keep one of the values."""
    lines, seen, problem = [], {}, None
    try:
        for number, row in _json_values(text):
            lines.append(number)
            if problem is not None:
                continue  # the first one is reported; the rest is scanned for lines and repeated keys
            if not isinstance(row, dict):
                problem = f"line {number}: found {type(row).__name__}, expected a JSON object (one row per line)."
                continue
            bad = _bad_text(row)
            if bad is not None:
                raise DataError(
                    f"--dataset {dataset!r}, line {number}: found {bad!r:.80}, a lone surrogate escape (such as "
                    "\\ud800) that is no Unicode character; expected text: remove or replace the escape."
                )
            for field, kind in _paths(row):
                first = seen.setdefault(field, (kind, number))
                if first[0] != kind:
                    problem = (
                        f"line {number}: column {field!r}: found {kind}, expected {first[0]} as on line {first[1]} "
                        "(a column holds one type)."
                    )
                    break
    except _DuplicateKey as error:
        raise DataError(
            f"--dataset {dataset!r}, line {error.line}: key {error.key!r} appears twice in one object; expected "
            "each key once (only one of the values would be read): rename or remove the other."
        ) from None
    except json.JSONDecodeError as error:
        return None, problem or f"line {error.lineno}: not valid JSON ({error.msg}, column {error.colno})."
    return lines, problem


def _csv_options(dataset: str, text: str) -> tuple[dict, str | None]:
    """The ``csv`` builder's options reading every cell as text (no type or NA guessing), and a note when an unnamed
    first column (pandas' row index) is ignored. A repeated or unnamed column is refused: pandas would rename it
    (``completion.1``, ``Unnamed: 2``) and the run train on the first."""
    import datasets

    header = next(csv.reader(io.StringIO(text)), [])
    index = header[:1] == [""] and len(header) > 1
    named = header[1:] if index else header
    repeated = sorted({name for name in named if named.count(name) > 1})
    if repeated:
        raise DataError(
            f"--dataset {dataset!r}, line 1: the header names column(s) {', '.join(map(repr, repeated))} more than "
            f"once (header: {header}); expected each column name once: rename or remove the repeated column."
        )
    if "" in named:
        raise DataError(
            f"--dataset {dataset!r}, line 1: column {header.index('', int(index)) + 1} has no name (header: "
            f"{header}); expected a name for every column: name it or remove it."
        )
    options = {"features": datasets.Features({name: datasets.Value("string") for name in named}), "na_filter": False}
    if not index:
        return options, None
    note = "its first column, unnamed, is ignored (the row index of pandas' to_csv(); to_csv(index=False) omits it)"
    return options | {"usecols": named}, note


def read_rows(dataset: str | None, split: str, config: str | None = None) -> Rows:
    """The rows of the embedded default (``dataset=None``), of a local file or folder, or of a hub dataset."""
    if dataset is None:
        path = default_dataset_path()
        numbered = list(_json_values(path.read_text(encoding="utf-8")))
        return Rows([row for _, row in numbered], str(path), [number for number, _ in numbered])
    path = Path(dataset)
    try:
        import datasets
    except ImportError as error:  # the `train` extra installs it
        raise DataError(
            f"--dataset {dataset!r} needs the `datasets` package: pip install 'peft-slim[train]'."
        ) from error
    builder = FILE_BUILDERS.get(path.suffix.lower()) if path.is_file() else None
    lines, located, note = None, None, None
    try:
        if path.is_file():
            if builder is None:
                raise DataError(
                    f"--dataset {dataset!r}: unknown file type {path.suffix!r}; use one of {sorted(FILE_BUILDERS)}."
                )
            options = {}
            if builder == "json":
                lines, located = _scan_json(dataset, _check_utf8(path).decode("utf-8-sig"))  # the loader skips a BOM
            elif builder == "csv":
                options, note = _csv_options(dataset, _check_utf8(path).decode("utf-8-sig"))
            loaded = datasets.load_dataset(builder, data_files=str(path), split="train", **options)
        elif (path / "dataset_info.json").is_file() or (path / "dataset_dict.json").is_file():
            loaded = datasets.load_from_disk(str(path))  # a Dataset.save_to_disk folder (load_dataset refuses it)
            if isinstance(loaded, datasets.DatasetDict):
                if split not in loaded:
                    raise DataError(
                        f"--dataset {dataset!r} has no split {split!r}; expected --dataset-split one of "
                        f"{sorted(loaded)}."
                    )
                loaded = loaded[split]
        else:
            loaded = datasets.load_dataset(dataset, config, split=split)
    except DataError:
        raise
    except Exception as error:
        if located is not None:
            raise DataError(f"--dataset {dataset!r}, {located}") from error
        raise DataError(
            f"--dataset {dataset!r} (--dataset-split {split!r}) could not be loaded: {error}. Give a local "
            f"json/jsonl/csv/parquet file, a dataset folder, or a hub dataset id reachable from here."
        ) from error
    source = f"--dataset {dataset!r}" + ("" if path.is_file() else f" (split {split!r})")
    if lines is not None and len(lines) != len(loaded):
        lines = None  # rows do not map to values one to one (one object of columns): rows are numbered instead
    return Rows(list(loaded), source, lines, note)


def find_columns(rows: list[dict], text=None, prompt=None, completion=None, messages=None) -> Columns:
    """The format of ``rows``: the column flags given, else the first of messages, prompt + completion, text."""
    # Not trl.is_conversational: it reads the values of fixed column names (an empty list fails); flags rename them.
    if not rows:
        raise DataError("--dataset has no rows.")
    present = set().union(*(row.keys() for row in rows))
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


ROLES = ("system", "developer", "user", "assistant", "tool")  # the roles chat templates render


def _found(value) -> str:
    return "nothing (the key is missing or null)" if value is None else f"{type(value).__name__} {value!r:.80}"


def check_rows(rows: list[dict], columns: Columns) -> None:
    """Every row holds what its format needs, or the first that does not is refused naming file, row, column, what
    was found and what was expected; no row is skipped or coerced."""

    def refuse(index: int, column: str, found: str, expected: str):
        raise DataError(f"{_where(rows, index)}: column {column!r}: found {found}, expected {expected}.")

    for index, row in enumerate(rows):
        if columns.format == "text":
            needs = [(columns.text, "a non-empty string")]
        elif columns.format == "prompt-completion":
            needs = [(columns.prompt, "a string"), (columns.completion, "a non-empty string")]
        else:
            _check_messages(row.get(columns.messages), lambda f, e, i=index: refuse(i, columns.messages, f, e))
            continue
        for column, expected in needs:
            value = row.get(column)
            if not isinstance(value, str) or (expected.startswith("a non-empty") and not value):
                refuse(index, column, "an empty string" if value == "" else _found(value), expected)


def _check_messages(messages, refuse) -> None:
    if not isinstance(messages, list) or not messages:
        refuse("an empty list" if messages == [] else _found(messages), "a list of {'role', 'content'} messages")
    for number, message in enumerate(messages, 1):
        role = message.get("role") if isinstance(message, dict) else None
        if not isinstance(message, dict) or role is None or message.get("content") is None:
            refuse(f"message {number}: {_found(message)}", "a dict with 'role' and 'content'")
        if role not in ROLES:
            refuse(f"message {number} with role {role!r}", f"a role among {ROLES}")
        if not isinstance(message["content"], str):
            refuse(f"message {number} with content {_found(message['content'])}", "string content")
        if role == "assistant" and not message["content"]:  # its only label would be the end of the turn
            refuse(f"message {number} with role 'assistant' and empty content", "a non-empty answer to learn")
    if not any(message["role"] == "assistant" for message in messages):
        refuse("no assistant message", "at least one assistant turn to learn")
    if messages[0]["role"] == "assistant":  # its prompt: an empty conversation, which transformers refuses
        refuse("message 1 with role 'assistant'", "a turn before the first assistant turn")


def _chat_pieces(tokenizer, messages: list[dict], completion_only: bool = True) -> list[tuple[str, bool]]:
    """The chat template's text cut into (piece, is_assistant_turn) pieces, in order. Each assistant turn is what
    the template adds between the conversation before it (with the generation prompt) and up to it; a template not
    rendering prefixes this way is refused (without ``completion_only``: one piece)."""
    # Not trl.apply_chat_template's prompt/completion split per turn: it continues a turn after an assistant turn,
    # refuses one after a system turn, and cuts silently at the common prefix where this refuses the template.

    def render(turns, generation_prompt=False):
        return tokenizer.apply_chat_template(turns, tokenize=False, add_generation_prompt=generation_prompt)

    pieces, done = [], ""
    for index, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before, upto = render(messages[:index], generation_prompt=True), render(messages[: index + 1])
        if upto == render(messages[:index]):  # else trained on the prompts alone, or dropped as if cut by --max-length
            raise DataError(
                f"the tokenizer's chat template renders message {index + 1} (role 'assistant') as nothing, so it has "
                "no tokens to learn; expected a chat template that renders assistant turns."
            )
        if not before.startswith(done) or not upto.startswith(before):
            if not completion_only:  # every token is a target: the turns need not be located
                return [(render(messages), True)]
            raise DataError(
                "the tokenizer's chat template does not render a conversation as a prefix of its continuation, so "
                "the assistant turns cannot be located; pass --no-completion-only-loss to train on every token."
            )
        pieces += [(before[len(done) :], False), (upto[len(before) :], True)]
        done = upto
    pieces.append((render(messages)[len(done) :], False))
    return [(text, labelled) for text, labelled in pieces if text]


def _chat_example(messages: list[dict], tokenizer, completion_only: bool) -> dict:
    """``input_ids`` and ``completion_mask`` (1 on assistant turns) of a conversation, no special token added."""
    input_ids, mask = [], []
    for text, assistant in _chat_pieces(tokenizer, messages, completion_only):
        ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids += ids
        mask += [int(assistant or not completion_only)] * len(ids)
    return {"input_ids": input_ids, "completion_mask": mask}


def to_dataset(rows: list[dict], columns: Columns, tokenizer, completion_only: bool = True, chat_template=None):
    """The checked ``rows`` as a ``datasets.Dataset`` in TRL's formats: ``text``; ``prompt`` + ``completion`` (chat
    turns where ``chat_template``, None: when the tokenizer has one); chat rows tokenised here (``input_ids`` +
    ``completion_mask``), since TRL's assistant_only_loss needs templates marking ``{% generation %}``."""
    import datasets

    has_template = getattr(tokenizer, "chat_template", None) is not None
    chat_template = has_template if chat_template is None else chat_template
    if (chat_template or columns.format == "messages") and not has_template:
        raise DataError(
            "the tokenizer has no chat template: chat (`messages`) data cannot be rendered, and "
            "prompt/completion data needs --no-chat-template."
        )
    check_rows(rows, columns)
    examples = []
    for index, row in enumerate(rows):
        if columns.format == "text":
            examples.append({"text": row[columns.text]})
        elif columns.format == "prompt-completion":
            prompt, completion = row[columns.prompt], row[columns.completion]
            if chat_template:  # TRL's conversational prompt-completion: rendered by the template
                prompt = [{"role": "user", "content": prompt}]
                completion = [{"role": "assistant", "content": completion}]
            examples.append({"prompt": prompt, "completion": completion})
        else:
            try:
                examples.append(_chat_example(row[columns.messages], tokenizer, completion_only))
            except DataError as error:
                raise DataError(f"{_where(rows, index)}: {error}") from None
    return datasets.Dataset.from_list(examples)
