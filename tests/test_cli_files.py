"""The command line's own files (the tokenizer beside the adapter) under a real SIGKILL at each write stage: each
file is always wholly old or wholly new, and after the next run's recovery the set is wholly old or wholly new,
with no staging or temporary file left."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers, trainers
from transformers import PreTrainedTokenizerFast

from peft_slim.cli import files

# stage -> the state the folder must be in once recovered (killed before the commit: old; after it: new)
STAGES = {"staged": "old", "committed": "new", "moving": "new", "moved": "new"}


def make_tokenizer(folder: Path, words: list[str], template: str) -> Path:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.train_from_iterator(words * 3, trainers.BpeTrainer(vocab_size=60, special_tokens=["<|end|>"]))
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|end|>", chat_template=template)
    fast.save_pretrained(folder)
    return folder


def contents(folder: Path) -> dict[str, bytes]:
    return {entry.name: entry.read_bytes() for entry in folder.iterdir() if entry.is_file()}


@pytest.fixture(scope="module")
def states(tmp_path_factory) -> dict[str, dict[str, bytes]]:
    """What the output folder holds after saving the old tokenizer, and after saving the new one over it."""
    root = tmp_path_factory.mktemp("tokenizers")
    old = make_tokenizer(root / "old-source", ["alpha beta", "gamma"], "{{ messages }}")
    new = make_tokenizer(root / "new-source", ["delta epsilon zeta", "eta theta"], "{{ messages }}!")
    out = {}
    for name, source in (("old", old), ("new", new)):
        folder = root / f"after-{name}"
        if name == "new":
            files.save_tokenizer(PreTrainedTokenizerFast.from_pretrained(old), folder)
        files.save_tokenizer(PreTrainedTokenizerFast.from_pretrained(source), folder)
        out[name] = contents(folder)
        assert not [entry for entry in os.listdir(folder) if entry.startswith(".")]  # a clean save leaves nothing
    assert out["old"].keys() == out["new"].keys() and out["old"] != out["new"]
    return {**out, "sources": {"old": old, "new": new}}


def test_a_kill_at_each_write_stage_leaves_the_old_set_or_the_new(states, tmp_path):
    script = textwrap.dedent(
        """
        import sys
        from transformers import PreTrainedTokenizerFast
        from peft_slim.cli import files
        files.save_tokenizer(PreTrainedTokenizerFast.from_pretrained(sys.argv[1]), sys.argv[2])
        print("not killed")
        """
    )
    children = {}
    for stage in STAGES:  # in parallel: each child imports transformers
        folder = tmp_path / stage
        files.save_tokenizer(PreTrainedTokenizerFast.from_pretrained(states["sources"]["old"]), folder)
        env = {**os.environ, files.CRASH_ENV: stage}
        argv = [sys.executable, "-c", script, str(states["sources"]["new"]), str(folder)]
        children[stage] = (folder, subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE))
    for stage, (folder, child) in children.items():
        stdout, stderr = child.communicate(timeout=300)
        assert child.returncode == -signal.SIGKILL, (stage, stdout, stderr)
        # Before any recovery: every tokenizer file is wholly the old one or wholly the new one.
        for name, data in contents(folder).items():
            assert data in (states["old"][name], states["new"][name]), (stage, name)
        assert any(entry.startswith(files.STAGE_PREFIX) for entry in os.listdir(folder)), stage
        files.recover(folder)  # what the next `peft-slim train` into this folder does first
        assert contents(folder) == states[STAGES[stage]], stage
        assert not [entry for entry in os.listdir(folder) if entry.startswith(".")], stage


def test_an_uncommitted_stage_is_rolled_back_and_a_committed_one_finished(tmp_path):
    (tmp_path / "a.json").write_text("old")
    uncommitted = tmp_path / (files.STAGE_PREFIX + "x")
    uncommitted.mkdir()
    (uncommitted / "a.json").write_text("half")
    files.recover(tmp_path)
    assert (tmp_path / "a.json").read_text() == "old" and not uncommitted.exists()
    files.save_files(tmp_path, lambda stage: (stage / "a.json").write_text("new"))
    assert (tmp_path / "a.json").read_text() == "new" and os.listdir(tmp_path) == ["a.json"]
