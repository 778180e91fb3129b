"""Files in a session store, opened as the hostile things they are (``session_store.py``).

Everything beneath a store's root may have been put there by someone with
write access to the shared volume but not the store's key: symlinks, FIFOs,
devices, files that grow while read, directories where files should be. So
every open here is relative to a directory descriptor, never follows a
symlink (``O_NOFOLLOW``), never blocks on a FIFO (``O_NONBLOCK``), checks the
descriptor is a regular file, and reads at most a named bound. What breaks
these rules is an :class:`UnsafeFile`, which the store turns into a refusal.

Only an open whose error is about the path itself (a symlink, not a directory,
gone) is an UnsafeFile. Any other error (descriptors run out, an I/O error, a
network volume's stale handle) is the machine's trouble and says nothing of the
entry: it stays an OSError, which never condemns an entry or a lease.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import stat
from collections.abc import Iterator

from .errors import SandboxSetupError

__all__ = ["UnsafeFile", "copy_hashing", "make_dir", "opened_dir", "read_bounded", "regular_sizes", "store_errors", "write_new"]

_READ = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_CREATE = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
# What an open's errno says about the path (O_NOFOLLOW met a symlink, a file where a directory
# should be or the reverse, nothing there, modes that keep this worker out): the entry's doing,
# or a writer's meanwhile.
_PATH_ERRNOS = frozenset({errno.ELOOP, errno.ENOTDIR, errno.EISDIR, errno.ENOENT, errno.ENXIO, errno.EACCES, errno.EPERM})
# Copies move a session image (tens to hundreds of MB) in pieces this big: few system calls,
# little memory.
COPY_CHUNK_BYTES = 1024 * 1024


class UnsafeFile(Exception):
    """A store path that is not what it should be (not a regular file, too big, gone, a link)."""


@contextlib.contextmanager
def store_errors(doing: str) -> Iterator[None]:
    """A store that cannot be written (full, gone, read-only, a file planted in the way) is the
    worker's trouble, not the request's: SandboxSetupError, and the session goes on or ends as
    its caller decides."""
    try:
        yield
    except (OSError, UnsafeFile) as exc:
        raise SandboxSetupError(f"the session store could not {doing}: {exc}") from None


@contextlib.contextmanager
def opened_dir(name: str, dir_fd: int | None = None) -> Iterator[int]:
    """A descriptor of the directory ``name`` (beneath ``dir_fd``), never through a symlink."""
    fd = _open(name, _DIRECTORY, dir_fd)
    try:
        yield fd
    finally:
        os.close(fd)


def make_dir(name: str, dir_fd: int, *, exist_ok: bool = False) -> None:
    """Make the directory ``name`` beneath ``dir_fd``, 0700; an existing one must be a directory."""
    try:
        os.mkdir(name, 0o700, dir_fd=dir_fd)
    except FileExistsError:
        if not exist_ok or not stat.S_ISDIR(os.lstat(name, dir_fd=dir_fd).st_mode):
            raise


def read_bounded(dir_fd: int, name: str, limit: int) -> bytes:
    """The whole of the regular file ``name``, refused when it is more than ``limit`` bytes."""
    fd = _open_regular(dir_fd, name, limit)
    try:
        data = b""
        while len(data) <= limit:
            piece = os.read(fd, limit + 1 - len(data))
            if not piece:
                return data
            data += piece
        raise UnsafeFile(f"{name}: more than {limit} bytes")
    finally:
        os.close(fd)


def copy_hashing(src_dir_fd: int, name: str, dst_dir_fd: int, limit: int) -> tuple[int, str]:
    """Copy the regular file ``name`` into a new file of the same name (0600) beneath
    ``dst_dir_fd``; its bytes and SHA-256 as copied. A file growing past ``limit`` is refused."""
    src = _open_regular(src_dir_fd, name, limit)
    try:
        dst = os.open(name, _CREATE, 0o600, dir_fd=dst_dir_fd)
        try:
            digest = hashlib.sha256()
            size = 0
            while piece := os.read(src, COPY_CHUNK_BYTES):
                size += len(piece)
                if size > limit:
                    raise UnsafeFile(f"{name}: grew past {limit} bytes while copied")
                digest.update(piece)
                view = memoryview(piece)
                while view:
                    view = view[os.write(dst, view):]
            return size, digest.hexdigest()
        finally:
            os.close(dst)
    finally:
        os.close(src)


def write_new(dir_fd: int, name: str, data: bytes) -> None:
    """Write ``data`` as the new file ``name`` (0600) beneath ``dir_fd``; it must not exist."""
    fd = os.open(name, _CREATE, 0o600, dir_fd=dir_fd)
    try:
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
    finally:
        os.close(fd)


def regular_sizes(dir_fd: int) -> dict[str, int]:
    """The regular files directly beneath ``dir_fd`` and their sizes (nothing else counted or followed)."""
    sizes = {}
    for name in os.listdir(dir_fd):
        with contextlib.suppress(OSError):
            info = os.lstat(name, dir_fd=dir_fd)
            if stat.S_ISREG(info.st_mode):
                sizes[name] = info.st_size
    return sizes


def _open(name: str, flags: int, dir_fd: int | None) -> int:
    """``os.open``; UnsafeFile when the error is about the path (:data:`_PATH_ERRNOS`)."""
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as exc:
        if exc.errno in _PATH_ERRNOS:
            raise UnsafeFile(f"{name}: {exc.strerror}") from None
        raise


def _open_regular(dir_fd: int, name: str, limit: int) -> int:
    fd = _open(name, _READ, dir_fd)
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeFile(f"{name}: not a regular file")
        if info.st_size > limit:
            raise UnsafeFile(f"{name}: {info.st_size} bytes, more than {limit}")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd
