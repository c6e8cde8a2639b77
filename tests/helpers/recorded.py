"""Files recorded from earlier code hold what it wrote under the library versions of the recording: they are
compared only under those versions (another torch, transformers or PEFT may write other bytes or round otherwise).

A file may have siblings recorded under other versions (``<stem>.<versions>.json``, written by ``record_path``):
the first recording is the earlier code's; a later one is today's code under newer releases, recorded once that
code had matched the first under its versions, so that the comparison also runs where CI installs the newest."""

from __future__ import annotations

import glob
import importlib.metadata
import json
import os

import pytest

VERSIONS_KEY = "_versions"  # in a recorded JSON file: the versions it was recorded with


def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")}


def _recordings(path: str) -> list[str]:
    stem = path.removesuffix(".json")
    return [path] + sorted(glob.glob(f"{glob.escape(stem)}.*.json"))


def _load(path: str) -> dict:
    with open(path) as handle:
        return json.load(handle)


def load_recorded(path: str) -> dict:
    """The recording of ``path`` or of a sibling made under the installed versions; the test skips if none is."""
    installed, records = versions(), [_load(candidate) for candidate in _recordings(path)]
    for record in records:
        if record.get(VERSIONS_KEY) == installed:
            return record
    seen = [record.get(VERSIONS_KEY) for record in records]
    pytest.skip(f"recorded with {seen}, installed {installed}: recorded bytes compare only under those")


def record_path(path: str) -> str:
    """Where a new recording under the installed versions goes: the file recorded under them, else ``path`` if it
    does not exist yet, else a new sibling named by the versions."""
    if not os.path.exists(path):
        return path
    installed = versions()
    for candidate in _recordings(path):
        if _load(candidate).get(VERSIONS_KEY) == installed:
            return candidate
    return f"{path.removesuffix('.json')}." + ".".join(f"{k}-{v}" for k, v in installed.items()) + ".json"
