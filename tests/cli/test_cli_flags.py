"""``peft-slim train``'s arguments: TRL's (``TrlParser`` over ``ScriptArguments``, ``SFTConfig``, ``ModelConfig``)
plus the method's; every earlier flag spelling still reaches its field, a YAML ``--config`` is read as ``trl sft``
reads it, ``--help`` shows each default once, and a bad value is refused in one line, the reason first."""

from __future__ import annotations

import pytest

from peft_slim.cli import main
from peft_slim.cli.arguments import ADAPTER_LR, BASE_WEIGHT_LR, DEFAULT_STEPS, check, make_parser
from peft_slim.recipe import Recipe


def parse(argv: list[str]):
    """(data, training, model, method) arguments and the checked ``Recipe``."""
    arguments = make_parser().parse_args_and_config(argv)
    return (*arguments, check(*arguments))


def field(argv: list[str], name: str):
    for part in parse(argv):
        if hasattr(part, name):
            return getattr(part, name)
    raise AssertionError(name)


# Each flag `peft-slim train` documented before TRL's arguments, and the field (TRL's name where TRL has one) it sets.
EARLIER_FLAGS = [
    (["--model", "m"], "model_name_or_path", "m"),
    (["--gguf-file", "f.gguf", "--model", "m"], "gguf_file", "f.gguf"),
    (["--dataset", "d.jsonl"], "dataset_name", "d.jsonl"),
    (["--dataset-split", "test"], "dataset_train_split", "test"),
    (["--text-column", "body"], "dataset_text_field", "body"),
    (["--prompt-column", "q"], "prompt_column", "q"),
    (["--completion-column", "a"], "completion_column", "a"),
    (["--messages-column", "chat"], "messages_column", "chat"),
    (["--no-completion-only-loss"], "completion_only_loss", False),
    (["--chat-template"], "chat_template", True),
    (["--no-chat-template"], "chat_template", False),
    (["--max-length", "64"], "max_length", 64),
    (["--max-steps", "5"], "max_steps", 5),
    (["--num-epochs", "2", "--dataset", "d.jsonl"], "num_train_epochs", 2.0),
    (["--batch-size", "4"], "per_device_train_batch_size", 4),
    (["--gradient-accumulation-steps", "3"], "gradient_accumulation_steps", 3),
    (["--learning-rate", "0.001"], "learning_rate", 0.001),
    (["--bf16"], "bf16", True),
    (["--dtype", "bfloat16"], "dtype", "bfloat16"),
    (["--seed", "7"], "seed", 7),
    (["--output", "out"], "output_dir", "out"),
    (["--method", "slimfit"], "method", "slimfit"),
    (["--lora-r", "4"], "lora_r", 4),
    (["--lora-alpha", "3.5"], "lora_alpha", 3.5),
    (["--lora-target-modules", "q_proj,v_proj"], "lora_target_modules", "q_proj,v_proj"),
    (["--token-ratio", "0.5"], "token_ratio", 0.5),
    (["--selection", "random"], "selection", "random"),
    (["--prompt-ratio", "0.1"], "prompt_ratio", 0.1),
    (["--method", "slimfit", "--freeze-ratio", "0.5"], "freeze_ratio", 0.5),
    (["--method", "slimfit", "--catch-up", "none"], "catch_up", "none"),
    (["--compression-bits", "8"], "compression_bits", "8"),
    (["--gradient-checkpointing"], "activation_checkpointing", True),
]


@pytest.mark.parametrize(("argv", "name", "value"), EARLIER_FLAGS, ids=[" ".join(a) for a, _, _ in EARLIER_FLAGS])
def test_each_earlier_flag_spelling_reaches_its_field(argv, name, value):
    found = field(argv, name)
    assert (type(found), found) == (type(value), value)


def test_trl_spellings_work_beside_ours():
    assert field(["--per_device_train_batch_size", "2"], "per_device_train_batch_size") == 2
    assert field(["--model_name_or_path", "m"], "model_name_or_path") == "m"
    assert field(["--output_dir", "o"], "output_dir") == "o"


def test_no_flags_give_the_default_run():
    data, training, model, method, recipe = parse([])
    assert recipe == Recipe()  # TokenTune + LoRA r=8, all linear layers, 30%, answer first
    assert (data.dataset_name, model.model_name_or_path, training.output_dir) == (None, None, "peft-slim-output")
    assert (training.max_steps, training.learning_rate, training.per_device_train_batch_size) == (
        DEFAULT_STEPS,
        2e-4,
        8,
    )
    assert (training.max_length, training.seed, training.bf16, training.activation_checkpointing) == (
        256,
        0,
        False,
        False,
    )
    assert training.completion_only_loss is True and training.save_strategy == "no"


def test_the_method_sets_the_learning_rate_and_a_given_dataset_one_epoch():
    assert field(["--method", "full"], "learning_rate") == BASE_WEIGHT_LR
    assert field(["--method", "lora"], "learning_rate") == ADAPTER_LR
    assert field(["--dataset", "d.jsonl"], "max_steps") == -1
    assert field(["--dataset", "d.jsonl"], "num_train_epochs") == 1.0


def test_a_yaml_config_is_read_as_trl_sft_reads_it_and_flags_beside_it_win(tmp_path):
    config = tmp_path / "recipe.yaml"
    config.write_text("method: slimfit\nfreeze_ratio: 0.5\nlora_r: 4\nper_device_train_batch_size: 2\nseed: 3\n")
    *_, recipe = parse(["--config", str(config), "--seed", "5"])
    assert (recipe.method, recipe.freeze_ratio, recipe.lora_r) == ("slimfit", 0.5, 4)
    assert field(["--config", str(config), "--seed", "5"], "seed") == 5
    assert field(["--config", str(config)], "per_device_train_batch_size") == 2


@pytest.mark.parametrize(
    ("text", "named"),
    [(None, "No such file"), ("method: [", "while parsing"), ("nope: 1\n", "Unknown arguments from config file")],
)
def test_a_config_file_that_cannot_be_read_is_refused_in_one_line(text, named, tmp_path, capsys):
    config = tmp_path / "recipe.yaml"
    if text is not None:
        config.write_text(text)
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("peft-slim train: error: ") and named in err and "\n" not in err, err


