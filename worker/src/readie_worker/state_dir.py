"""A worker's state dir: the one host directory it keeps everything in, and its own alone.

Everything a worker (and so a ``readie pool``) writes on the host lives
beneath it, made by the worker at start, mode 0700, and emptied at start
and at close (decision 0025)::

    runsc/    runsc's --root: container state and each sandbox's control socket
    run/      one directory per sandbox: its bundle, its executor socket, its grants' mounts
    images/   images on their way into and out of the session store (hibernation.py)
    store/    the session store, unless the worker shares one (session_store.py)

Nothing is kept beside it or named after it. Other local users are the
attackers here: a state dir in a shared place (``/tmp``) could be planted
before the worker starts. So an existing one is used only if it is a
directory, not a symlink, owned by this user and writable by nobody else,
in a parent that nobody else can rename it out of (owned by this user or
root, and sticky if others may write it); anything else is refused with
:class:`StateDirRefused`, which the commands turn into exit 2. The checks
are made on descriptors, and the worker then removes only from the
descriptor it opened: nothing is resolved by path and removed afterwards.

Without a named state dir, a worker makes a new one under the per-user
:data:`RUNTIME_ROOT` and removes it at close; a named one is removed at
close only if the worker made it.

Socket paths may not exceed 107 bytes (sun_path), and two kinds live
beneath the state dir: each sandbox's executor socket under ``run/`` and
runsc's control socket under ``runsc/`` (runsc puts that one in /var/run,
/run or /tmp instead when its root is too long, so a long root would move it
into a shared place). A state dir too long for either is refused at start.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import structlog
from readie_executor.sockets import MAX_SOCKET_PATH

from ._sandbox_dir import SandboxDir
from .errors import ConfigError, SandboxSetupError
from .paths import remove_beneath

__all__ = [
    "IMAGES",
    "RUN",
    "RUNSC",
    "RUNTIME_DIR_VARIABLE",
    "RUNTIME_ROOT",
    "STORE",
    "StateDir",
    "StateDirRefused",
    "runtime_root",
    "scratch_dir",
]

log = structlog.get_logger("readie.worker")

#: The state dir's layout; short names, because sockets live beneath two of them.
RUNSC = "runsc"
RUN = "run"
IMAGES = "images"
STORE = "store"
_LAYOUT = (RUNSC, RUN, IMAGES, STORE)

RUNTIME_DIR_VARIABLE = "READIE_RUNTIME_DIR"
ROOT_RUNTIME_PARENT = "/run"


def _default_runtime_root() -> Path:
    """``$READIE_RUNTIME_DIR``, else ``$XDG_RUNTIME_DIR/readie`` (a per-user tmpfs where a login
    session has one), else for root ``/run/readie`` (only root writes ``/run``; short, and
    runsc's sockets beneath must fit in 107 bytes wherever $HOME is), else ``readie/run`` in
    the user's own cache dir: never a shared place. Not ``$READIE_CACHE``, which may be a
    volume shared with others (a node's cache in k8s)."""
    if os.environ.get(RUNTIME_DIR_VARIABLE):
        return Path(os.environ[RUNTIME_DIR_VARIABLE])
    if os.environ.get("XDG_RUNTIME_DIR"):
        return Path(os.environ["XDG_RUNTIME_DIR"]) / "readie"
    if os.geteuid() == 0 and os.path.isdir(ROOT_RUNTIME_PARENT):
        return Path(ROOT_RUNTIME_PARENT) / "readie"
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.environ.get("HOME") or Path.home(), ".cache")
    return Path(cache) / "readie" / "run"


#: Where every readie process of this user keeps its default state dirs (and ``readie
#: capture`` its scratch): one directory, so that every worker can refuse grants that reach
#: any of them, its own or another pool's.
RUNTIME_ROOT = _default_runtime_root()

_DIRECTORY = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Bits that let someone other than the owner add, remove or rename entries.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class StateDirRefused(ConfigError):
    """The state dir cannot be readie's own (a symlink, another user's, writable by others, in a
    parent others can rename it in, too long for its sockets); the message names it and why."""

    def __init__(self, path: Path | str, reason: str) -> None:
        super().__init__(str(path), None, reason)


@dataclass(frozen=True)
class StateDir:
    """A state dir, checked; make it with :meth:`claim`. Each use opens it again, checked again,
    and works from that descriptor: nothing is looked up by path and then removed."""

    path: Path  # as the kernel named the directory claimed: no symlink in it
    made: bool  # made by this worker, so removed at close

    @property
    def runsc_root(self) -> Path:
        return self.path / RUNSC

    @property
    def run_dir(self) -> Path:
        return self.path / RUN

    @property
    def images_dir(self) -> Path:
        return self.path / IMAGES

    @property
    def store_dir(self) -> Path:
        return self.path / STORE

    @classmethod
    def claim(cls, named: Path | None) -> StateDir:
        """The state dir ``named``, made if missing, or a new one under :func:`runtime_root`;
        StateDirRefused when it cannot be readie's own. Nothing in it is touched yet."""
        if named is None:
            path, made = scratch_dir("rs-"), True
        else:
            path, made = Path(os.path.abspath(named)), False
            if path == path.parent:
                raise StateDirRefused(path, "the state dir cannot be the root directory")
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise StateDirRefused(path, f"cannot make its parent directory: {exc.strerror}") from None
        with _opened(path, make=named is not None) as (parent_fd, fd, made_here):
            state = cls(Path(os.readlink(f"/proc/self/fd/{fd}")), made or made_here)
            try:
                _check_socket_room(state)
            except StateDirRefused:
                if state.made:
                    os.rmdir(path.name, dir_fd=parent_fd)  # empty: made just now
                raise
        return state

    def prepare(self) -> None:
        """Remove whatever an earlier run left beneath it, and make its layout anew (mode 0700)."""
        with _opened(self.path) as (_, fd, _):
            if not remove_beneath(fd):
                raise SandboxSetupError(f"cannot empty the state dir {self.path}: an earlier run's mounts or files remain")
            try:
                for name in _LAYOUT:
                    os.mkdir(name, 0o700, dir_fd=fd)
            except OSError as exc:
                raise SandboxSetupError(f"cannot make {name} in the state dir {self.path}: {exc.strerror}") from None

    def close(self) -> None:
        """Remove everything beneath it, and the dir itself if this worker made it. Again after
        a first close, it removes what a thread still running then made; never raises."""
        if not os.path.lexists(self.path):
            return
        try:
            with _opened(self.path) as (parent_fd, fd, _):
                if remove_beneath(fd) and self.made:
                    os.rmdir(self.path.name, dir_fd=parent_fd)
        except (StateDirRefused, OSError) as exc:
            log.error("cannot remove the state dir", state_dir=str(self.path), error=str(exc))


def runtime_root() -> Path:
    """:data:`RUNTIME_ROOT`, made if missing: a directory of this user's alone, never a link."""
    RUNTIME_ROOT.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.mkdir(RUNTIME_ROOT, 0o700)
    except FileExistsError:
        pass
    info = os.lstat(RUNTIME_ROOT)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.geteuid() or stat.S_IMODE(info.st_mode) & 0o077:
        raise StateDirRefused(
            RUNTIME_ROOT, f"readie's runtime dir must be a directory of uid {os.geteuid()}'s alone (mode 0700), not a link"
        )
    return RUNTIME_ROOT


def scratch_dir(prefix: str) -> Path:
    """A new directory of this process's under :func:`runtime_root` (mode 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix, dir=runtime_root()))


@contextlib.contextmanager
def _opened(path: Path, *, make: bool = False) -> Iterator[tuple[int, int, bool]]:
    """Descriptors of the state dir's parent and of the state dir, each checked (see the module
    docstring), and whether ``make`` made the state dir (mode 0700); closed on leaving."""
    parent_fd = _open_parent(path)
    try:
        made = make and _make(path, parent_fd)
        fd = _open_own(path, parent_fd)
        try:
            yield parent_fd, fd, made
        finally:
            os.close(fd)
    finally:
        os.close(parent_fd)


def _open_parent(path: Path) -> int:
    """The state dir's parent, held open; refused unless only this user or root can rename
    entries in it (others may write a sticky one, as ``/tmp``, where they cannot)."""
    try:
        fd = os.open(path.parent, os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError as exc:
        raise StateDirRefused(path, f"its parent directory cannot be opened: {exc.strerror}") from None
    info = os.fstat(fd)
    reason = None
    if info.st_uid not in (0, os.geteuid()):
        reason = f"its parent directory belongs to uid {info.st_uid}, who could replace the state dir"
    elif info.st_mode & _OTHERS_WRITE and not info.st_mode & stat.S_ISVTX:
        reason = f"its parent directory is writable by others and not sticky (mode {stat.filemode(info.st_mode)})"
    if reason is not None:
        os.close(fd)
        raise StateDirRefused(path, reason)
    return fd


def _make(path: Path, parent_fd: int) -> bool:
    """Make the state dir (mode 0700) in its parent if it is missing; whether it was made here."""
    try:
        os.mkdir(path.name, 0o700, dir_fd=parent_fd)
    except FileExistsError:
        return False  # whatever is there is checked when it is opened
    except OSError as exc:
        raise StateDirRefused(path, f"cannot make the state dir: {exc.strerror}") from None
    return True


def _open_own(path: Path, parent_fd: int) -> int:
    """The state dir, opened without following a link and checked on that descriptor."""
    try:
        fd = os.open(path.name, _DIRECTORY, dir_fd=parent_fd)
    except OSError as exc:
        reason = f"the state dir cannot be opened: {exc.strerror}"
        if exc.errno in (errno.ELOOP, errno.ENOTDIR):  # what O_NOFOLLOW | O_DIRECTORY met, told apart
            reason = "the state dir is not a directory"
            with contextlib.suppress(OSError):
                if stat.S_ISLNK(os.lstat(path.name, dir_fd=parent_fd).st_mode):
                    reason = "the state dir is a symbolic link; readie keeps its state only in a directory of its own"
        raise StateDirRefused(path, reason) from None
    info = os.fstat(fd)
    reason = None
    if info.st_uid != os.geteuid():
        reason = f"the state dir belongs to uid {info.st_uid}, not to this user (uid {os.geteuid()})"
    elif info.st_mode & _OTHERS_WRITE:
        reason = f"the state dir is writable by its group or others (mode {stat.filemode(info.st_mode)}); chmod go-w it"
    if reason is not None:
        os.close(fd)
        raise StateDirRefused(path, reason)
    return fd


def _check_socket_room(state: StateDir) -> None:
    """Refuse a state dir too long for the sockets beneath it (107 bytes at most)."""
    container = SandboxDir.socket_path_in(state.run_dir).parent.parent.name  # runsc names its socket after it
    for socket_path in (SandboxDir.socket_path_in(state.run_dir), state.runsc_root / f"runsc-{container}.sock"):
        if len(os.fsencode(socket_path)) > MAX_SOCKET_PATH:
            raise StateDirRefused(
                state.path,
                f"the state dir is too long: a socket beneath it ({socket_path}) would exceed {MAX_SOCKET_PATH} "
                f"bytes; name a shorter one (the default is under {RUNTIME_ROOT})",
            )
