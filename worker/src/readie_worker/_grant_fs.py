"""The worker's one way into host paths under a grant: opened once without following a link, then
used only by descriptor (decision 24).

Anything that can write beneath a grant (a job with a write grant, another
job of the same pool at the same moment) can rename a directory away and put
a symlink in its place whenever it likes. So the worker never reaches a path
under a grant by its string twice: this module opens it once and everything
after works on the descriptor (``dir_fd=``, ``os.scandir(fd)``), never on a
path rebuilt from parts. Every other module of the worker goes through here;
``worker/tests/test_grant_fs_owner.py`` fails when one opens, lists, stats or
removes a path by its string without being on its list of the worker's own
paths.

* :func:`open_no_follow` opens a path a request named with ``openat2`` and
  ``RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`` from ``/`` (a symlink
  anywhere along it is refused by the kernel, atomically with the walk); on
  a kernel without openat2 (before 5.6) it walks one component at a time
  with ``O_PATH | O_NOFOLLOW``, each refused if it is a link. There is no
  single workspace root to resolve beneath: each grant is an absolute path
  checked lexically against its ceiling, and a path with no symlink and no
  ``..`` (refused by :func:`check_normal`) reaches what its words name, so
  the ceiling check holds for what was opened.
* :func:`read_no_follow` reads a script through that descriptor.
* :class:`ListedGrants` holds a sandbox's write grants for one job's
  ``report_files`` listing: each opened again and kept only while it is
  still the very file the sandbox has mounted, and walked by descriptor. A
  grant whose path no longer leads to it (a directory renamed away and a
  symlink put in its place, an ancestor included) is reported changed, and
  nothing of it is listed.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass
from enum import Enum
from types import TracebackType

from readie_protocol.requests import MAX_PATH_BYTES

__all__ = [
    "MAX_NAME_BYTES",
    "MAX_SCANNED_ENTRIES",
    "MAX_SCAN_DEPTH",
    "MAX_SCAN_SECONDS",
    "Listing",
    "ListedGrants",
    "OpenedPath",
    "PathIdentity",
    "PathKind",
    "PathRefused",
    "check_normal",
    "open_no_follow",
    "read_no_follow",
]

# Entries one listing stats, over all grants: about half a second of the
# worker's time measured here (0.39-0.54 s for 100,000 short names, twice per
# job that asks), and more files than a job's report is read for.
MAX_SCANNED_ENTRIES = 100_000
# Deeper than any tree a job means to write; a deeper one is a nest built to cost the walk.
MAX_SCAN_DEPTH = 64
# The names one listing keeps, in bytes of their paths below the grant: long
# names would otherwise make a listing of 100,000 entries hold hundreds of MiB.
MAX_NAME_BYTES = 16 * 1024 * 1024
# Wall time of one listing: it runs outside the job's timeout, on the worker's thread.
MAX_SCAN_SECONDS = 2.0

# <linux/openat2.h>
_SYS_OPENAT2 = 437  # x86_64 and aarch64 alike
_RESOLVE_NO_MAGICLINKS = 0x02
_RESOLVE_NO_SYMLINKS = 0x04
_AT_FDCWD = -100
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK

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
class PathIdentity:
    """What a path led to when it was opened: enough to tell, later, whether it still does."""

    path: str
    device: int
    inode: int
    kind: PathKind


@dataclass(frozen=True, slots=True)
class OpenedPath:
    """A path opened without following symlinks; ``fd`` (``O_PATH``) is the caller's to close."""

    path: str
    fd: int
    kind: PathKind
    device: int
    inode: int

    @property
    def identity(self) -> PathIdentity:
        return PathIdentity(self.path, self.device, self.inode, self.kind)


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
    try:
        fd = _open_path(path)
    except OSError as exc:
        raise PathRefused(_reason(exc.errno or errno.EIO)) from None
    try:
        info = os.fstat(fd)
    except OSError as exc:
        os.close(fd)
        raise PathRefused(_reason(exc.errno or errno.EIO)) from None
    if stat.S_ISDIR(info.st_mode):
        return OpenedPath(path, fd, PathKind.DIRECTORY, info.st_dev, info.st_ino)
    if stat.S_ISREG(info.st_mode):
        return OpenedPath(path, fd, PathKind.FILE, info.st_dev, info.st_ino)
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


# --------------------------------------------------------------------------- listing


@dataclass(frozen=True, slots=True)
class Listing:
    """The regular files beneath a job's write grants at one moment (``report_files``)."""

    files: dict[str, tuple[int, int, int, int]]  # path -> (size, mtime_ns, inode, ctime_ns)
    complete: bool  # False when the walk stopped at a bound, or a directory could not be entered
    # Grants whose path no longer leads to what the sandbox has mounted: nothing of them is listed.
    changed: tuple[str, ...] = ()


