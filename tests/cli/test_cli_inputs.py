"""The command line's inputs, adversarially: every row and column of a data file checked (refused naming the file,
the line or row, the column, what was found and what was expected), non-UTF-8 files refused naming the line, and
every size and budget of the planner and of both commands bounded before anything is allocated."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from helpers.planner_cases import llama_config
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from peft_slim.cli import main, sft_data
from peft_slim.planner import estimate_memory, plan
from peft_slim.planner.setup import MAX_BATCH_SIZE, MAX_TOKENS

USER = {"role": "user", "content": "Hi?"}
ANSWER = {"role": "assistant", "content": "Hello."}
GOOD_CHAT = {"messages": [USER, ANSWER]}
GOOD_PC = {"prompt": "Hi?", "completion": "Hello."}


def jsonl(path: Path, rows: list, blank_line_after_first: bool = True) -> Path:
    lines = [json.dumps(row) for row in rows]
    if blank_line_after_first:
        lines.insert(1, "")  # a blank line: jsonl rows are numbered by the file's lines, not by row index
    path.write_text("\n".join(lines) + "\n")
    return path


def refused(capsys, dataset: Path, *flags: str) -> str:
    """``peft-slim train`` on ``dataset`` exits 2 before any model loads (the model path does not exist)."""
    code = main(["train", "--model", str(dataset.parent / "no-model"), "--dataset", str(dataset), *flags])
    err = capsys.readouterr().err
    assert code == 2, err
    assert "no-model" not in err, err  # refused for the data, not for the (missing) model
    return err


# Row 3 (line 4 of the file, after the blank line) is the bad one; rows 1 and 2 are fine.
BAD_ROWS = {
    "completion missing": ({"prompt": "Hi?"}, "'completion': found nothing"),
    "completion null": ({"prompt": "Hi?", "completion": None}, "'completion': found nothing"),
    "completion empty": ({"prompt": "Hi?", "completion": ""}, "'completion': found an empty string"),
    "completion a number": ({"prompt": "Hi?", "completion": 3}, "'completion': found int, expected str as on line 1"),
    "prompt a list": ({"prompt": ["Hi?"], "completion": "Hello."}, "'prompt': found list, expected str"),
}


@pytest.mark.parametrize("case", list(BAD_ROWS))
def test_a_bad_prompt_completion_row_is_refused_naming_line_and_column(case, tmp_path, capsys):
    row, found = BAD_ROWS[case]
    path = jsonl(tmp_path / "pc.jsonl", [GOOD_PC, GOOD_PC, row, GOOD_PC])
    err = refused(capsys, path)
    assert f"'{path}', line 4: column {found}" in err
    assert "expected " in err


BAD_CHATS = {
    "messages null": (None, "found nothing"),
    "message without content": ([USER, {"role": "assistant"}], "found message 2"),
    "unknown role": ([{"role": "human", "content": "Hi?"}, ANSWER], "found message 1 with role 'human'"),
    "content not a string": ([USER, {"role": "assistant", "content": 7}], "found int, expected str as on line 1"),
    "no assistant turn": ([USER], "found no assistant message"),
    "assistant turn first": ([ANSWER, USER], "found message 1 with role 'assistant'"),
    "empty conversation": ([], "found"),
    # The bug: an empty assistant turn's only label was the end of the turn: the model learnt to answer nothing.
    "empty assistant turn": (
        [USER, {"role": "assistant", "content": ""}],
        "found message 2 with role 'assistant' and empty content",
    ),
}


@pytest.mark.parametrize("case", list(BAD_CHATS))
def test_a_bad_chat_row_is_refused_naming_line_and_message(case, tmp_path, capsys):
    messages, found = BAD_CHATS[case]
    path = jsonl(tmp_path / "chat.jsonl", [GOOD_CHAT, GOOD_CHAT, {"messages": messages}])
    err = refused(capsys, path)
    column = "'messages[].content'" if "as on line" in found else "'messages'"
    assert f"'{path}', line 4: column {column}: {found}" in err, err


def test_rows_of_mixed_formats_are_refused(tmp_path, capsys):
    path = jsonl(tmp_path / "mixed.jsonl", [GOOD_CHAT, {"text": "plain text"}], blank_line_after_first=False)
    assert "line 2: column 'messages': found nothing" in refused(capsys, path)


def test_a_null_text_row_is_refused(tmp_path, capsys):
    path = jsonl(tmp_path / "text.jsonl", [{"text": "fine"}, {"text": None}], blank_line_after_first=False)
    assert "line 2: column 'text': found nothing" in refused(capsys, path)


def test_csv_and_parquet_rows_are_checked(tmp_path, capsys):
    csv = tmp_path / "pc.csv"
    csv.write_text("prompt,completion\nHi?,Hello.\nHi?,\n")
    assert "row 2: column 'completion': found an empty string" in refused(capsys, csv)
    pyarrow = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    parquet = tmp_path / "text.parquet"
    pyarrow.write_table(pa.table({"text": ["fine", None, "fine"]}), parquet)
    assert "row 2: column 'text': found nothing" in refused(capsys, parquet)


def test_csv_cells_are_read_as_the_text_they_are(tmp_path):
    """The bug: pandas' type and NA guessing made `42` an int, `True` a bool and `NA` nothing, so valid answers were
    refused ("found int 42", "found nothing")."""
    path = tmp_path / "answers.csv"
    path.write_text("prompt,completion\nSix times seven?,42\nIs it?,True\nCode?,NA\nNothing?,null\nSkip?,\n")
    rows = sft_data.read_rows(str(path), "train")
    assert [row["completion"] for row in rows] == ["42", "True", "NA", "null", ""]
    sft_data.check_rows(rows[:4], sft_data.find_columns(rows))  # valid answers; the empty one is refused (above)


def test_a_csv_naming_a_column_twice_is_refused(tmp_path, capsys):
    """The bug: pandas renamed the second `completion` to `completion.1` and the run trained on the first."""
    path = tmp_path / "twice.csv"
    path.write_text("prompt,completion,completion\nHi?,Hello.,Bye.\n")
    err = refused(capsys, path)
    assert f"'{path}', line 1: the header names column(s) 'completion' more than once" in err, err


@pytest.mark.parametrize("bom", ["", "\ufeff"], ids=["utf-8", "utf-8 with a BOM"])
@pytest.mark.parametrize("layout", ["jsonl", "array"])
def test_a_json_key_given_twice_is_refused_naming_line_and_key(layout, bom, tmp_path, capsys):
    """The bug: JSON lines failed with "An error occurred while generating the dataset" (no line, no key); a JSON
    array kept the last value silently. With a byte order mark (which the loader accepts) the check was skipped:
    the array kept the last value, JSON lines were refused as "line 1: not valid JSON"."""
    twice = '{"prompt": "Hi?", "completion": "Hello.", "completion": "Bye."}'
    if layout == "jsonl":
        path = tmp_path / "twice.jsonl"
        path.write_text(f"{bom}{json.dumps(GOOD_PC)}\n\n{twice}\n", encoding="utf-8")
    else:
        path = tmp_path / "twice.json"
        path.write_text(f"{bom}[\n  {json.dumps(GOOD_PC)},\n\n  {twice}\n]\n", encoding="utf-8")
    line = 3 if layout == "jsonl" else 4
    assert f"'{path}', line {line}: key 'completion' appears twice in one object" in refused(capsys, path)


def test_json_array_rows_are_named_by_their_line(tmp_path, capsys):
    path = tmp_path / "rows.json"
    path.write_text(f"[\n  {json.dumps(GOOD_PC)},\n\n  {json.dumps({'prompt': 'Hi?', 'completion': ''})}\n]\n")
    assert f"'{path}', line 4: column 'completion': found an empty string" in refused(capsys, path)


@pytest.mark.parametrize("suffix", [".jsonl", ".csv"])
def test_a_file_that_is_not_utf8_is_refused_naming_line_and_encoding(suffix, tmp_path, capsys):
    path = tmp_path / f"latin1{suffix}"
    head = b'{"text": "fine"}\n' if suffix == ".jsonl" else b"text\nfine\n"
    path.write_bytes(head + '{"text": "café"}\n'.encode("latin-1"))
    err = refused(capsys, path)
    line = 2 if suffix == ".jsonl" else 3
    assert f"'{path}', line {line}: not valid UTF-8" in err


def test_tokenize_never_trains_on_a_missing_completion():
    """The bug: a missing completion became the text 'None' plus the end marker, trained on, 0 rows dropped."""
    rows = sft_data.Rows([GOOD_PC, {"prompt": "Hi?", "completion": None}], "data.jsonl", [1, 2])
    with pytest.raises(sft_data.DataError, match=r"data.jsonl, line 2: column 'completion': found nothing"):
        sft_data.to_dataset(rows, sft_data.find_columns(rows), tokenizer=None, chat_template=False)


# ------------------------------------------------------------------------------------------------- sizes
CONFIG = llama_config(
    hidden_size=32, intermediate_size=64, num_hidden_layers=1, vocab_size=100, max_position_embeddings=512
)
NOT_AN_INT = st.one_of(st.floats(allow_nan=True), st.booleans(), st.text(max_size=3), st.none())


@settings(max_examples=60, deadline=2000, suppress_health_check=[HealthCheck.too_slow])
@given(
    field=st.sampled_from(["batch_size", "seq_len"]),
    value=st.one_of(st.integers(max_value=0), st.integers(min_value=MAX_TOKENS + 1, max_value=10**30), NOT_AN_INT),
)
def test_out_of_range_sizes_are_refused_at_once(field, value):
    """Any size out of range, or not an int, is a ValueError naming the field, in well under a second."""
    sizes = {"batch_size": 1, "seq_len": 8, field: value}
    start = time.perf_counter()
    with pytest.raises(ValueError, match=field):
        estimate_memory(CONFIG, None, sizes["batch_size"], sizes["seq_len"])
    assert time.perf_counter() - start < 1.0


@settings(max_examples=30, deadline=2000)
@given(seq_len=st.integers(min_value=513, max_value=MAX_TOKENS))
def test_seq_len_is_bounded_by_the_models_positions(seq_len):
    with pytest.raises(ValueError, match=r"seq_len=\d+: longer than the 512 positions"):
        estimate_memory(CONFIG, None, 1, seq_len)


@settings(max_examples=30, deadline=2000)
@given(batch_size=st.integers(min_value=MAX_TOKENS // 512 + 1, max_value=MAX_BATCH_SIZE))
def test_tokens_per_micro_batch_are_bounded(batch_size):
    with pytest.raises(ValueError, match="tokens per micro-batch"):
        estimate_memory(CONFIG, None, batch_size, 512)


@pytest.mark.parametrize(
    ("options", "field"),
    [
        ({"budget": 10**30}, "budget"),
        ({"budget": 0}, "budget"),
        ({"budget": 2.5e9}, "budget"),
        ({"lora_r": 10**7}, "lora_r"),
        ({"lora_r": 0}, "lora_r"),
        ({"min_token_ratio": float("nan")}, "min_token_ratio"),
        ({"min_token_ratio": "0.1"}, "min_token_ratio"),
    ],
)
def test_plan_bounds_its_budget_and_rank(options, field):
    with pytest.raises(ValueError, match=field):
        plan(CONFIG, options.pop("budget", None), 1, 8, **options)


def test_plan_refuses_a_seq_len_beyond_the_models_positions(tmp_path, capsys):
    CONFIG.save_pretrained(tmp_path)
    code = main(["plan", "--model", str(tmp_path), "--batch-size", "1", "--seq-len", "4096"])
    assert code == 2 and "seq_len=4096: longer than the 512 positions" in capsys.readouterr().out


def test_a_pandas_csv_is_read_with_its_index_column_named_and_ignored(tmp_path):
    """The bug: pandas' to_csv() writes an unnamed index column first; the load failed with a generic message."""
    pandas = pytest.importorskip("pandas")
    path = tmp_path / "pc.csv"
    pandas.DataFrame({"prompt": ["Hi?", "Bye?"], "completion": ["Hello.", "Bye."]}).to_csv(path)
    rows = sft_data.read_rows(str(path), "train")
    assert rows == [{"prompt": "Hi?", "completion": "Hello."}, {"prompt": "Bye?", "completion": "Bye."}]
    assert "first column, unnamed, is ignored" in rows.note


