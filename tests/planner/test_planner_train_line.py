"""``peft-slim plan``'s output: one short line per setting, no warning, and a ``peft-slim train`` line that runs as
printed (on a tiny stand-in model), names what to pass where ``--model`` holds no weights, and is printed only for
AdamW, the optimizer ``train`` uses."""

from __future__ import annotations

import json
import os
import pathlib
import re
import shlex
import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
from helpers.planner_cases import checked_train_args, estimates_remembered, llama_config
from helpers.tiny_chat import QA, save_tiny_chat_llama

from peft_slim.cli import main as cli_main
from peft_slim.cli.plan import MODEL_PLACEHOLDER
from peft_slim.planner.measured import measurement_for
from peft_slim.planner.plan import NOT_MEASURED, ladder

PACKAGED = json.loads(
    (pathlib.Path(__file__).resolve().parents[2] / "peft_slim" / "planner" / "measured.json").read_text()
)
FEW_SETTINGS = ["--batch-size", "2", "--seq-len", "32", "--no-checkpointing", "--min-token-ratio", "0.5"]
LORA_AND_SLIMFIT = [*FEW_SETTINGS[:-1], "1.0"]  # where the settings tried do not matter: the fewest


@pytest.fixture(scope="module", autouse=True)
def remembered():
    """A plan repeated here (the same model and flags, another output) estimates each setting once."""
    with estimates_remembered() as found:
        yield found


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-llama"))


def plan_lines(capsys, *argv: str) -> tuple[int, list[str]]:
    code = cli_main(["plan", *argv])
    return code, capsys.readouterr().out.strip().splitlines()


def test_the_printed_train_line_runs_as_printed(tiny_model, tmp_path, capsys):
    code, lines = plan_lines(capsys, "--model", str(tiny_model), "--budget", "1GB", *LORA_AND_SLIMFIT)
    assert code == 0 and lines[-1].startswith("peft-slim train --model ")
    argv = shlex.split(lines[-1])[2:]
    assert checked_train_args(argv).model == str(tiny_model)
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps(row) + "\n" for row in chat))
    capsys.readouterr()
    run = ["--dataset", str(data), "--output", str(tmp_path / "out"), "--max-steps", "1"]
    assert cli_main(["train", *argv, *run]) == 0
    assert (tmp_path / "out" / "adapter_config.json").is_file()


def test_one_short_line_per_setting_and_no_warning(tmp_path, capsys, remembered):
    llama_config(num_hidden_layers=1).save_pretrained(tmp_path)
    remembered.clear()  # this plan estimates afresh, as a user's does (warnings in its forked processes: see below)
    argv = ["--model", str(tmp_path), "--batch-size", "2", "--seq-len", "32", *FEW_SETTINGS[4:]]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        code, lines = plan_lines(capsys, *argv)
    assert code == 0 and [str(w.message) for w in caught] == []
    rows = [line.split(" | ") for line in lines[1:]]
    assert len(rows) >= 5 and all(len(row) == 7 for row in rows)
    every = ladder(8, 0.05)  # every setting with a packaged measurement: its table cell is short
    every += [replace(c, gradient_checkpointing=True) for c in every]
    cells = {c.name: m.brief() for c in every if (m := measurement_for(c)) is not None}
    assert {measurement_for(c).name for c in every if c.name in cells} == set(PACKAGED["methods"])
    assert all(len(text) <= 80 and text.startswith("measured: LoRA's final perplexity in ") for text in cells.values())
    measured = [row for row in rows if row[-1] != NOT_MEASURED]
    assert measured and all(row[-1] == cells[row[0]] for row in measured)
    code, verbose = plan_lines(capsys, *argv, "--verbose")
    full = {line.split(" | ")[0]: line.split(" | ")[-1] for line in verbose[1:]}
    assert all(full[row[0]] == row[-1] or "benchmarks/results/budget" in full[row[0]] for row in rows)
    assert any(len(text) > 200 for text in full.values())


@pytest.mark.parametrize("weights", [False, True])
def test_a_model_without_weights_gets_a_placeholder_and_the_words_saying_what_to_pass(tmp_path, capsys, weights):
    llama_config(num_hidden_layers=1).save_pretrained(tmp_path)
    given = tmp_path if weights else tmp_path / "config.json"
    if weights:  # a folder with weights: its name goes in the line as given
        (tmp_path / "model.safetensors").write_bytes(b"")
    code, lines = plan_lines(capsys, "--model", str(given), "--budget", "1GB", *FEW_SETTINGS)
    assert code == 0
    argv = shlex.split(lines[-1])[2:]
    assert checked_train_args(argv).model == (str(given) if weights else MODEL_PLACEHOLDER)
    if not weights:
        assert lines[-2].startswith(f"Replace {MODEL_PLACEHOLDER} with the folder or hub id of the model's weights")
        assert str(given) in lines[-2]


def test_no_train_line_for_an_optimizer_train_does_not_use(tmp_path, capsys):
    """`peft-slim train` always uses AdamW: a setting that fits under SGD's (empty) state may not fit under AdamW's."""
    llama_config(num_hidden_layers=1).save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--budget", "1GB", "--optimizer", "sgd", *LORA_AND_SLIMFIT]
    code, lines = plan_lines(capsys, *argv)
    assert code == 0 and not any(line.startswith("peft-slim train") for line in lines)
    assert lines[-1].startswith("Plan with --optimizer adamw for a `peft-slim train` line")


def test_the_command_writes_nothing_but_its_progress_bar_to_stderr(tmp_path):
    """The real command in a fresh process, Python's warnings all shown: stderr holds the progress bar only (no
    warning of Python, transformers' logging or C++), stdout the table. DeprecationWarnings stay hidden, as Python
    hides them outside ``__main__`` (torch warns one when bitsandbytes, imported by PEFT, compiles a kernel)."""
    llama_config(num_hidden_layers=4).save_pretrained(tmp_path)
    env = {**os.environ, "PYTHONWARNINGS": "always,ignore::DeprecationWarning", "TRANSFORMERS_VERBOSITY": "warning"}
    argv = [sys.executable, "-m", "peft_slim", "plan", "--model", str(tmp_path), *FEW_SETTINGS, "--lora-r", "2"]
    done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    pieces = [piece.strip() for piece in re.split(r"[\r\n]+", done.stderr) if piece.strip()]
    assert pieces and all(piece.startswith("estimating:") for piece in pieces), pieces
    assert done.stdout.splitlines()[1].startswith("lora+lora-r2 | ")


def test_json_output_holds_the_table_in_bytes_and_the_train_line(tmp_path, capsys):
    llama_config(num_hidden_layers=1).save_pretrained(tmp_path)
    argv = ["--model", str(tmp_path), "--budget", "1GB", *FEW_SETTINGS]
    code, lines = plan_lines(capsys, *argv)
    json_code, json_lines = plan_lines(capsys, *argv, "--json")
    found = json.loads("\n".join(json_lines))
    assert code == json_code == 0
    assert [s["name"] for s in found["settings"]] == [line.split(" | ")[0] for line in lines[1:-2]]
    assert found["train_command"] == lines[-1] and found["notes"] == [lines[-2]]
    first = found["settings"][0]
    assert set(first["estimate"]) == {"parameters", "gradients", "optimizer_state", "activations", "peak"}
    assert first["method"] == "lora" and first["lora_r"] == 8 and first["evidence"]
