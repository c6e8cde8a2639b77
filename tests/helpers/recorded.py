"""Files recorded from earlier code hold what it wrote under the library versions of the recording: they are
compared only under those versions (another torch, transformers or PEFT may write other bytes or round otherwise)."""

from __future__ import annotations

import importlib.metadata

import pytest

VERSIONS_KEY = "_versions"  # in a recorded JSON file: the versions it was recorded with


def versions() -> dict[str, str]:
    return {name: importlib.metadata.version(name) for name in ("torch", "transformers", "peft")}


def skip_unless_recorded_with(recorded: dict[str, str] | None) -> None:
    installed = versions()
    if recorded != installed:
        pytest.skip(f"recorded with {recorded}, installed {installed}: recorded bytes compare only under those")