class ListedGrants:
    """A sandbox's write grants, held for one job's listings; a ``with`` block.

    Each grant is opened again (:func:`open_no_follow`) and kept only if it is
    the very file the sandbox has mounted (``granted``, recorded when the
    sandbox was made): a step of a session may come long after its grants
    were opened. Held, it is what :meth:`listing` walks, and each listing
    first checks that its path still leads to it, so a grant swapped during
    the job is reported too. Never raises: what cannot be held is changed.
    """

    def __init__(self, granted: Iterable[PathIdentity]) -> None:
        self._held: list[OpenedPath] = []
        self._changed: list[str] = []
        for identity in granted:
            opened = _reopen(identity)
            if opened is None:
                self._changed.append(identity.path)
            else:
                self._held.append(opened)

    def listing(self) -> Listing:
        walk = _Walk()
        changed = list(self._changed)
        for grant in self._held:
            if walk.spent():
                break
            if not _still_named(grant):
                changed.append(grant.path)
                continue
            if grant.kind is PathKind.FILE:
                walk.file(grant.fd, grant.path)
                continue
            try:
                fd = os.open(".", _DIRECTORY_FLAGS, dir_fd=grant.fd)  # the held directory, readable
            except OSError:
                walk.complete = False
                continue
            walk.directory(fd, grant.path, grant.device, 0)
        return Listing(walk.files, walk.complete, tuple(changed))

    def close(self) -> None:
        for grant in self._held:
            os.close(grant.fd)
        self._held.clear()

    def __enter__(self) -> ListedGrants:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


class _Walk:
    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int, int, int]] = {}
        self.entries = MAX_SCANNED_ENTRIES
        self.name_bytes = MAX_NAME_BYTES
        self.deadline = time.monotonic() + MAX_SCAN_SECONDS
        self.complete = True

    def spent(self) -> bool:
        if self.entries < 0 or self.name_bytes < 0 or time.monotonic() > self.deadline:
            self.complete = False
            return True
        return False

    def file(self, fd: int, path: str) -> None:
        """A single-file grant, held as ``fd``."""
        self.entries -= 1
        try:
            info = os.fstat(fd)
        except OSError:
            self.complete = False
            return
        self.files[path] = (info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns)

    def directory(self, fd: int, path: str, device: int, depth: int) -> None:
        """List the open directory ``fd`` (``path`` on the host, for the names only); closes ``fd``."""
        subdirectories = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    self.entries -= 1
                    self.name_bytes -= len(entry.name) + 1
                    if self.spent():
                        return
                    try:
                        info = entry.stat(follow_symlinks=False)  # fstatat on fd: no path rebuilt
                    except OSError:  # gone meanwhile
                        continue
                    if stat.S_ISREG(info.st_mode):
                        child = os.path.join(path, entry.name)
                        self.files[child] = (info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns)
                    elif stat.S_ISDIR(info.st_mode):
                        subdirectories.append((entry.name, info))
            for name, seen in subdirectories:
                if depth + 1 > MAX_SCAN_DEPTH or self.spent():
                    self.complete = False
                    return
                child_fd = _enter(fd, name, seen, device)
                if child_fd is None:
                    self.complete = False
                    continue
                self.directory(child_fd, os.path.join(path, name), device, depth + 1)
        finally:
            os.close(fd)


def _enter(parent: int, name: str, seen: os.stat_result, device: int) -> int | None:
    """The directory ``name`` in ``parent``, if it still is the one seen, on the grant's filesystem."""
    try:
        fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)  # a link in its place: ELOOP
    except OSError:
        return None
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino) or now.st_dev != device:
        os.close(fd)  # swapped since it was listed, or another filesystem mounted there
        return None
    return fd


def _reopen(identity: PathIdentity) -> OpenedPath | None:
    """``identity``'s path opened again, if it still leads to the same file without a link."""
    try:
        opened = open_no_follow(identity.path)
    except PathRefused:
        return None
    if (opened.device, opened.inode) != (identity.device, identity.inode):
        os.close(opened.fd)
        return None
    return opened


def _still_named(held: OpenedPath) -> bool:
    """Whether ``held``'s path still leads, without a link, to the file held."""
    again = _reopen(held.identity)
    if again is None:
        return False
    os.close(again.fd)
    return True


# --------------------------------------------------------------------------- opening


def _open_path(path: str) -> int:
    """An ``O_PATH`` descriptor of ``path``, reached through no symlink; OSError otherwise."""
    how = _OpenHow(os.O_PATH | os.O_CLOEXEC, 0, _RESOLVE_NO_SYMLINKS | _RESOLVE_NO_MAGICLINKS)
    fd = _libc.syscall(
        _SYS_OPENAT2, ctypes.c_int(_AT_FDCWD), os.fsencode(path), ctypes.byref(how), ctypes.c_size_t(ctypes.sizeof(how))
    )
    if fd >= 0:
        return int(fd)
    code = ctypes.get_errno()
    if code == errno.ENOSYS:  # a kernel before 5.6, or a seccomp filter that hides openat2
        return _open_by_components(path)
    raise OSError(code, os.strerror(code))


def _open_by_components(path: str) -> int:
    """What openat2 does above, one component at a time from ``/``: each opened ``O_PATH |
    O_NOFOLLOW`` relative to its parent's descriptor, and refused if it is a link (magic
    links of ``/proc`` included: they are links too)."""
    fd = os.open("/", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for name in path.split("/")[1:] if path != "/" else ():
            child = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=fd)
            os.close(fd)
            fd = child
            if stat.S_ISLNK(os.fstat(fd).st_mode):
                raise OSError(errno.ELOOP, os.strerror(errno.ELOOP))
    except BaseException:
        os.close(fd)
        raise
    return fd


def _reason(code: int) -> str:
    if code == errno.ELOOP:
        return "passes through a symbolic link, which readie never follows in a granted path"
    if code == errno.ENOENT:
        return "does not exist"
    if code == errno.ENOTDIR:
        return "has a component that is not a directory"
    return f"cannot be opened: {os.strerror(code)}"
