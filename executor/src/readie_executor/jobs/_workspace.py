"""The job's workspace, from inside the sandbox: how a path in it is reached, and the files
written into it before a job runs (decision 31).

The workspace is the job's working directory. Every path is walked one component at a time from
a descriptor of it, each opened with ``O_NOFOLLOW`` (``os.open(name, dir_fd=...)``), never
``open(full_path)``: a link the job's code left anywhere on the way, to a write grant or
elsewhere, is refused, never followed, so nothing is written or read outside the workspace. The
workspace itself is reached the same way from ``/``.

gVisor follows a link that ``O_DIRECTORY | O_NOFOLLOW`` names (Linux refuses it with ENOTDIR;
measured on the release the checkpoints use), so a directory is opened without ``O_DIRECTORY``,
where ``O_NOFOLLOW`` holds on both, and checked to be one afterwards (:func:`open_dir`).

An existing file is replaced, not written through: it is unlinked and a new one created with
``O_EXCL``, so a hard link the code made to it keeps its bytes, and a link planted between the
two steps makes the create fail.

A session's uploads, downloads and listings are :mod:`._transfers`; a job's collect :mod:`._collect`.

Standard library only: this runs in the sandbox's own python3.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator

__all__ = [
    "MAX_WALK_ENTRIES",
    "READ_FLAGS",
    "WorkspaceError",
    "create_file",
    "enter_dir",
    "entry_names",
    "open_dir",
    "open_workspace",
    "parent_of",
    "read_regular",
    "version",
    "why_not",
    "write_at",
    "write_files",
]

# O_NONBLOCK: a FIFO put in place of a file (or a directory) after it was looked at must not hang
# the call. No O_DIRECTORY: gVisor follows a link despite O_NOFOLLOW when it is there.
_DIR_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_MODE = 0o644
_NEW_DIR_MODE = 0o755
# Directory entries one listing or collect looks at, all directories together: the job's code
# can make millions, and each costs a stat in gVisor. Past it the walk stops and says so.
MAX_WALK_ENTRIES = 100_000
# Bytes per read(2) of a file being read whole: tmpfs serves it from memory either way.
READ_BYTES = 1024 * 1024


class WorkspaceError(Exception):
    """What was asked of the workspace cannot be done; the message names the path."""


# --------------------------------------------------------------------------- walking


def open_workspace(cwd: str) -> int:
    """A descriptor of the directory ``cwd``, reached from ``/`` without following a link."""
    if not cwd.startswith("/"):
        raise WorkspaceError(f"the workspace {cwd!r} is not an absolute path")
    fd = open_dir(None, "/")
    try:
        for part in (part for part in cwd.split("/") if part not in ("", ".")):
            if part == "..":
                raise WorkspaceError(f"the workspace {cwd!r} holds '..'")
            child = enter_dir(fd, part, create=False, shown=f"the workspace {cwd}")
            os.close(fd)
            fd = child
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def parent_of(cwd: str, path: str, *, create: bool) -> Iterator[tuple[int, str]]:
    """The open directory that holds workspace ``path``, and its last name; ``create`` makes the
    directories on the way."""
    parts = path.split("/")
    if path.startswith("/") or any(part in ("", ".", "..") for part in parts):
        raise WorkspaceError(f"{path!r} is not a normalised path in the workspace")
    fd = open_workspace(cwd)
    try:
        for index, part in enumerate(parts[:-1]):
            child = enter_dir(fd, part, create=create, shown="/".join(parts[: index + 1]))
            os.close(fd)
            fd = child
        yield fd, parts[-1]
    finally:
        os.close(fd)


def open_dir(parent: int | None, name: str) -> int:
    """Directory ``name`` in open directory ``parent``, never through a link: ELOOP for a link,
    ENOTDIR for anything else that is not a directory."""
    fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
    if not stat.S_ISDIR(os.fstat(fd).st_mode):
        os.close(fd)
        raise NotADirectoryError(errno.ENOTDIR, os.strerror(errno.ENOTDIR), name)
    return fd


def enter_dir(parent: int, name: str, *, create: bool, shown: str) -> int:
    try:
        return open_dir(parent, name)
    except FileNotFoundError:
        if not create:
            raise WorkspaceError(f"{shown}: no such directory") from None
    except OSError as exc:
        raise WorkspaceError(why_not(parent, name, shown, exc)) from None
    try:
        os.mkdir(name, _NEW_DIR_MODE, dir_fd=parent)
    except FileExistsError:
        pass  # made meanwhile: opened below, never followed
    except OSError as exc:
        raise WorkspaceError(f"{shown}: cannot make the directory: {exc.strerror}") from None
    try:
        return open_dir(parent, name)
    except OSError as exc:
        raise WorkspaceError(why_not(parent, name, shown, exc)) from None


def why_not(parent: int, name: str, shown: str, exc: OSError) -> str:
    """What is at ``name`` that an open refused, in words."""
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except OSError:
        return f"{shown}: {exc.strerror}"
    if stat.S_ISLNK(mode):
        return f"{shown} is a symbolic link: files are never written or read through one"
    if exc.errno == errno.ENOTDIR:
        return f"{shown} is not a directory"
    return f"{shown}: {exc.strerror}"


def entry_names(fd: int, budget: list[int]) -> tuple[list[os.DirEntry[str]], bool]:
    """The entries of open directory ``fd`` with UTF-8 names, sorted; and whether the walk's
    ``budget`` (``[entries left]``, shared by a whole walk) ran out first.

    A name that is not UTF-8 cannot be named by a request or sent back in one: it is skipped.
    """
    entries = []
    cut = False
    with os.scandir(fd) as scan:
        for entry in scan:
            if budget[0] <= 0:
                cut = True
                break
            budget[0] -= 1
            try:
                entry.name.encode("utf-8")
            except UnicodeEncodeError:
                continue
            entries.append(entry)
    entries.sort(key=lambda entry: entry.name)
    return entries, cut


def read_regular(fd: int, size: int) -> bytes | None:
    """The whole of open regular file ``fd`` that held ``size`` bytes; None if it grew, shrank
    or was replaced while it was read (up to ``size + 1`` bytes are read, to see growth)."""
    before = os.fstat(fd)
    pieces = []
    left = size + 1
    while left > 0:
        piece = os.read(fd, min(left, READ_BYTES))
        if not piece:
            break
        pieces.append(piece)
        left -= len(piece)
    data = b"".join(pieces)
    after = os.fstat(fd)
    if len(data) != size or version(before) != version(after):
        return None
    return data


def version(st: os.stat_result) -> tuple[int, int, int, int]:
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


# --------------------------------------------------------------------------- writing


def write_files(cwd: str, files: tuple[tuple[str, bytes], ...]) -> None:
    """Write a job's ``files`` into its workspace, replacing what is there, making directories."""
    for path, data in files:
        with parent_of(cwd, path, create=True) as (parent, name):
            fd = create_file(parent, name, path)
            try:
                write_at(fd, data, 0, path)
            finally:
                os.close(fd)


def create_file(parent: int, name: str, shown: str) -> int:
    try:
        mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
    except FileNotFoundError:
        pass
    else:
        if stat.S_ISLNK(mode):
            raise WorkspaceError(f"{shown} is a symbolic link: files are never written through one")
        if stat.S_ISDIR(mode):
            raise WorkspaceError(f"{shown} is a directory")
        try:
            os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            pass  # removed meanwhile: the create below makes it
        except OSError as exc:
            raise WorkspaceError(f"{shown}: cannot replace the file: {exc.strerror}") from None
    try:
        return os.open(name, _CREATE_FLAGS, _NEW_FILE_MODE, dir_fd=parent)
    except OSError as exc:
        raise WorkspaceError(f"{shown}: cannot create the file: {exc.strerror}") from None


def write_at(fd: int, data: bytes, offset: int, shown: str) -> None:
    view = memoryview(data)
    try:
        while view:
            written = os.pwrite(fd, view, offset)
            view, offset = view[written:], offset + written
    except OSError as exc:
        raise WorkspaceError(f"{shown}: cannot write: {exc.strerror}") from None
