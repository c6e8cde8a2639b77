"""Third-party messages that are not faults, each silenced by its exact text only around the call that prints it."""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import re
import sys
import tempfile
import warnings
from collections.abc import Iterator

# bitsandbytes probes for an optional faster CPU 4-bit kernel (the `kernels` package) when it is imported, which
# peft does on its own import; without it bitsandbytes falls back to its built-in kernel, so nothing is wrong.
BNB_CPU_PROBE_LOGGER = "bitsandbytes.backends.cpu.ops"
BNB_CPU_PROBE_MESSAGE = "Failed to load CPU gemm_4bit_forward from kernels-community"

# What torch's profiler writes to the process's stderr (C++) when it starts and stops; its allocator's note on a block
# allocated before profiling (the measurement counts from the first sample); a CUDA build's failed GPU probe (code 35:
# no driver; it records the CPU).
PROFILER_LINES = (
    re.compile(r"^USDT:.*SyncActivityProfilerHandler\.cpp:\d+\] profiler_(start|stop)\s*$"),
    re.compile(r"^\[W\S* \S+ CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling"),
    re.compile(r"^ERROR:.*DeviceProperties\.cpp:\d+\] gpuGetDeviceCount failed with code 35\s*$"),
)


@contextlib.contextmanager
def native_stderr_without(patterns: tuple[re.Pattern, ...] = PROFILER_LINES) -> Iterator[None]:
    """Run the block with file descriptor 2 (where C++ writes) sent to a temporary file, then write back every line
    that matches none of ``patterns``."""
    try:
        sys.stderr.flush()
        saved = os.dup(2)
    except (OSError, ValueError):  # no real descriptor 2 (embedded interpreters): leave the output alone
        yield
        return
    with tempfile.TemporaryFile(mode="w+b") as capture:
        os.dup2(capture.fileno(), 2)
        try:
            yield
        finally:
            with contextlib.suppress(Exception):
                sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            capture.seek(0)
            text = capture.read().decode(errors="replace")
            kept = [line for line in text.splitlines(keepends=True) if not any(p.search(line) for p in patterns)]
            if kept:
                sys.stderr.write("".join(kept))
                sys.stderr.flush()


@contextlib.contextmanager
def warning_silenced(category: type[Warning], message: str) -> Iterator[None]:
    """Ignore warnings of ``category`` whose text starts with ``message`` (a literal) inside the block."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=re.escape(message), category=category)
        yield


# peft imports bitsandbytes at its import (0.21) or first LoRA injection; this module, imported first, imports both
# with the probe's warning dropped (bitsandbytes probes once, at its import).
def _not_the_probe(record: logging.LogRecord) -> bool:
    return not str(record.msg).startswith(BNB_CPU_PROBE_MESSAGE)


logging.getLogger(BNB_CPU_PROBE_LOGGER).addFilter(_not_the_probe)
try:
    import peft  # noqa: F401, E402

    if importlib.util.find_spec("bitsandbytes") is not None:
        import bitsandbytes  # noqa: F401
finally:
    logging.getLogger(BNB_CPU_PROBE_LOGGER).removeFilter(_not_the_probe)
