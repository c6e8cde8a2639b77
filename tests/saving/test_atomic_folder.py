"""What `peft_slim.save_pretrained` (also with `plain_lora=True`) keeps of the folder it replaces, and what a reader
gets while it replaces it.

* Everything the save does not write stays: files, folders (nested and empty ones), symbolic links to files and to
  folders (dangling ones too); `replace_model_files=True` removes the model files of another kind of save.
* Each adapter's weights record the digest of its config files; `peft_slim.from_pretrained` and `load_adapter` read
  one save of the folder: a swap between their opens is retried, one during the load is refused
  (`FolderReplaced`), a folder that mixes two saves on disk is refused. A reader process looping over loads while
  another process saves two adapters in turn never gets one save's config with the other's weights.
(Crash consistency under SIGKILL: tests/saving/test_lora_artifacts.py.)
"""

from __future__ import annotations

import multiprocessing
import os
import time

import peft.peft_model
import pytest
import torch
from helpers.tiny_models import build
from peft import LoraConfig, PeftModel, get_peft_model

import peft_slim
from peft_slim import TokenTuneConfig, atomic_folder
from peft_slim.atomic_folder import FolderReplaced, held_files
from peft_slim.tuner import saving

ALPHAS = (8, 64)


def _model(alpha: int):
    """TokenTune + LoRA with LoRA alpha ``alpha`` and LoRA weights of their own (a seed per alpha)."""
    lora = LoraConfig(r=4, lora_alpha=alpha, target_modules=["q_proj", "v_proj"])
    model = get_peft_model(build("llama"), TokenTuneConfig(task_type="CAUSAL_LM", lora=lora, seed=0))
    generator = torch.Generator().manual_seed(alpha)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if "lora_" in name:
                parameter.copy_(torch.randn(parameter.shape, generator=generator))
    return model


def _lora_weight(model) -> torch.Tensor:
    return next(value for key, value in model.state_dict().items() if ".lora_A." in key).clone()


@pytest.fixture(scope="module")
def models():
    return {alpha: _model(alpha) for alpha in ALPHAS}


def _which(loaded, models) -> str:
    """``"8"`` or ``"64"`` when the loaded config and weights are one save's, else ``"mix"``."""
    config = loaded.peft_config["default"]
    alpha = getattr(config, "lora", None) or config
    weights = [a for a in ALPHAS if torch.equal(_lora_weight(loaded), _lora_weight(models[a]))]
    return str(alpha.lora_alpha) if weights == [alpha.lora_alpha] else "mix"


# ---------------------------------------------------------------------------------------------- what a save keeps


def _user_files(folder) -> None:
    """What a training run leaves beside an adapter: logs, TensorBoard's and wandb's folders, links, empty folders."""
    (folder / "runs" / "Dec03_15-00" / "events").mkdir(parents=True)
    (folder / "runs" / "Dec03_15-00" / "events" / "out.tfevents").write_bytes(b"\0events")
    (folder / "runs" / "Dec03_16-00").mkdir()  # empty
    (folder / "wandb" / "run-1" / "files").mkdir(parents=True)
    (folder / "wandb" / "run-1" / "files" / "output.log").write_text("log")
    os.symlink("run-1", folder / "wandb" / "latest-run")  # to a folder
    (folder / "notes.txt").write_text("kept")
    os.symlink("notes.txt", folder / "notes-link")  # to a file
    os.symlink("gone", folder / "dangling")
    (folder / "docs").mkdir()  # the card kept elsewhere, linked: a save writes a new card, not through the link
    (folder / "docs" / "card.md").write_text("# My adapter\n")
    (folder / "README.md").unlink(missing_ok=True)
    os.symlink(os.path.join("docs", "card.md"), folder / "README.md")


def _tree(folder) -> dict[str, object]:
    """Every entry under ``folder``: a link's target, a folder, or a file's bytes; the model files and card left
    out."""
    entries = {}
    for root, folders, files in os.walk(folder):
        for name in folders + files:
            path = os.path.join(root, name)
            relative = os.path.relpath(path, folder)
            if relative == "README.md":
                continue
            if os.path.islink(path):
                entries[relative] = ("link", os.readlink(path))
            elif os.path.isdir(path):
                entries[relative] = "folder"
            elif name not in saving.ADAPTER_FILES:
                with open(path, "rb") as handle:
                    entries[relative] = handle.read()
    return entries


