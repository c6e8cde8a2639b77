"""What a LoRA-stacked run leaves behind is a standard LoRA adapter, and `import peft_slim` replaces nothing of PEFT.

* In a process that never imports peft_slim, vanilla PEFT loads what `save_pretrained` (also with `plain_lora=True`)
  and `push_to_hub` write for TokenTune + LoRA, SlimFit + LoRA and the full stack (SlimFit + token selection + LoRA
  + compression), and a Trainer checkpoint, without a warning, to the trained model's eval logits. (`peft-slim train`:
  tests/cli/test_cli_train.py; resuming from such checkpoints: tests/tokentune/test_tokentune_resume.py.)
* The method and its settings come back from `peft_slim_config.json`.
* Every attribute of PEFT's model and config classes is the same object before and after `import peft_slim`.
* `peft_slim.save_pretrained` under a real SIGKILL at each stage of its folder swap: the folder loads as the old or
  the new adapter, keeps its other files, folders and links, and the next save leaves no leftovers.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

import huggingface_hub
import pytest
import torch
from helpers.adapter_cases import METHODS, eval_logits, method_config, vanilla_loads
from helpers.killed import killed_runs
from helpers.tiny_models import build, make_batch
from helpers.trainer_cases import selection_trainer, tokentune_llama
from peft import PeftModel, get_peft_model
from tokenizers import Tokenizer, pre_tokenizers, trainers
from tokenizers import models as tokenizer_models
from transformers import PreTrainedTokenizerFast

import peft_slim
from peft_slim import TokenTuneCallback, TokenTuneConfig

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/, where the helpers package is


def _train(model, steps: int = 3, seed: int = 0):
    model.train()
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    if hasattr(model.base_model, "slimfit_attach"):
        model.base_model.slimfit_attach(optimizer)
    for step in range(steps):
        model(**make_batch("llama", seed=seed + step)).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        if hasattr(model.base_model, "slimfit_step"):
            model.base_model.slimfit_step()
    return model


def _trained(name: str, steps: int = 3):
    return _train(get_peft_model(build("llama"), method_config(name)), steps)


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each method trained, written by save_pretrained, and loaded by vanilla PEFT in one fresh process."""
    root = tmp_path_factory.mktemp("lora_artifacts")
    models = {name: _trained(name) for name in METHODS}
    for name, model in models.items():
        model.save_pretrained(root / name)
        peft_slim.save_pretrained(model, root / f"{name}_plain", plain_lora=True)
    folders = {f"{name}{kind}": str(root / f"{name}{kind}") for name in METHODS for kind in ("", "_plain")}
    return {"root": root, "models": models, "folders": folders, "vanilla": vanilla_loads(folders, root)}


def _assert_vanilla_load(report: dict, folder: str, model) -> None:
    assert report == {"config": "LoraConfig", "tuner": "LoraModel", "warnings": []}
    expected = eval_logits(model)
    assert not torch.equal(expected, eval_logits(build("llama")))  # training changed the outputs
    assert torch.equal(torch.load(folder + ".vanilla.pt"), expected)
    with open(os.path.join(folder, "adapter_config.json")) as handle:
        assert json.load(handle)["peft_type"] == "LORA"


@pytest.mark.parametrize("kind", ["", "_plain"], ids=["save_pretrained", "plain_lora"])
@pytest.mark.parametrize("name", METHODS)
def test_vanilla_peft_loads_what_save_pretrained_wrote_without_peft_slim_or_a_warning(saved, name, kind):
    assert saved["vanilla"]["imported"] is False
    _assert_vanilla_load(saved["vanilla"][name + kind], saved["folders"][name + kind], saved["models"][name])


