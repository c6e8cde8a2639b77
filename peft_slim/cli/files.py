"""The command line's own files (the tokenizer beside the adapter), saved crash-consistently as one set.

A save writes every file into a staging folder inside the target (``.peft_slim-stage-*``, same file system),
then commits by writing the list of its files there atomically, then moves each into place with ``os.replace``.
Killed before the commit, the folder keeps its old files and the staging folder is deleted by the next save or
``recover``; killed after it, the next save or ``recover`` finishes the moves. Each file is at every moment
wholly old or wholly new; after ``recover`` the set is wholly old or wholly new. (The adapter itself is saved by
``PeftModel.save_pretrained``, peft_slim's own atomic save.)
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import tempfile
from collections.abc import Callable
from pathlib import Path

from ..configuration import atomic_write_text

STAGE_PREFIX = ".peft_slim-stage-"
COMMITTED = ".committed"  # in a staging folder: the JSON list of its files, written last (the commit point)
CRASH_ENV = "PEFT_SLIM_CRASH_AT"  # tests: a stage name at which the process kills itself (SIGKILL)


def crash_point(stage: str) -> None:
    """Die here, as a power cut would, when the environment names this stage (crash-consistency tests only)."""
    if os.environ.get(CRASH_ENV) == stage:
        os.kill(os.getpid(), signal.SIGKILL)


def _fsync(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def save_files(folder: str | os.PathLike, write: Callable[[Path], None]) -> None:
    """Run ``write(staging_folder)`` and move the files it wrote into ``folder`` as one crash-consistent set."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    recover(folder)
    stage = Path(tempfile.mkdtemp(dir=folder, prefix=STAGE_PREFIX))
    try:
        write(stage)
        names = sorted(entry.name for entry in stage.iterdir())
        for name in names:
            if (stage / name).is_dir():
                raise ValueError(f"{folder}: {name!r} is a folder; only flat sets of files are saved this way.")
            _fsync(stage / name)
        crash_point("staged")
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    atomic_write_text(str(stage / COMMITTED), json.dumps(names))
    crash_point("committed")
    _finish(folder, stage)


def _finish(folder: Path, stage: Path) -> None:
    """Move a committed staging folder's files into place (again, after a crash: moved ones are skipped)."""
    names = json.loads((stage / COMMITTED).read_text())
    for index, name in enumerate(names):
        if (stage / name).exists():
            os.replace(stage / name, folder / name)
        if index == 0:
            crash_point("moving")
    _fsync(folder)
    crash_point("moved")
    shutil.rmtree(stage)


def recover(folder: str | os.PathLike) -> None:
    """Finish the committed saves a killed process left in ``folder`` and delete the uncommitted ones."""
    folder = Path(folder)
    if not folder.is_dir():
        return
    for stage in sorted(folder.glob(STAGE_PREFIX + "*")):
        if (stage / COMMITTED).is_file():
            _finish(folder, stage)
        else:
            shutil.rmtree(stage, ignore_errors=True)


def save_tokenizer(tokenizer, folder: str | os.PathLike) -> None:
    """``tokenizer.save_pretrained(folder)``, crash-consistent (see the module docstring)."""
    save_files(folder, lambda stage: tokenizer.save_pretrained(stage))
