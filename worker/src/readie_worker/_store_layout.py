"""A session store's directory layout: which names are entries and generations, and their bytes.

See ``session_store.py`` for the layout. Names that do not match are never
entries or generations: whatever else is planted in the store is ignored,
neither counted nor read (a sweep removes only what matches).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import re
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path

from ._store_files import UnsafeFile, opened_dir, regular_sizes
from ._store_leases import LEASE
from .errors import ConfigError, SandboxSetupError
from .paths import remove_tree

__all__ = ["LOCK", "MAX_GENERATION", "STALE_WRITE_S", "STORE_LOCK_POLL_S", "STORE_LOCK_WAIT_S", "StoreBusy", "flock_by", "entry_bytes", "entry_names", "generation_numbers", "last_touched", "open_root", "store_locked"]

#: A generation being written that is older than this was left by a worker that died mid-write.
STALE_WRITE_S = 3600.0
LOCK = ".lock"
ENTRY_NAME = re.compile(r"[0-9a-f]{64}")
# Canonical only (no leading zeros, at most twelve digits): any other name is not a generation,
# neither followed nor counted nor removed, so that one planted (g01, g0000000000001) cannot
# stand for one the store wrote.
GENERATION = re.compile(r"g([1-9][0-9]{0,11})")
#: The last generation number there is: a trillion writes of one session never happen; a name
#: planted this high leaves the entry unwritable, refused rather than written around.
MAX_GENERATION = 10**12 - 1
WRITING = re.compile(r"\.new-[0-9a-f]{16}-([0-9]{1,20})")


#: The store lock is held for a listing and a rename, milliseconds; waited for this long (polled
#: every STORE_LOCK_POLL_S) before the store counts as unusable: a lock a hung host keeps on a
#: network volume must not hang every worker's session with it.
STORE_LOCK_WAIT_S = 10.0
STORE_LOCK_POLL_S = 0.05


class StoreBusy(SandboxSetupError):
    """The store's lock could not be had in STORE_LOCK_WAIT_S: another worker (or a hung host) holds it."""


def flock_by(fd: int, deadline: float) -> None:
    """An exclusive ``flock`` of ``fd``, tried without blocking until ``deadline`` (monotonic); StoreBusy then."""
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise StoreBusy(f"the session store's lock was held elsewhere for {STORE_LOCK_WAIT_S:.0f} s") from None
            time.sleep(STORE_LOCK_POLL_S)


@contextlib.contextmanager
def store_locked(root_fd: int, threads: threading.Lock) -> Iterator[None]:
    """The store's lock: ``threads`` (this process's) and ``flock`` of :data:`LOCK` (every
    worker's), waited for at most STORE_LOCK_WAIT_S in all (StoreBusy then)."""
    deadline = time.monotonic() + STORE_LOCK_WAIT_S
    if not threads.acquire(timeout=STORE_LOCK_WAIT_S):
        raise StoreBusy(f"the session store's lock was busy for {STORE_LOCK_WAIT_S:.0f} s")
    try:
        fd = os.open(LOCK, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, 0o600, dir_fd=root_fd)
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxSetupError(f"the session store's {LOCK} is not a regular file")
            flock_by(fd, deadline)
            yield
        finally:
            os.close(fd)  # and the lock with it
    finally:
        threads.release()


def open_root(root: Path) -> int:
    """A descriptor of the store's root (made 0700 if missing); ConfigError naming it when it is
    a symlink, not a directory, or writable by group or others."""
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:  # a symlink is ELOOP
        raise ConfigError(str(root), None, f"the session store cannot be opened: {exc.strerror}") from None
    mode = os.fstat(fd).st_mode
    if mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise ConfigError(str(root), None, f"the session store is writable by others (mode {stat.S_IMODE(mode):o}); chmod 700 it")
    return fd


def entry_names(root_fd: int) -> list[str]:
    return sorted(name for name in os.listdir(root_fd) if ENTRY_NAME.fullmatch(name))


def generation_numbers(entry_fd: int) -> list[int]:
    return sorted(int(match.group(1)) for name in os.listdir(entry_fd) if (match := GENERATION.fullmatch(name)))


def entry_bytes(entry_fd: int, now: float | None = None) -> int | None:
    """Bytes of an entry's generations, finished or being written (at least what a write booked);
    None when it holds none. A write older than STALE_WRITE_S is removed (``now`` given: a sweep)."""
    total, holding = 0, False
    for name in os.listdir(entry_fd):
        generation, writing = GENERATION.fullmatch(name), WRITING.fullmatch(name)
        if not (generation or writing):
            continue
        with contextlib.suppress(UnsafeFile, OSError), opened_dir(name, entry_fd) as fd:
            # Dated over STALE_WRITE_S ahead is as stale: only a planted write is, to look live forever.
            if writing and now is not None and abs(now - os.fstat(fd).st_mtime) > STALE_WRITE_S:
                remove_tree(name, dir_fd=entry_fd)
                continue
            used = sum(regular_sizes(fd).values())
            total += max(used, int(writing.group(1))) if writing else used
            holding = True
    return total if holding else None


def last_touched(entry_fd: int) -> float:
    """When the entry or its lease last changed (the lease's mtime is its holder's heartbeat)."""
    touched = os.fstat(entry_fd).st_mtime
    with contextlib.suppress(OSError):
        touched = max(touched, os.stat(LEASE, dir_fd=entry_fd, follow_symlinks=False).st_mtime)
    return touched
