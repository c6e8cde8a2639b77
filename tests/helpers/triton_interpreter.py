"""Triton's interpreter runs the compression kernels on CPU tensors, but only when ``TRITON_INTERPRET=1`` is set
before Triton is first imported: a test file's interpreted tests run in a subprocess with it set (``run_file``)
and skip themselves otherwise (``interpreted``)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

HAS_TRITON = importlib.util.find_spec("triton") is not None
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
# The test that runs the file under the interpreter: skipped inside that subprocess, and without Triton.
runs_the_file = pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="the subprocess itself, or no Triton")


def only_interpreted(runner: str):
    """Marks a test that runs only under the interpreter, in the subprocess ``runner`` (a test's name) starts."""
    return pytest.mark.skipif(not (INTERPRETED and HAS_TRITON), reason=f"run by {runner} (TRITON_INTERPRET=1)")


def run_file(path: str) -> str:
    """Runs the test file ``path`` with ``TRITON_INTERPRET=1`` in a subprocess; asserts it passed; its output."""
    env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    command = [sys.executable, "-m", "pytest", "-q", "-x", "-n", "0", "-p", "no:cacheprovider", "-m", "not cuda"]
    command += ["-W", "ignore::RuntimeWarning", path]  # numpy's overflow warnings inside the interpreter
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert " passed" in result.stdout and "(TRITON_INTERPRET=1)" not in result.stdout, result.stdout[-2000:]
    return result.stdout