@pytest.mark.parametrize("save", ["save_pretrained", "plain_lora"])
def test_a_save_keeps_the_folders_links_and_files_it_does_not_write(save, models, tmp_path):
    target = tmp_path / "adapter"
    peft_slim.save_pretrained(models[8], target)
    _user_files(target)
    before = _tree(target)
    assert before[os.path.join("wandb", "latest-run")] == ("link", "run-1")

    peft_slim.save_pretrained(models[64], target, plain_lora=save == "plain_lora")

    assert _tree(target) == before
    assert (target / "wandb" / "latest-run" / "files" / "output.log").read_text() == "log"
    assert not (target / "README.md").is_symlink() and "My adapter" in (target / "README.md").read_text()
    assert _which(PeftModel.from_pretrained(build("llama"), target), models) == "64"
    assert (target / "peft_slim_config.json").exists() == (save == "save_pretrained")


@pytest.mark.parametrize("save", ["save_pretrained", "plain_lora"])
def test_a_save_through_a_link_to_a_folder_replaces_the_folder_and_keeps_the_link(save, models, tmp_path):
    """The bug: the swap exchanged the link itself with the new folder, then failed to remove the link
    (`Cannot call rmtree on a symbolic link`): the save raised, the link was gone, and a link left as
    `.link.peft_slim-new` made every later save into the folder fail."""
    real, link = tmp_path / "real", tmp_path / "link"
    real.mkdir()
    (real / "notes.txt").write_text("kept")
    link.symlink_to(real, target_is_directory=True)
    for alpha in ALPHAS:
        peft_slim.save_pretrained(models[alpha], link, plain_lora=save == "plain_lora")
    assert link.is_symlink() and sorted(os.listdir(tmp_path)) == ["link", "real"]
    assert (real / "notes.txt").read_text() == "kept"
    assert _which(PeftModel.from_pretrained(build("llama"), link), models) == "64"
    if save == "plain_lora":
        return
    os.rename(real, atomic_folder.sibling(str(real), "new"))  # as a save killed between its two renames leaves it
    assert _which(peft_slim.from_pretrained(build("llama"), link), models) == "64"  # the loader puts it in place
    assert sorted(os.listdir(tmp_path)) == ["link", "real"]


def test_a_subfolder_a_killed_save_left_between_its_renames_is_put_in_place_by_the_loaders(models, tmp_path):
    """The bug: only the folder given was recovered, not the subfolder= inside it that the save had written alone:
    the load read the path as a Hub id and failed."""
    sub = tmp_path / "root" / "second"
    peft_slim.save_pretrained(models[64], sub)
    os.rename(sub, atomic_folder.sibling(str(sub), "new"))  # as a save killed between its two renames leaves it
    assert _which(peft_slim.from_pretrained(build("llama"), tmp_path / "root", subfolder="second"), models) == "64"
    assert os.listdir(tmp_path / "root") == ["second"]


def test_replace_model_files_removes_the_files_of_another_kind_of_save(models, tmp_path):
    target = tmp_path / "out"
    peft_slim.save_pretrained(models[8], target)
    (target / "notes.txt").write_text("kept")
    full = build("llama")
    peft_slim.save_pretrained(full, target)  # by default the adapter's files stay beside the full model
    assert (target / "adapter_config.json").is_file() and (target / "config.json").is_file()

    peft_slim.save_pretrained(full, target, replace_model_files=True)
    assert not any((target / name).exists() for name in saving.ADAPTER_FILES)
    assert (target / "model.safetensors").is_file() and (target / "notes.txt").read_text() == "kept"

    peft_slim.save_pretrained(models[64], target, replace_model_files=True)
    assert not (target / "model.safetensors").exists() and not (target / "config.json").exists()
    assert (target / "notes.txt").read_text() == "kept"
    assert _which(PeftModel.from_pretrained(build("llama"), target), models) == "64"
    assert saving.model_file("model-00001-of-00002.safetensors") and not saving.model_file("runs/config.json")


# ---------------------------------------------------------------------------------------------- readers during saves


def test_a_save_while_peft_slim_loads_is_refused_not_mixed(models, tmp_path, monkeypatch):
    """The other save lands between the config's read and the weights' read (where vanilla PEFT mixes them)."""
    target = tmp_path / "adapter"
    peft_slim.save_pretrained(models[8], target)
    load_weights = peft.peft_model.load_peft_weights

    def save_then_load_weights(*args, **kwargs):
        peft_slim.save_pretrained(models[64], target)
        return load_weights(*args, **kwargs)

    monkeypatch.setattr(peft.peft_model, "load_peft_weights", save_then_load_weights)
    with pytest.raises(FolderReplaced, match="was replaced by a save while it was read"):
        peft_slim.from_pretrained(build("llama"), target)
    monkeypatch.undo()
    assert _which(peft_slim.from_pretrained(build("llama"), target), models) == "64"


