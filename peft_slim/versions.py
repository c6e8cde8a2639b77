"""The torch, transformers and PEFT versions peft_slim supports, checked once at import: refused below ``MINIMUM``
(an API it needs is missing), one warning outside ``TESTED`` (its private APIs, ``compat.py``, may have changed).
Keep these numbers, pyproject.toml and ``.ci/oldest.txt`` in step.
"""

from __future__ import annotations

import warnings
from importlib import metadata

from packaging.version import Version

# Refused below: PEFT 0.21 added the tuner hooks a stacked LoRA saves and loads through (``_get_adapter_state_dict``,
# ``_remap_adapter_state_dict_for_load``); transformers 5.23 checkpoints a layer's ``forward``, not its ``__call__``,
# so TokenTune's block hooks stay outside the checkpoint; torch 2.11 is the oldest run (the GPU reference setup; CI's
# registry has no CPU build of it).
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
