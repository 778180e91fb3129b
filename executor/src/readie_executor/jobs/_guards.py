"""Audit hooks that refuse writes outside the grants and subprocesses, with the right error.

What they are and are not: a hook sees only what Python audits, and the job
runs in this same interpreter, so code that wants to can get around them
(ctypes, or rebinding this module's state). They exist so that honest code
gets a PermissionError naming the path, like it would on a host with
Landlock. The boundaries are elsewhere: gVisor's mounts decide which host
files exist and which are read-only (a write there answers EROFS), the
seccomp filter refuses new processes, and whatever else the job writes lands
in the sandbox's in-memory overlay, which dies with the sandbox.

An audit hook cannot be removed, so one hook is installed per process and
consults the guard of the job that is running; between jobs it lets
everything through (the executor itself writes /etc/resolv.conf).
"""

from __future__ import annotations

import errno
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

SUBPROCESS_DENIED_MESSAGE = "subprocesses are not allowed in this sandbox"

# Audit events that start a process (os.spawn* and pty.spawn go through os.fork
# or os.forkpty and so raise one of these).
SUBPROCESS_EVENTS = frozenset(
    {
        "os.fork",
        "os.forkpty",
        "os.system",
        "os.exec",
        "os.posix_spawn",
        "os.spawn",
        "subprocess.Popen",
    }
)
# Audit events that change the filesystem without open(), with the positions
# of the path arguments they modify.
PATH_WRITE_EVENTS = {
    "os.mkdir": (0,),
    "os.remove": (0,),
    "os.rmdir": (0,),
    "os.rename": (0, 1),
    "os.link": (1,),
    "os.symlink": (1,),
    "os.truncate": (0,),
    "os.chmod": (0,),
    "os.chown": (0,),
    "os.utime": (0,),
}
# Devices that discard or pass through writes; opening them for writing
# changes no file.
ALWAYS_WRITABLE = frozenset({os.devnull, "/dev/stdout", "/dev/stderr"})
_WRITE_MODE_CHARACTERS = frozenset("wax+")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND


@dataclass(frozen=True, slots=True)
class JobGuard:
    """What the running job may do, as the audit hook checks it."""

    writable_roots: tuple[str, ...]  # resolved, normalized directories
    subprocesses: bool

    def check(self, event: str, args: tuple[object, ...]) -> None:
        if event == "open":
            path, mode, flags = (tuple(args) + (None, None, None))[:3]
            if _opens_for_writing(mode, flags):
                self._check_write(path)
        elif event in PATH_WRITE_EVENTS:
            for index in PATH_WRITE_EVENTS[event]:
                if index < len(args):
                    self._check_write(args[index])
        elif event in SUBPROCESS_EVENTS and not self.subprocesses:
            raise PermissionError(SUBPROCESS_DENIED_MESSAGE)

    def _check_write(self, path: object) -> None:
        if isinstance(path, int) or path is None:
            return  # an already-open descriptor: it was checked when it was opened
        try:
            text = os.fsdecode(os.fspath(path))  # type: ignore[arg-type]
        except TypeError:
            return
        absolute = os.path.abspath(text)
        if absolute in ALWAYS_WRITABLE or self.allows(os.path.realpath(absolute)):
            return
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), text)

    def allows(self, resolved: str) -> bool:
        return any(
            resolved == root or resolved.startswith(root.rstrip("/") + "/")
            for root in self.writable_roots
        )


_active_guard: JobGuard | None = None
_hook_installed = False


def writable_roots(link_paths_and_targets: Iterator[str]) -> tuple[str, ...]:
    """Both the link and its target, resolved: a path under either is the same grant."""
    roots = set()
    for path in link_paths_and_targets:
        roots.add(os.path.normpath(os.path.abspath(path)))
        roots.add(os.path.realpath(path))
    return tuple(sorted(roots))


@contextmanager
def guarded(guard: JobGuard) -> Iterator[None]:
    global _active_guard, _hook_installed
    if not _hook_installed:
        sys.addaudithook(_audit_hook)
        _hook_installed = True
    _active_guard = guard
    try:
        yield
    finally:
        _active_guard = None


def _audit_hook(event: str, args: tuple[object, ...]) -> None:
    guard = _active_guard
    if guard is not None:
        guard.check(event, args)


def _opens_for_writing(mode: object, flags: object) -> bool:
    if isinstance(mode, str):
        return not _WRITE_MODE_CHARACTERS.isdisjoint(mode)
    return isinstance(flags, int) and bool(flags & _WRITE_FLAGS)