@pytest.mark.parametrize("loader", ["from_pretrained", "load_adapter"])
def test_a_load_a_save_swapped_under_is_read_again(models, tmp_path, monkeypatch, loader):
    """A save lands during the first load only: the loader takes that load off and reads the folder again, giving the
    new save whole; a save during every load: FolderReplaced after a bounded number of reads, the model as given."""
    first, target = tmp_path / "first", tmp_path / "adapter"
    peft_slim.save_pretrained(models[8], first)
    peft_slim.save_pretrained(models[8], target)
    load_weights = peft.peft_model.load_peft_weights
    saves = []

    def save_then_load_weights(*args, **kwargs):
        if len(saves) < limit:
            saves.append(1)
            peft_slim.save_pretrained(models[ALPHAS[len(saves) % 2]], target)  # 64, then 8, 64, ...
        return load_weights(*args, **kwargs)

    def load() -> tuple:
        """The model loaded from `target`, and the weight and alpha of what was loaded from it."""
        if loader == "from_pretrained":
            model = peft_slim.from_pretrained(base, target)
            return model, _lora_weight(model), model.peft_config["default"].lora.lora_alpha
        peft_slim.load_adapter(base, target, "other")
        weight = next(v for k, v in base.state_dict().items() if ".lora_A.other." in k).clone()
        return base, weight, base.peft_config["other"].lora.lora_alpha

    def fresh():
        return build("llama") if loader == "from_pretrained" else peft_slim.from_pretrained(build("llama"), first)

    monkeypatch.setattr(peft.peft_model, "load_peft_weights", save_then_load_weights)
    limit = 0
    base, limit = fresh(), 1
    _, weight, alpha = load()
    assert len(saves) == 1 and alpha == 64 and torch.equal(weight, _lora_weight(models[64]))

    limit, saves[:] = 0, []
    base, limit = fresh(), 100
    names = sorted(name for name, _ in base.named_parameters())
    with pytest.raises(FolderReplaced, match=f"read {saving.LOAD_ATTEMPTS} times"):
        load()
    assert len(saves) == saving.LOAD_ATTEMPTS
    assert sorted(name for name, _ in base.named_parameters()) == names  # nothing of the loads is left on the model


def test_a_swap_between_the_opens_is_retried(tmp_path, monkeypatch):
    target = tmp_path / "folder"
    for version in ("old", "new"):
        with atomic_folder.replaced_folder(str(target)) as staging:
            for name in ("a", "b"):
                with open(os.path.join(staging, name), "w") as handle:
                    handle.write(version if version == "old" else version * 2)
    opened = []

    def open_and_swap(path, mode):  # the first open of the first try sees the old folder, the second the new one
        opened.append(path)
        handle = open(path, mode)  # noqa: SIM115 (held_files closes it)
        if len(opened) == 1:
            with atomic_folder.replaced_folder(str(target), lambda relative: True) as staging:
                for name in ("a", "b"):
                    with open(os.path.join(staging, name), "w") as out:
                        out.write("third")
        return handle

    monkeypatch.setattr(atomic_folder, "open", open_and_swap, raising=False)
    with held_files(str(target), ["a", "b"]) as held:
        assert {name: handle.read() for name, handle in held.items()} == {"a": b"third", "b": b"third"}
    assert len(opened) == 4


def _save_in_turns(target: str, models, stop, saved) -> None:
    torch.set_num_threads(1)  # a forked child: no use of the parent's thread pool
    for count in range(400):  # bounded: the reader stops it long before
        if stop.is_set():
            break
        peft_slim.save_pretrained(models[ALPHAS[count % 2]], target)
        saved.value = count + 1


def test_a_reader_process_never_loads_one_saves_config_with_the_others_weights(models, tmp_path):
    """One process saves the two adapters in turn into one folder while this one loads it, a bounded number of times
    (vanilla PEFT gets a mix in about a third of such loads)."""
    target = str(tmp_path / "adapter")
    peft_slim.save_pretrained(models[8], target)
    context = multiprocessing.get_context("fork")  # the models and imports as they are, nothing to start
    stop, saved = context.Event(), context.Value("i", 0)
    saver = context.Process(target=_save_in_turns, args=(target, models, stop, saved), daemon=True)
    saver.start()
    seen: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 30
        while saved.value < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        for _ in range(25):
            if time.monotonic() > deadline:
                break
            try:
                outcome = _which(peft_slim.from_pretrained(build("llama"), target), models)
            except FolderReplaced:
                outcome = "refused"
            seen[outcome] = seen.get(outcome, 0) + 1
    finally:
        stop.set()
        saver.join(60)
    assert saver.exitcode == 0 and saved.value >= 4, (saver.exitcode, saved.value)
    assert "mix" not in seen and sum(seen.values()) >= 10, seen
    assert _which(peft_slim.from_pretrained(build("llama"), target), models) in ("8", "64")
