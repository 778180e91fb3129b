"""Host paths named by requests, opened so that no symlink can redirect them.

A request names paths; between the check of a path and its use, anything
that can write beneath it (a job with a write grant, for one) can replace a
directory with a symlink. So readie never follows a symlink in a path a
request named: :func:`open_no_follow` opens it with ``openat2`` and
``RESOLVE_NO_SYMLINKS`` (a symlink anywhere along it is refused by the
kernel, atomically with the walk), and everything after works on that
descriptor, never on the path again. A path with no symlink in it names what
it says lexically, so a check that it lies beneath a ceiling directory holds
for what was opened.

A path must be absolute and normal (no ``.``, ``..``, empty or trailing
components): the caller makes it so, and a path that is not is refused
rather than guessed at.

:func:`remove_tree` is the one way readie removes a directory a sandbox
could have written into: it follows no symlink, crosses no mount, and no
depth of tree defeats it; given a directory descriptor it holds, it removes
by name beneath it, never by a path looked up again.
"""

from __future__ import annotations

import ctypes
import errno
import os
import shutil
import stat
import sys
from dataclasses import dataclass
from enum import Enum
from pathlib import Path

import structlog
from readie_protocol.requests import MAX_PATH_BYTES, MAX_PATH_CHARS

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

# <linux/openat2.h>
_SYS_OPENAT2 = 437  # x86_64 and aarch64 alike
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_AT_FDCWD = -100

_libc = ctypes.CDLL(None, use_errno=True)
_libc.syscall.restype = ctypes.c_long


class _OpenHow(ctypes.Structure):
    _fields_ = [("flags", ctypes.c_uint64), ("mode", ctypes.c_uint64), ("resolve", ctypes.c_uint64)]


class PathRefused(Exception):
    """A path cannot be used as asked; ``reason`` (to follow the path as the caller quotes it)
    says why without naming anything the path leads to."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


class PathKind(Enum):
    DIRECTORY = "directory"
    FILE = "file"


@dataclass(frozen=True, slots=True)
class OpenedPath:
    """A path opened without following symlinks; ``fd`` is the caller's to close."""

    path: str
    fd: int
    kind: PathKind


def check_normal(path: str) -> None:
    """Refuse a path that is not absolute and normal, or that cannot be a path at all."""
    if "\0" in path:
        raise PathRefused("contains a NUL byte")
    if len(os.fsencode(path)) > MAX_PATH_BYTES:
        raise PathRefused(f"is longer than {MAX_PATH_BYTES} bytes")
    if not path.startswith("/"):
        raise PathRefused("is not an absolute path")
    if path != "/" and (path.endswith("/") or os.path.normpath(path) != path):
        raise PathRefused("is not a normal path (no '.', '..', repeated or trailing '/')")


def open_no_follow(path: str) -> OpenedPath:
    """Open ``path`` (absolute, normal) as an ``O_PATH`` descriptor if it is a directory or a
    regular file and no component of it, the last included, is a symlink.

    ``O_PATH`` opens nothing for reading, so naming a device or a FIFO has no
    side effect before it is refused.
    """
    check_normal(path)
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(
        _SYS_OPENAT2, ctypes.c_int(_AT_FDCWD), os.fsencode(path), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))
    )
    if fd < 0:
        raise PathRefused(_reason(ctypes.get_errno()))
    try:
        mode = os.fstat(fd).st_mode
    except OSError as exc:
        os.close(fd)
        raise PathRefused(_reason(exc.errno or errno.EIO)) from None
    if stat.S_ISDIR(mode):
        return OpenedPath(path, fd, PathKind.DIRECTORY)
    if stat.S_ISREG(mode):
        return OpenedPath(path, fd, PathKind.FILE)
    os.close(fd)
    raise PathRefused("is neither a directory nor a regular file")


def read_no_follow(path: str, limit: int) -> bytes:
    """The contents of the regular file at ``path`` (opened as :func:`open_no_follow` does),
    read from that descriptor; PathRefused past ``limit`` bytes."""
    opened = open_no_follow(path)
    try:
        if opened.kind is not PathKind.FILE:
            raise PathRefused("is not a regular file")
        # Reopened through the descriptor, so it is the same file, never the path again.
        fd = os.open(f"/proc/self/fd/{opened.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise PathRefused(_reason(exc.errno or errno.EIO)) from None
    finally:
        os.close(opened.fd)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise PathRefused(f"has {size} bytes, more than the {limit} allowed")
        chunks, total = [], 0
        while chunk := os.read(fd, 1024 * 1024):
            chunks.append(chunk)
            total += len(chunk)
            if total > limit:  # grew while it was read
                raise PathRefused(f"has more than the {limit} bytes allowed")
        return b"".join(chunks)
    except OSError as exc:
        raise PathRefused(_reason(exc.errno or errno.EIO)) from None
    finally:
        os.close(fd)


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


def _reason(code: int) -> str:
    if code == errno.ELOOP:
        return "passes through a symbolic link, which readie never follows in a granted path"
    if code == errno.ENOENT:
        return "does not exist"
    if code == errno.ENOTDIR:
        return "has a component that is not a directory"
    if code == errno.ENOSYS:
        return "cannot be opened safely: this kernel has no openat2 (Linux 5.6 or newer is needed)"
    return f"cannot be opened: {os.strerror(code)}"


def canonical_dirs(*paths: Path | str) -> tuple[Path, ...]:
    return tuple(dict.fromkeys(Path(os.path.realpath(path)) for path in paths))


def code_dirs(runsc_binary: str) -> list[str]:
    """What this process runs as root: its Python, every directory it imports from, runsc.

    A job that could write any of them would run its code as the worker next time.
    """
    places = [sys.prefix, sys.base_prefix, *(entry for entry in sys.path if entry and os.path.isdir(entry))]
    binary = shutil.which(runsc_binary)
    return [*places, *([binary] if binary else [])]