def test_a_bad_yaml_value_is_refused_naming_the_flag(tmp_path, capsys):
    config = tmp_path / "recipe.yaml"
    config.write_text("token_ratio: 0\n")
    assert main(["train", "--config", str(config)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("peft-slim train: error: --token-ratio") and "\n" not in err, err


REFUSED = [
    (["--token-ratio", "0"], "--token-ratio"),
    (["--batch-size", "0"], "--batch-size"),
    (["--max-length", "1"], "--max-length"),
    (["--seed", "-1"], "--seed"),
    (["--learning-rate", "0"], "--learning-rate"),
    (["--method", "lora", "--token-ratio", "0.3"], "--token-ratio applies"),
    (["--prompt-ratio", "1.5"], "--prompt-ratio must be a float in [0, 1]"),
    (["--selection", "random", "--prompt-ratio", "0.3"], "--prompt-ratio applies to selection 'answer'"),
    (["--method", "tokentune", "--freeze-ratio", "0.5"], "--freeze-ratio applies"),
    (["--method", "full", "--lora-r", "8"], "--lora-r must be 0"),
    (["--method", "full", "--lora-alpha", "4"], "--lora-alpha needs LoRA"),
    (["--lora-target-modules", ","], "--lora-target-modules ',' names no module"),
    (["--max-steps", "3", "--num-epochs", "1"], "give --max-steps or --num-epochs"),
    (["--batch-size", "65536", "--max-length", "4096"], "tokens per micro-batch"),
    (["--use_peft"], "--use-peft True: not used by peft-slim train"),
    (["--lora_dropout", "0.1"], "--lora-dropout 0.1: not used"),
    (["--load_in_4bit"], "--load-in-4bit True: not used"),
    (["--method", "nope"], "argument --method: invalid choice"),
    (["--batch-size", "x"], "argument --per_device_train_batch_size/--per-device-train-batch-size/--batch-size"),
    (["--batch-size", "2.5"], "--batch-size: invalid int value: '2.5'"),
    (["--method", "lora", "--freeze-ratio", "0.5"], "--freeze-ratio applies to method 'slimfit' only"),
    (["--method", "tokentune", "--catch-up", "none"], "--catch-up applies to method 'slimfit' only"),
    (["--method", "full", "--selection", "random"], "--selection needs token selection"),
    (["--method", "slimfit", "--selection", "random"], "--selection needs token selection"),
    (["--method", "lora", "--lora-r", "0"], "--lora-r=0 with method 'lora' trains nothing"),
    (["--method", "tokentune", "--lora-r", "0", "--lora-alpha", "16"], "--lora-alpha needs LoRA"),
    (["--gguf-file", "x.gguf"], "--gguf-file needs --model"),
    (["--lora-target-modules", " , "], "--lora-target-modules ' , ' names no module"),
    (["--freeze-ratio", "1"], "--freeze-ratio must be a float in [0, 1)"),
    (["--max-length", "1000000000"], "--max-length must be an int in [2, 16777216]"),
    (["--max-length", "1e9"], "--max-length: invalid int value: '1e9'"),
    (["--batch-size", "10000000"], "--batch-size must be an int in [1, 65536]"),
    (["--lora-r", "10000000"], "--lora-r must be an int in [0, 65536]"),
    (["--max-steps", "1000000000000"], "--max-steps must be an int in [1, 1000000000]"),
    (["--gradient-accumulation-steps", "-1"], "--gradient-accumulation-steps must be an int in [1, 1000000000]"),
    (["--seed", str(2**40)], "--seed must be an int in [0, 4294967295]"),
    (["--num-epochs", "inf"], "--num-epochs must be a float in (0, 1e+06], got inf"),
    (["--num-epochs", "1e30"], "--num-epochs must be a float in (0, 1e+06], got 1e+30"),
    (["--learning-rate", "inf"], "--learning-rate must be a finite float > 0, got inf"),
    (["--lora-alpha", "nan"], "--lora-alpha must be a finite float > 0 or None, got nan"),
]


@pytest.mark.parametrize(("argv", "named"), REFUSED, ids=[" ".join(a) for a, _ in REFUSED])
def test_a_bad_value_is_refused_in_one_line_the_reason_first(argv, named, capsys):
    assert main(["train", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("peft-slim train: error: "), err
    assert named in err.splitlines()[0] and "usage:" not in err, err
    assert len(err.splitlines()) == 1, err


def test_help_lists_both_groups_and_shows_each_default_once(capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--help"])
    assert exit_.value.code == 0
    text = capsys.readouterr().out
    for group in ("method (peft-slim)", "training (TRL's SFTConfig)", "model (TRL's ModelConfig", "data (TRL's"):
        assert group in text
    assert "(default: None)" not in text
    entries = " ".join(text.split()).split(" --")
    twice = [entry for entry in entries if entry.lower().count("default") > 1 and "(default: " in entry]
    assert not twice, twice
    assert [flag for flag in HELP_FLAGS.split() if flag not in text] == []


HELP_FLAGS = """--model --gguf-file --dataset --method --token-ratio --prompt-ratio --selection --freeze-ratio
--catch-up --lora-r --lora-alpha --lora-target-modules --compression-bits --gradient-checkpointing
--max-length --max-steps --num-epochs --batch-size --gradient-accumulation-steps --learning-rate
--bf16 --seed --output --config"""