def test_vanilla_peft_loads_what_push_to_hub_uploaded_without_peft_slim_or_a_warning(saved, offline_hub, tmp_path):
    folders = {}
    for name, model in saved["models"].items():
        offline_hub["uploaded"].clear()
        model.push_to_hub(f"someone/{name}", private=True, tags=["mine"], commit_message=f"first {name}")
        assert offline_hub["create_repo"][-1][0] == f"someone/{name}"
        assert offline_hub["create_commit"][-1][1]["commit_message"] == f"first {name}"
        card = huggingface_hub.ModelCard(offline_hub["uploaded"]["README.md"].decode())
        assert "mine" in card.data.tags
        folder = folders[name] = str(tmp_path / name)
        os.mkdir(folder)
        for path, data in offline_hub["uploaded"].items():  # the repository's files, as a download gives them
            with open(os.path.join(folder, path), "wb") as handle:
                handle.write(data)
        assert {"adapter_config.json", "adapter_model.safetensors", "peft_slim_config.json"} <= set(os.listdir(folder))
        saved_folder = saved["folders"][name]  # the files save_pretrained wrote for the same model
        assert set(os.listdir(folder)) == set(os.listdir(saved_folder))
        with open(os.path.join(saved_folder, "adapter_model.safetensors"), "rb") as handle:
            assert offline_hub["uploaded"]["adapter_model.safetensors"] == handle.read()
    assert offline_hub["http"] == [] and len(offline_hub["create_commit"]) == len(folders)  # one commit a push
    report = vanilla_loads(folders, tmp_path)
    assert report.pop("imported") is False
    for name, folder in folders.items():
        _assert_vanilla_load(report[name], folder, saved["models"][name])
        # ...and peft_slim continues from the pushed files with the method.
        loaded = peft_slim.from_pretrained(build("llama"), folder)
        assert type(loaded.base_model) is type(saved["models"][name].base_model)
        assert type(loaded.peft_config["default"]) is type(saved["models"][name].peft_config["default"])


def test_a_trainer_checkpoint_is_a_plain_lora_adapter_with_the_record(tmp_path):
    model = tokentune_llama()
    selection_trainer(
        tmp_path / "run", model, [TokenTuneCallback()], max_steps=2, save_strategy="steps", save_steps=2
    ).train()
    checkpoint = str(tmp_path / "run" / "checkpoint-2")
    report = vanilla_loads({"checkpoint": checkpoint}, tmp_path)
    assert report["imported"] is False
    _assert_vanilla_load(report["checkpoint"], checkpoint, model)
    assert type(peft_slim.load_config(checkpoint)) is TokenTuneConfig


@pytest.mark.parametrize("name", METHODS)
def test_peft_slim_continues_with_the_method_and_its_settings(saved, name):
    model = peft_slim.from_pretrained(build("llama"), saved["folders"][name], is_trainable=True)
    trained = saved["models"][name]
    assert type(model.base_model) is type(trained.base_model)
    ours, theirs = model.peft_config["default"], trained.peft_config["default"]
    assert ours.method_dict() == theirs.method_dict()
    lora = [config.lora_export_config().to_dict() for config in (ours, theirs)]
    for values in lora:  # the base model's name: set on the way
        values.pop("base_model_name_or_path")
    assert lora[0] == lora[1]
    assert torch.equal(eval_logits(model), eval_logits(trained))
    _train(model, steps=1, seed=20)  # it trains with the method: token selection where the config has it
    if name != "slimfit_lora":
        assert model.base_model.last_token_mask is not None


# ---------------------------------------------------------------------------------------------- nothing replaced

_IDENTITY = """
import json, sys, inspect
import peft, peft.tuners.tuners_utils
from peft import LoraConfig, LoraModel, PeftConfig, PeftModel
from peft.config import PeftConfigMixin
from transformers.utils import PushToHubMixin

def classes():
    seen, todo = [], [PeftModel, LoraModel, peft.tuners.tuners_utils.BaseTuner, PeftConfig, PeftConfigMixin,
                      LoraConfig, PushToHubMixin]
    while todo:
        cls = todo.pop()
        if cls not in seen and cls.__module__.startswith(("peft", "transformers")):
            seen.append(cls)
            todo.extend(cls.__subclasses__())
    return seen

def snapshot():
    return {{(c.__module__, c.__qualname__, name): value for c in classes() for name, value in vars(c).items()}}

before = snapshot()
import peft_slim
after = snapshot()
changed = sorted(str(key) for key in before if key in after and after[key] is not before[key])
removed = sorted(str(key) for key in before if key not in after)
added = sorted(str(key) for key in after if key not in before and not key[0].startswith("peft_slim"))
print("RESULT=" + json.dumps({{"changed": changed, "removed": removed, "added": added, "count": len(before),
                               "slim": "peft_slim" in sys.modules}}))
"""