def test_a_csv_column_without_a_name_elsewhere_is_refused(tmp_path, capsys):
    path = tmp_path / "pc.csv"
    path.write_text("prompt,,completion\nHi?,x,Hello.\n")
    assert f"'{path}', line 1: column 2 has no name" in refused(capsys, path)


def test_a_lone_surrogate_escape_is_refused_with_its_line(tmp_path, capsys):
    """The bug: the row scan passed it, then pyarrow failed with a generic message and no line."""
    path = tmp_path / "pc.jsonl"
    path.write_text(json.dumps(GOOD_PC) + "\n" + '{"prompt": "Hi \\ud800", "completion": "Hello."}\n')
    assert f"'{path}', line 2: found 'Hi \\ud800', a lone surrogate escape" in refused(capsys, path)


@pytest.mark.parametrize("as_dict", [False, True], ids=["Dataset", "DatasetDict"])
def test_a_save_to_disk_folder_is_loaded(as_dict, tmp_path):
    """The bug: datasets answered "use load_from_disk instead", which the command line cannot do."""
    datasets = pytest.importorskip("datasets")
    saved = datasets.Dataset.from_list([GOOD_PC, {"prompt": "Bye?", "completion": "Bye."}])
    (datasets.DatasetDict({"train": saved}) if as_dict else saved).save_to_disk(str(tmp_path / "saved"))
    rows = sft_data.read_rows(str(tmp_path / "saved"), "train")
    assert rows == [GOOD_PC, {"prompt": "Bye?", "completion": "Bye."}]
