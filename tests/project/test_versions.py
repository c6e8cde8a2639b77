"""The import-time version check: refused below the minimum, one warning outside the tested span, silent inside."""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

from peft_slim import versions

ROOT = Path(versions.__file__).resolve().parent.parent
TOML = (ROOT / "pyproject.toml").read_text()
OLDEST = (ROOT / ".ci" / "oldest.txt").read_text()
# A later patch release of the newest tested PEFT minor (tested), and the next minor release (untested).
PEFT_OLDEST, PEFT_NEWEST = versions.TESTED["peft"]
_MAJOR, _MINOR = PEFT_NEWEST.split(".")[:2]
PEFT_LATER_PATCH, PEFT_NEXT_MINOR = f"{_MAJOR}.{_MINOR}.9", f"{_MAJOR}.{int(_MINOR) + 1}.0"


def _with(monkeypatch, **found):
    real = versions.metadata.version
    monkeypatch.setattr(versions.metadata, "version", lambda package: found.get(package) or real(package))


def _check(monkeypatch, **found) -> list[str]:
    _with(monkeypatch, **found)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        versions.check_versions()
    return [str(w.message) for w in caught]


@pytest.mark.parametrize("package, found", [("peft", "0.20.0"), ("transformers", "5.22.2"), ("torch", "2.10.0+cpu")])
def test_below_the_minimum_is_refused_naming_package_version_and_range(monkeypatch, package, found):
    _with(monkeypatch, **{package: found})
    minimum = versions.MINIMUM[package]
    with pytest.raises(
        ImportError, match=rf"needs {package} >= {re.escape(minimum)}, found {package} {re.escape(found)}"
    ):
        versions.check_versions()


def test_the_tested_span_is_silent(monkeypatch):
    oldest = {package: span[0] for package, span in versions.TESTED.items()}
    assert _check(monkeypatch, **oldest) == []
    newest = {package: span[1] for package, span in versions.TESTED.items()}
    assert _check(monkeypatch, **newest) == []
    # A later patch release of the newest tested minor, and a local build tag, are the tested release.
    assert _check(monkeypatch, peft=PEFT_LATER_PATCH, torch="2.13.0+cpu", transformers="5.24.3") == []


def test_outside_the_tested_span_warns_once_naming_every_package(monkeypatch):
    messages = _check(monkeypatch, peft=PEFT_NEXT_MINOR, transformers="5.26.0", torch="2.12.1")
    assert len(messages) == 1
    for text in (
        f"peft {PEFT_NEXT_MINOR} (tested: {PEFT_OLDEST} to {PEFT_NEWEST})",
        "transformers 5.26.0",
        "torch 2.12.1",
    ):
        assert text in messages[0]


def test_the_import_runs_the_check_first():
    """A too-old PEFT is named before any other import fails (a fresh process with a faked version)."""
    code = (
        "import importlib.metadata as m; real = m.version\n"
        "m.version = lambda name: '0.17.1' if name == 'peft' else real(name)\n"
        "import peft_slim\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "ImportError: peft_slim needs peft >= 0.21, found peft 0.17.1" in run.stderr


def test_the_declared_ranges_match_the_check_and_ci():
    """pyproject.toml's floors are MINIMUM; .ci/oldest.txt pins the oldest tested releases."""
    for package, minimum in versions.MINIMUM.items():
        assert re.search(rf'"{package}>={re.escape(minimum)}[,"]', TOML), package
    for package in ("transformers", "peft"):
        assert f"{package}=={versions.TESTED[package][0]}" in OLDEST.split()
    # PEFT's cap: below the minor release after the newest tested one (PEFT's minor releases change its private APIs).
    assert f'"peft>={versions.MINIMUM["peft"]},<{_MAJOR}.{int(_MINOR) + 1}"' in TOML