def test_import_peft_slim_leaves_every_attribute_of_peft_classes_identical():
    """PeftModel and its subclasses, LoraModel, BaseTuner, PeftConfig and LoraConfig: each attribute of each class
    (save_pretrained, push_to_hub, load_adapter, from_pretrained, ...) is the same object after the import."""
    env = {**os.environ, "PYTHONPATH": os.path.dirname(HERE)}
    done = subprocess.run(
        [sys.executable, "-c", _IDENTITY.format()], capture_output=True, text=True, env=env, timeout=300, check=False
    )
    assert done.returncode == 0, done.stderr[-4000:]
    out = json.loads(done.stdout.split("RESULT=")[-1])
    assert out["slim"] is True and out["count"] > 300
    assert out == {"changed": [], "removed": [], "added": [], "count": out["count"], "slim": True}


# ---------------------------------------------------------------------------------------------- crash consistency

# One process loads the new version once; a child forked from it per stage saves it and is killed at that stage.
_LOADED = """
import os, signal, sys
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)  # no thread pool for the forked children to inherit
import peft_slim
from peft_slim import atomic_folder
from helpers.tiny_models import build
from transformers import PreTrainedTokenizerFast

model = peft_slim.from_pretrained(build("llama"), {source!r}, is_trainable=True)
tokenizer = PreTrainedTokenizerFast.from_pretrained({source!r})
"""
_KILLED_SAVE = """
if {no_exchange!r}:
    atomic_folder._exchange = lambda first, second: False  # the two-rename path (no renameat2)
def reached(stage):
    if stage == {stage!r}:
        os.kill(os.getpid(), signal.SIGKILL)
atomic_folder.reached = reached
peft_slim.save_pretrained(model, {target!r}, tokenizer=tokenizer)
print("NOT KILLED")
"""

STAGES = [("staged", False), ("complete", False), ("exchanged", False), ("aside", True), ("swapped", True)]


def _leftovers(folder) -> list[str]:
    parent, name = os.path.split(os.path.abspath(folder))
    return sorted(entry for entry in os.listdir(parent) if entry.startswith(f".{name}.peft_slim-"))


