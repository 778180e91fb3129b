"""Host paths: those requests name, and the worker's own.

A path a request names (a grant, a script) is opened without following any
symlink and then used only by its descriptor; that is ``_grant_fs``'s alone
(decision 24), and its public names are here: :func:`open_no_follow`,
:func:`read_no_follow`, :func:`check_normal`, :class:`PathRefused`. A path
must be absolute and normal (no ``.``, ``..``, empty or trailing
components): the caller makes it so, and a path that is not is refused
rather than guessed at.

:func:`remove_tree` is the one way readie removes a directory a sandbox
could have written into: it follows no symlink, crosses no mount, and no
depth of tree defeats it; given a directory descriptor it holds, it removes
by name beneath it, never by a path looked up again.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import sys
from pathlib import Path

import structlog
from readie_protocol.requests import MAX_PATH_BYTES, MAX_PATH_CHARS

from ._grant_fs import OpenedPath, PathKind, PathRefused, check_normal, open_no_follow, read_no_follow
from ._mounts import unmount_beneath

log = structlog.get_logger("readie.paths")

__all__ = [
    "MAX_PATH_BYTES",
    "MAX_PATH_CHARS",
    "OpenedPath",
    "PathKind",
    "PathRefused",
    "check_normal",
    "open_no_follow",
    "read_no_follow",
    "remove_beneath",
    "remove_tree",
]



def remove_tree(path: Path | str, *, dir_fd: int | None = None) -> bool:
    """Remove ``path`` and everything beneath it; whether it is gone. Never raises.

    With ``dir_fd``, ``path`` is one name in the directory that descriptor
    holds open: nothing above it is looked up again by path. Mounts beneath
    it are detached first, and the removal refuses to enter anything that is
    still a mount, so a grant's contents can never be deleted through a
    sandbox's directory. Iterative, with one descriptor open at a time, so no
    depth of tree defeats it; symlinks are removed, never followed.
    """
    try:
        if stat.S_ISDIR(os.lstat(path, dir_fd=dir_fd).st_mode):
            where = Path(os.readlink(f"/proc/self/fd/{dir_fd}"), path) if dir_fd is not None else Path(path)
            if not unmount_beneath(where):
                return False
        _remove(path, dir_fd)
    except FileNotFoundError:
        pass
    except OSError as exc:
        log.error("cannot remove a directory", path=str(path), error=str(exc))
        return False
    try:
        os.lstat(path, dir_fd=dir_fd)
    except OSError:
        return True  # gone (or unreachable, as os.path.lexists counts it)
    return False


def remove_beneath(dir_fd: int) -> bool:
    """Remove everything in the directory ``dir_fd`` holds open (it stays); whether all went.
    Never raises."""
    try:
        names = os.listdir(dir_fd)
    except OSError as exc:
        log.error("cannot list a directory to empty it", error=str(exc))
        return False
    gone = True
    for name in names:
        gone = remove_tree(name, dir_fd=dir_fd) and gone
    return gone


def _remove(path: Path | str, dir_fd: int | None) -> None:
    flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, dir_fd=dir_fd)
    except NotADirectoryError:
        os.unlink(path, dir_fd=dir_fd)
        return
    except OSError as exc:
        if exc.errno != errno.ELOOP:
            raise
        os.unlink(path, dir_fd=dir_fd)  # a symlink: removed, not followed
        return
    device = os.fstat(fd).st_dev
    parents: list[tuple[int, int, str]] = []  # (device, inode) of each open parent, and the child's name
    try:
        while True:
            child = _first_subdirectory_emptying(fd, device)
            if child is not None:
                info = os.fstat(fd)
                parents.append((info.st_dev, info.st_ino, child))
                next_fd = os.open(child, flags, dir_fd=fd)
                os.close(fd)
                fd = next_fd
                continue
            if not parents:
                break
            # Up one level by "..", checked to be the directory we came down from.
            device_up, inode_up, name = parents.pop()
            parent_fd = os.open("..", flags, dir_fd=fd)
            os.close(fd)
            fd = parent_fd
            info = os.fstat(fd)
            if (info.st_dev, info.st_ino) != (device_up, inode_up):
                raise OSError(errno.ESTALE, "a directory moved while it was being removed", str(path))
            os.rmdir(name, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(path, dir_fd=dir_fd)


def _first_subdirectory_emptying(fd: int, device: int) -> str | None:
    """Unlink everything in ``fd`` but directories; the first directory's name, or None when empty."""
    for name in os.listdir(fd):
        info = os.lstat(name, dir_fd=fd)
        if stat.S_ISDIR(info.st_mode):
            if info.st_dev != device:
                raise OSError(errno.EXDEV, "refusing to remove across a mount", name)
            return name
        os.unlink(name, dir_fd=fd)
    return None




def canonical_dirs(*paths: Path | str) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(os.path.realpath(path)) for path in paths))


def code_dirs(runsc_binary: str) -> list[str]:
    """What this process runs as root: its Python, every directory it imports from, runsc.

    A job that could write any of them would run its code as the worker next time.
    """
    places = [sys.prefix, sys.base_prefix, *(entry for entry in sys.path if entry and os.path.isdir(entry))]
    binary = shutil.which(runsc_binary)
    return [*places, *([binary] if binary else [])]

