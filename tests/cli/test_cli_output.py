"""``peft-slim train``'s console output holds the progress bar and the results, nothing that looks like a fault.

Runs the command in a fresh process (so that imports print what a user's first run prints) on a tiny random Llama
saved like a hub model, with a base-model folder without ``config.json`` beside it for PEFT's save warning.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.tiny_chat import save_tiny_chat_llama

# Messages that appeared in a first run and are not faults: each must be gone.
NOISE = (
    "Failed to load CPU gemm_4bit_forward",  # bitsandbytes' optional-kernel probe at peft's import
    "is_gradient_checkpointing",  # PEFT calling transformers' deprecated property
    "profiler_start",  # torch's profiler (the CPU peak-memory measurement), written by C++ to stderr
    "profiler_stop",
    "CPUAllocator.cpp",
    "Could not find a config file",  # PEFT's save of a LoRA whose base folder has no config.json
)
# No line may look like a warning or a crash; none is whitelisted today.
FAULT_LINE = re.compile(r"warn|traceback|error", re.IGNORECASE)
WHITELIST: tuple[re.Pattern, ...] = ()


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return save_tiny_chat_llama(tmp_path_factory.mktemp("tiny-llama"))


def test_first_run_prints_no_fault_like_lines(tiny_model, tmp_path):
    """The default method (TokenTune + LoRA; its plain-LoRA baseline goes through the LoRA path too)."""
    data = tmp_path / "qa.jsonl"
    row = {"messages": [{"role": "user", "content": "Capital of France?"}, {"role": "assistant", "content": "Paris."}]}
    data.write_text((json.dumps(row) + "\n") * 4)
    # The base folder without config.json: what the GGUF default looks like to PEFT's save.
    (tmp_path / "model").mkdir()
    for file in tiny_model.iterdir():
        if file.name != "config.json":
            (tmp_path / "model" / file.name).write_bytes(file.read_bytes())
    # Its config comes from elsewhere (the GGUF file's metadata): here, from the tiny model's folder. The command
    # reads it once and hands it to the model's loading.
    script = (
        "import sys, transformers\n"
        "from transformers import AutoConfig\n"
        f"config = AutoConfig.from_pretrained({str(tiny_model)!r})\n"
        "orig = transformers.AutoConfig.from_pretrained\n"
        "transformers.AutoConfig.from_pretrained = "
        f"lambda path, *a, **kw: config if str(path) == {str(tmp_path / 'model')!r} else orig(path, *a, **kw)\n"
        "from peft_slim.cli import main\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            script,
            "train",
            "--model",
            str(tmp_path / "model"),
            "--dataset",
            str(data),
            "--method",
            "tokentune",
            "--max-steps",
            "2",
            "--batch-size",
            "2",
            "--output",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    output = done.stdout + done.stderr
    assert "peak memory of one training step" in output and "MiB" in output
    for message in NOISE:
        assert message not in output, f"{message!r} printed:\n{output}"
    lines = re.split(r"[\r\n]+", output)
    faults = [line for line in lines if FAULT_LINE.search(line) and not any(w.search(line) for w in WHITELIST)]
    assert not faults, "\n".join(faults)


def test_only_the_profilers_own_lines_are_dropped(capfd):
    """What C++ writes to descriptor 2 inside the measurement comes back, less the profiler's start/stop lines."""
    import os

    from peft_slim.quiet import native_stderr_without

    with native_stderr_without():
        os.write(2, b"USDT:2026-12-02 01:45:03 1:1 SyncActivityProfilerHandler.cpp:52] profiler_start\n")
        os.write(
            2,
            b"[W1202 01:45:03.037614454 CPUAllocator.cpp:245] Memory block of unknown size was allocated "
            b"before the profiling started, profiler results will not include the deallocation event\n",
        )
        os.write(2, b"a real error from C++\n")
        print("python's stderr", file=sys.stderr)
    err = capfd.readouterr().err
    assert "a real error from C++" in err and "python's stderr" in err
    assert "profiler_start" not in err and "CPUAllocator" not in err
