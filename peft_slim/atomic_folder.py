"""Replace a whole folder so that a reader, or a process killed at any moment, sees the old folder or the new one.

The new folder is written beside the target (``.<name>.peft_slim-tmp``), renamed ``.<name>.peft_slim-new`` once
every file is on disk, then swapped in: on Linux with one ``renameat2(RENAME_EXCHANGE)`` (the target path always
holds a complete folder), elsewhere, or where the file system refuses the exchange, with two renames (target aside
to ``.<name>.peft_slim-old``, the new folder in). :func:`recover` puts a folder a crash left behind in order; every
:func:`replaced_folder` calls it first, so leftovers never pile up. Recovery is deterministic:

* ``-tmp`` was never complete: removed;
* the target is missing and ``-new`` exists (killed between the two renames): ``-new`` becomes the target;
* the target exists beside ``-new`` (killed before the swap): the old folder stays, ``-new`` is removed;
* ``-old`` (killed before its removal): removed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import glob
import os
import shutil
import sys
from collections.abc import Callable, Iterator

# What a killed save left inside the folder: peft_slim 0.1.0's adapter staging, and the command line's tokenizer
# staging of earlier development versions (both superseded by the whole-folder swap).
LEGACY_STAGING = (".peft_slim-save-", ".peft_slim-stage-")


def reached(stage: str) -> None:
    """Called at each stage of a swap (``staged``, ``complete``, ``exchanged``, ``aside``, ``swapped``). Does
    nothing; a crash-consistency test replaces it in a child process to kill that process there."""


def sibling(directory: str, kind: str) -> str:
    parent, name = os.path.split(os.path.abspath(directory))
    return os.path.join(parent, f".{name}.peft_slim-{kind}")


def recover(directory: str) -> None:
    """Put ``directory`` in order after a crash during :func:`replaced_folder` (see the module's docstring)."""
    new, old = sibling(directory, "new"), sibling(directory, "old")
    shutil.rmtree(sibling(directory, "tmp"), ignore_errors=True)
    if not os.path.exists(directory):
        for complete in (new, old):  # -old alone: only if someone removed -new by hand
            if os.path.isdir(complete):
                os.rename(complete, directory)
                break
    shutil.rmtree(new, ignore_errors=True)
    shutil.rmtree(old, ignore_errors=True)
    for prefix in LEGACY_STAGING:
        for legacy in glob.glob(os.path.join(glob.escape(directory), prefix + "*")):
            shutil.rmtree(legacy, ignore_errors=True)


@contextlib.contextmanager
def replaced_folder(directory: str, rewritten: Callable[[str], bool] = lambda path: False) -> Iterator[str]:
    """Yield an empty staging folder holding a copy of ``directory``'s files; on success it replaces ``directory``.

    Files of ``directory`` for which ``rewritten(relative path)`` is true are not copied (the caller writes them
    anew, so a file the caller no longer writes does not survive); the others are hard-linked (copied where links
    fail), except ``README.md`` files, which are copied because writers update them in place. On an exception
    ``directory`` is left as it was.
    """
    if os.path.isfile(directory):
        raise ValueError(f"save_pretrained: {directory!r} is a file; give a directory.")
    recover(directory)
    staging, new = sibling(directory, "tmp"), sibling(directory, "new")
    os.makedirs(os.path.dirname(staging), exist_ok=True)
    os.mkdir(staging)
    try:
        if os.path.isdir(directory):
            _copy_tree(directory, staging, rewritten)
        yield staging
        _fsync_tree(staging)
        reached("staged")
        os.rename(staging, new)
        _fsync(os.path.dirname(new))
        reached("complete")
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _swap_in(new, directory)


def _swap_in(new: str, directory: str) -> None:
    old = sibling(directory, "old")
    try:
        if not os.path.exists(directory):
            os.rename(new, directory)
        elif _exchange(new, directory):
            reached("exchanged")
            shutil.rmtree(new)  # now the old folder
        else:
            os.rename(directory, old)
            reached("aside")
            os.rename(new, directory)
            reached("swapped")
            shutil.rmtree(old)
        _fsync(os.path.dirname(os.path.abspath(directory)))
    except BaseException:
        if not os.path.exists(directory) and os.path.isdir(old):
            os.rename(old, directory)  # the save failed: the old folder, as the caller expects
        shutil.rmtree(new, ignore_errors=True)
        raise


def _exchange(first: str, second: str) -> bool:
    """Swap two directory entries atomically (Linux ``renameat2``); False where that is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        renameat2 = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):  # a libc without it (glibc < 2.28, musl)
        return False
    at_fdcwd, rename_exchange = -100, 2
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    if renameat2(at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), rename_exchange) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EPERM):  # kernel or file system refuses it
        return False
    raise OSError(code, os.strerror(code), second)


def _copy_tree(source: str, target: str, rewritten: Callable[[str], bool]) -> None:
    for folder, _, files in os.walk(source):
        for file in files:
            path = os.path.join(folder, file)
            relative = os.path.relpath(path, source)
            if rewritten(relative) or any(part.startswith(LEGACY_STAGING) for part in relative.split(os.sep)):
                continue
            copy = os.path.join(target, relative)
            os.makedirs(os.path.dirname(copy), exist_ok=True)
            if file == "README.md":
                shutil.copy2(path, copy)
                continue
            try:
                os.link(path, copy)
            except OSError:
                shutil.copy2(path, copy)


def _fsync(path: str) -> None:
    with contextlib.suppress(OSError):  # not every platform can fsync a directory
        descriptor = os.open(path, os.O_RDONLY)
        try:
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def _fsync_tree(folder: str) -> None:
    for root, _, files in os.walk(folder):
        for file in files:
            _fsync(os.path.join(root, file))
        _fsync(root)
