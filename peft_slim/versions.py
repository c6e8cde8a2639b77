"""The versions of torch, transformers and PEFT that peft_slim supports, checked once at import.

peft_slim relies on private APIs of all three (``peft_slim.compat``), so a version outside what CI tests may
change behaviour without an error. Below ``MINIMUM`` an API peft_slim needs does not exist: the import is refused.
Between ``MINIMUM`` and the newest tested release (``TESTED``, what CI's oldest and newest runs install) nothing is
said; outside the tested span but allowed by pyproject.toml (a newer minor release, an older torch), one warning.
Keep these numbers, pyproject.toml and ``.ci/oldest.txt`` in step.
"""

from __future__ import annotations

import warnings
from importlib import metadata

from packaging.version import Version

# Refused below: PEFT 0.21 added the tuner hooks through which a stacked LoRA saves and loads
# (``BaseTuner._get_adapter_state_dict`` / ``_remap_adapter_state_dict_for_load``). transformers 5.23 checkpoints a
# layer's ``forward`` instead of its ``__call__``, so TokenTune's block hooks stay outside the checkpoint (before it,
# a gradient-checkpointing replay saves other tensors than the forward and torch refuses it); older releases also
# pass ``cache_position`` to decoder layers (before 5.4), which TokenTune refuses. torch 2.11 is the oldest run (the
# GPU reference setup); the registry has no CPU build of it for CI, which tests 2.13.
MINIMUM = {"torch": "2.11", "transformers": "5.23", "peft": "0.21"}
# The oldest and newest releases CI runs the suite on (torch: 2.13.0, the CPU build README installs, and the newest
# release on PyPI, a CUDA build run on the CPU).
TESTED = {"torch": ("2.13.0", "2.15.0"), "transformers": ("5.23.0", "5.25.0"), "peft": ("0.21.0", "0.22.0")}


def check_versions() -> None:
    """ImportError for a package older than ``MINIMUM``; one UserWarning naming every package outside ``TESTED``."""
    untested = []
    for package, minimum in MINIMUM.items():
        found = metadata.version(package)
        oldest, newest = TESTED[package]
        release = Version(found).release  # major, minor, patch: no local build tag (+cpu) or pre-release part
        if release < Version(minimum).release:
            raise ImportError(
                f"peft_slim needs {package} >= {minimum}, found {package} {found}. Install a supported version: "
                f"{package}>={minimum} (tested: {oldest} to {newest})."
            )
        # Newer patch releases of the newest tested minor are fine; a newer minor is untested.
        if release < Version(oldest).release or release[:2] > Version(newest).release[:2]:
            untested.append(f"{package} {found} (tested: {oldest} to {newest})")
    if untested:
        warnings.warn(
            "peft_slim has not been tested with "
            + ", ".join(untested)
            + ". It relies on private APIs of these packages (peft_slim/compat.py); if something fails, try a tested "
            "version and report the versions with the error.",
            UserWarning,
            stacklevel=2,
        )


check_versions()