def _tokenizer(words: list[str], template: str | None, folder) -> PreTrainedTokenizerFast:
    """A small BPE tokenizer, as loaded from a folder (what a saved-and-reloaded tokenizer writes is then stable)."""
    tokenizer = Tokenizer(tokenizer_models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(words * 3, trainers.BpeTrainer(vocab_size=60, special_tokens=["<|end|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>", chat_template=template)
    fast.save_pretrained(folder)
    return PreTrainedTokenizerFast.from_pretrained(folder)


def _tokenizer_files(folder) -> dict[str, bytes]:
    names = sorted(name for name in os.listdir(folder) if name.startswith(("tok", "chat")))
    return {name: (folder / name).read_bytes() for name in names}


@pytest.fixture(scope="module")
def versions(tmp_path_factory):
    """Two versions of one TokenTune + LoRA adapter (the second trained further) saved with two different tokenizers,
    their eval logits and tokenizer files."""
    root = tmp_path_factory.mktemp("versions")
    model = _trained("tokentune_lora", steps=1)
    old_tokenizer = _tokenizer(["alpha beta", "gamma"], "{{ messages }}", root / "t1")
    peft_slim.save_pretrained(model, root / "v1", tokenizer=old_tokenizer)
    first = eval_logits(model)
    _train(model, steps=2, seed=5)
    new_tokenizer = _tokenizer(["delta epsilon", "zeta"], "{{ messages }}!", root / "t2")
    peft_slim.save_pretrained(model, root / "v2", tokenizer=new_tokenizer)
    files = {version: _tokenizer_files(root / version) for version in ("v1", "v2")}
    assert files["v1"].keys() == files["v2"].keys() and files["v1"] != files["v2"]
    return {"root": root, "v1": first, "v2": eval_logits(model), "files": files}


@pytest.fixture(scope="module")
def killed(versions, tmp_path_factory):
    """For each stage, a copy of v1 (with other files, an empty folder and a link to a folder) over which a process
    saving v2 was killed at that stage; by stage, the folder and the process's return code."""
    root = tmp_path_factory.mktemp("killed")
    targets, scripts = {}, []
    for stage, no_exchange in STAGES:
        target = targets[stage] = root / stage / "adapter"
        shutil.copytree(versions["root"] / "v1", target)
        (target / "notes.txt").write_text("kept")
        (target / "runs" / "empty").mkdir(parents=True)
        os.symlink("runs", target / "latest-run")
        scripts.append(_KILLED_SAVE.format(stage=stage, no_exchange=no_exchange, target=str(target)))
    codes, stderr = killed_runs(_LOADED.format(tests=HERE, source=str(versions["root"] / "v2")), scripts)
    return {stage: (targets[stage], code, stderr) for (stage, _), code in zip(STAGES, codes)}


@pytest.mark.parametrize("stage, no_exchange", STAGES, ids=[stage for stage, _ in STAGES])
def test_a_save_killed_at_each_stage_leaves_the_old_or_the_new_adapter(versions, killed, stage, no_exchange):
    target, code, stderr = killed[stage]
    assert code == -9, (stage, code, stderr)

    if target.exists():  # the target path always holds a complete folder: a reader that never recovers sees it
        plain = PeftModel.from_pretrained(build("llama"), target)
        seen = [v for v in ("v1", "v2") if torch.equal(eval_logits(plain), versions[v])]
        assert seen and _tokenizer_files(target) == versions["files"][seen[0]], stage  # adapter and tokenizer agree
    else:  # only between the two renames of the fallback path
        assert (stage, no_exchange) == ("aside", True)
    # peft_slim's loaders recover first; the old folder before the swap, the new one from it on.
    expected = "v1" if stage in ("staged", "complete") else "v2"
    beside = peft_slim.from_pretrained(build("llama"), versions["root"] / "v1")
    peft_slim.load_adapter(beside, target, "reloaded")
    beside.set_adapter("reloaded")
    assert torch.equal(eval_logits(beside), versions[expected]), stage
    loaded = peft_slim.from_pretrained(build("llama"), target)
    assert torch.equal(eval_logits(loaded), versions[expected]), stage
    assert _tokenizer_files(target) == versions["files"][expected], stage
    assert (target / "notes.txt").read_text() == "kept"
    assert (target / "runs" / "empty").is_dir() and os.readlink(target / "latest-run") == "runs"

    # The next save cleans every leftover, beside the folder and inside it.
    peft_slim.save_pretrained(loaded, target)
    assert _leftovers(target) == []
    assert torch.equal(eval_logits(PeftModel.from_pretrained(build("llama"), target)), versions[expected])
    assert (target / "notes.txt").read_text() == "kept"
    assert (target / "runs" / "empty").is_dir() and os.readlink(target / "latest-run") == "runs"


def test_a_save_that_completes_replaces_the_folder_and_leaves_nothing_beside_it(versions, tmp_path):
    target = tmp_path / "adapter"
    shutil.copytree(versions["root"] / "v1", target)
    model = peft_slim.from_pretrained(build("llama"), versions["root"] / "v2")
    peft_slim.save_pretrained(model, target)
    assert _leftovers(target) == []
    assert sorted(os.listdir(target)) == sorted(os.listdir(versions["root"] / "v2"))
    assert torch.equal(eval_logits(PeftModel.from_pretrained(build("llama"), target)), versions["v2"])


def test_a_save_with_a_tokenizer_replaces_every_tokenizer_file_of_the_folder(versions, tmp_path):
    """Files an earlier tokenizer wrote do not outlive it: a chat template or a vocabulary file the new tokenizer
    does not write is gone, the adapter's and the other files stay."""
    target = tmp_path / "adapter"
    shutil.copytree(versions["root"] / "v1", target)
    (target / "vocab.txt").write_text("an older tokenizer's vocabulary")
    (target / "notes.txt").write_text("kept")
    model = peft_slim.from_pretrained(build("llama"), versions["root"] / "v2")
    peft_slim.save_pretrained(model, target, tokenizer=_tokenizer(["delta epsilon", "zeta"], None, tmp_path / "t"))
    assert not (target / "vocab.txt").exists() and not (target / "chat_template.jinja").exists()
    assert (target / "tokenizer.json").is_file() and (target / "notes.txt").read_text() == "kept"
    assert torch.equal(eval_logits(PeftModel.from_pretrained(build("llama"), target)), versions["v2"])
    assert _leftovers(target) == []
