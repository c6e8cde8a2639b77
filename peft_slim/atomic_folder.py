"""Replace a whole folder so that a process killed at any moment leaves the old folder or the new one.

The new folder is written beside the target (``.<name>.peft_slim-tmp``), renamed ``-new`` once on disk, then swapped
in: on Linux by one ``renameat2(RENAME_EXCHANGE)``, elsewhere by two renames (the target aside to ``-old``, the new
one in). :func:`recover` (run first by every :func:`replaced_folder`) removes ``-tmp``, ``-old`` and a ``-new`` beside
the target, and makes a ``-new`` without the target the target. :func:`held_files` opens several files as one version.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import shutil
import stat
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from typing import BinaryIO


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


@contextlib.contextmanager
def replaced_folder(directory: str, rewritten: Callable[[str], bool] = lambda path: False) -> Iterator[str]:
    """Yield a staging folder holding a copy of ``directory`` but what ``rewritten(relative path)`` names; on success
    it replaces ``directory`` (through a link, the folder it leads to), on an exception it stays as it was."""
    if os.path.isfile(directory):
        raise ValueError(f"save_pretrained: {directory!r} is a file; give a directory.")
    directory = os.path.realpath(directory)  # a link to a folder stays: the folder it leads to is replaced
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


class FolderReplaced(RuntimeError):
    """A folder was replaced by a save while it was read."""


@contextlib.contextmanager
def held_files(directory: str, names: Iterable[str]) -> Iterator[dict[str, BinaryIO]]:
    """Open the files ``names`` of ``directory`` (those that exist) as one version and yield them; on exit
    :class:`FolderReplaced` if a swap came while the caller read them (a save writes files anew: new inodes)."""
    paths = {name: os.path.join(directory, name) for name in names}
    for attempt in range(20):
        with contextlib.ExitStack() as opened:
            held = {}
            for name, path in paths.items():
                with contextlib.suppress(FileNotFoundError):
                    held[name] = opened.enter_context(open(path, "rb"))
            if _unchanged(paths, held):
                opened = opened.pop_all()  # kept open past this block, closed below
                break
        time.sleep(0.005 * (attempt + 1))
    else:
        raise FolderReplaced(f"{directory}: replaced again and again by saves; could not read one version of it.")
    replaced = f"{directory} was replaced by a save while it was read."
    with opened:
        try:
            yield held
        except BaseException as error:
            if not _unchanged(paths, held):
                raise FolderReplaced(replaced) from error
            raise
        if not _unchanged(paths, held):
            raise FolderReplaced(replaced)


def _unchanged(paths: dict[str, str], held: dict[str, BinaryIO]) -> bool:
    """Whether every path still leads to its held file (and the ones that did not exist still do not)."""

    def identity(status: os.stat_result) -> tuple:
        return status.st_dev, status.st_ino, status.st_size, status.st_mtime_ns

    for name, path in paths.items():
        try:
            now = identity(os.stat(path))
        except FileNotFoundError:
            now = None
        if now != (identity(os.fstat(held[name].fileno())) if name in held else None):
            return False
    return True


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
    """Everything of ``source`` into ``target`` but what ``rewritten`` names: folders (empty ones too), symbolic links
    as links, files as hard links (copies where links fail; ``README.md`` copied: writers update it in place)."""
    for folder, folders, files in os.walk(source):  # lists a link to a folder with the folders, does not enter it
        for name in folders + files:
            path = os.path.join(folder, name)
            relative = os.path.relpath(path, source)
            copy = os.path.join(target, relative)
            if name in folders and not os.path.islink(path):
                os.mkdir(copy, stat.S_IMODE(os.stat(path).st_mode) | stat.S_IRWXU)  # writable by the save
            elif rewritten(relative):
                continue
            elif name == "README.md":  # a copy (of a link's target too): writers update the card in place
                if os.path.isfile(path):
                    shutil.copy2(path, copy)
            elif os.path.islink(path):
                os.symlink(os.readlink(path), copy)
            else:
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
            path = os.path.join(root, file)
            if stat.S_ISREG(os.lstat(path).st_mode):  # not a link's target, nor a pipe (opening it would block)
                _fsync(path)
        _fsync(root)
