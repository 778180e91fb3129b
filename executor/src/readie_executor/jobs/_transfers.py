"""A session's uploads, downloads and listings, from inside the sandbox (decision 31).

Each is a call of its own, pickled by reference by the worker, and answered in
:mod:`readie_executor.filewire`'s layout: raw bytes, never a pickle. Every path is reached as
:mod:`._workspace` reaches it, never through a link. The worker checks every answer: the job's
code runs in this process and may have replaced these functions.

Standard library only: this runs in the sandbox's own python3.
"""

from __future__ import annotations

import functools
import os
import stat
from collections.abc import Callable
from typing import Any, TypeVar

from .._calls import RAW_RESPONSE_ATTRIBUTE
from ..filewire import encode_answer, refusal
from ._workspace import (
    MAX_WALK_ENTRIES,
    READ_FLAGS,
    WorkspaceError,
    create_file,
    enter_dir,
    entry_names,
    open_workspace,
    parent_of,
    version,
    why_not,
    write_at,
)

__all__ = ["download_chunk", "list_files", "upload_chunk"]

# A later chunk opens the file it continues; O_NONBLOCK: a FIFO put in its place must not hang the call.
_CONTINUE_FLAGS = os.O_WRONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC

_F = TypeVar("_F", bound=Callable[..., Any])


def _answered(func: _F) -> _F:
    """A session call: its WorkspaceError or OSError is a refusal, its answer raw bytes."""

    @functools.wraps(func)
    def call(*args: Any, **kwargs: Any) -> bytearray:
        try:
            return func(*args, **kwargs)
        except WorkspaceError as exc:
            return refusal(str(exc))
        except OSError as exc:
            return refusal(exc.strerror or type(exc).__name__)

    setattr(call, RAW_RESPONSE_ATTRIBUTE, True)
    return call  # type: ignore[return-value]


@_answered
def upload_chunk(cwd: str, path: str, offset: int, size: int, data: bytes) -> bytearray:
    """Write ``data`` at ``offset`` of the ``size``-byte upload of ``path``: offset 0 creates the
    file, each later chunk starts where the file ends. Answers ``{"received": bytes held}``."""
    if offset < 0 or offset + len(data) > size:
        raise WorkspaceError(f"{path}: bytes {offset}..{offset + len(data)} are outside the {size}-byte upload")
    with parent_of(cwd, path, create=offset == 0) as (parent, name):
        if offset == 0:
            fd = create_file(parent, name, path)
        else:
            fd = _open_upload(parent, name, path, offset)
        try:
            write_at(fd, data, offset, path)
        finally:
            os.close(fd)
    return encode_answer({"received": offset + len(data)})


def _open_upload(parent: int, name: str, shown: str, offset: int) -> int:
    try:
        fd = os.open(name, _CONTINUE_FLAGS, dir_fd=parent)
    except FileNotFoundError:
        raise WorkspaceError(f"{shown}: no upload under way (it starts at offset 0)") from None
    except OSError as exc:
        raise WorkspaceError(why_not(parent, name, shown, exc)) from None
    st = os.fstat(fd)
    # One name only: an upload never writes into a file the code linked elsewhere meanwhile.
    if not stat.S_ISREG(st.st_mode) or st.st_nlink != 1 or st.st_size != offset:
        os.close(fd)
        raise WorkspaceError(
            f"{shown} holds {st.st_size} bytes, not the {offset} uploaded so far: it changed during the "
            f"upload, which starts again at offset 0"
        )
    return fd


@_answered
def download_chunk(cwd: str, path: str, offset: int, length: int) -> bytearray:
    """At most ``length`` bytes of ``path`` from ``offset``. Answers ``{"offset", "size",
    "modified_ns"}`` (the file's when read) and the bytes."""
    with parent_of(cwd, path, create=False) as (parent, name):
        try:
            mode = os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode
        except FileNotFoundError:
            raise WorkspaceError(f"{path}: no such file") from None
        if not stat.S_ISREG(mode):  # looked at first: a device is never opened
            kind = "a symbolic link" if stat.S_ISLNK(mode) else "not a regular file"
            raise WorkspaceError(f"{path} is {kind}")
        try:
            fd = os.open(name, READ_FLAGS, dir_fd=parent)
        except OSError as exc:
            raise WorkspaceError(why_not(parent, name, path, exc)) from None
        try:
            before = os.fstat(fd)
            if not stat.S_ISREG(before.st_mode):
                raise WorkspaceError(f"{path} is not a regular file")
            if not 0 <= offset <= before.st_size:
                raise WorkspaceError(f"{path}: offset {offset} is past its end ({before.st_size} bytes)")
            data = os.pread(fd, min(length, before.st_size - offset), offset)
            if version(os.fstat(fd)) != version(before):
                raise WorkspaceError(f"{path} changed while it was read")
        finally:
            os.close(fd)
    return encode_answer({"offset": offset, "size": before.st_size, "modified_ns": before.st_mtime_ns}, data)


@_answered
def list_files(cwd: str, path: str, max_entries: int) -> bytearray:
    """The entries of directory ``path`` (``"."``: the workspace), sorted by name, at most
    ``max_entries``. Answers ``{"entries": [{"name", "size", "kind"}], "truncated"}``."""
    if path == ".":
        fd = open_workspace(cwd)
    else:
        with parent_of(cwd, path, create=False) as (parent, name):
            fd = enter_dir(parent, name, create=False, shown=path)
    try:
        entries, cut = entry_names(fd, [MAX_WALK_ENTRIES])
        listed = []
        for entry in entries[:max_entries]:
            try:
                st = entry.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # gone since it was listed
            listed.append({"name": entry.name, "size": st.st_size, "kind": _kind(st.st_mode)})
    finally:
        os.close(fd)
    return encode_answer({"entries": listed, "truncated": cut or len(entries) > max_entries})


def _kind(mode: int) -> str:
    if stat.S_ISREG(mode):
        return "file"
    if stat.S_ISDIR(mode):
        return "dir"
    if stat.S_ISLNK(mode):
        return "link"
    return "other"
