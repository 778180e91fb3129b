"""Leases on a session store's entries: which worker holds a session live (decision 32).

A lease is the file ``lease`` in the session's entry: the holder's token
(its worker id and a random part, one per holding) as its text, and its
mtime as the heartbeat. One thread per store (:class:`LeaseKeeper`) touches
every lease this worker holds every :data:`LEASE_HEARTBEAT_S`; a lease not
touched for :data:`LEASE_STALE_S` is stale, and anyone may take it. The same
beat reads each lease back: one whose text is no longer its holder's was
taken (an attach with ``take_over``, or after a stall made it stale), and
the holder is told, so that it ends its copy without writing to the entry.

Taking and giving up a lease happen under the store's lock (``session_store``):
two workers never both think they took it.
"""

from __future__ import annotations

import hmac
import os
import re
import secrets
import threading
import time
from collections.abc import Callable

import structlog

from ._store_files import UnsafeFile, opened_dir, read_bounded
from .errors import SandboxSetupError

__all__ = [
    "LEASE", "LEASE_HEARTBEAT_S", "LEASE_STALE_S", "MAX_LEASE_BYTES", "UNREADABLE_HOLDER", "LeaseKeeper", "LeaseLost",
    "NoImage", "check_lease", "lease_state", "new_token", "take_lease", "worker_of", "write_lease",
]

log = structlog.get_logger("readie.worker")

LEASE = "lease"
# A holder touches its leases this often; well under the stale limit so that a loaded host's
# late beat (a second or two behind) does not make a live session look abandoned.
LEASE_HEARTBEAT_S = 2.0
# Five beats missed: the holder is gone (killed, or its host stalled that long), and an attach
# takes the session without waiting for it.
LEASE_STALE_S = 10.0
# A token is a worker id and a random hex part: well under this.
MAX_LEASE_BYTES = 512
# What a token may hold: the lease file is unauthenticated (anyone who can write the volume can
# write it), so any other text is never shown or logged as it is, only as UNREADABLE_HOLDER.
TOKEN = re.compile(r"[A-Za-z0-9.:_/-]{1,%d}" % MAX_LEASE_BYTES)
UNREADABLE_HOLDER = "?"


class LeaseLost(SandboxSetupError):
    """This worker no longer holds the session's lease (another took it over, or it went stale):
    nothing was written to or removed from the entry, which is the new holder's."""


class NoImage(Exception):
    """An attach's entry is missing or holds no stored generation (``take_lease``)."""


def lease_state(entry_fd: int, now: float) -> tuple[str | None, bool]:
    """The holder's token of the entry's lease (None: no lease, or not a file; UNREADABLE_HOLDER:
    text no token has), and whether it is live. An OSError (the machine's: ``_store_files``) is
    raised: it says nothing of the lease, and taking it for none would take a live holder's."""
    try:
        text = read_bounded(entry_fd, LEASE, MAX_LEASE_BYTES).decode("ascii", "replace")
        mtime = os.stat(LEASE, dir_fd=entry_fd, follow_symlinks=False).st_mtime
    except (UnsafeFile, FileNotFoundError):  # FileNotFoundError: let go between the read and the stat
        return None, False
    return (text if TOKEN.fullmatch(text) else UNREADABLE_HOLDER), now - mtime < LEASE_STALE_S


def new_token(worker: str) -> str:
    """A new holding's token: ``worker`` (what a token may not hold made ``_``) and a random part."""
    return f"{re.sub(r'[^A-Za-z0-9.:_-]', '_', worker)[:64]}/{secrets.token_hex(8)}"


def write_lease(entry_fd: int, token: str) -> None:
    """Make ``token`` the entry's lease, at once (a temporary file renamed over it)."""
    temporary = f".{LEASE}-{token[-16:]}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=entry_fd)
    try:
        os.write(fd, token.encode())
    finally:
        os.close(fd)
    os.rename(temporary, LEASE, src_dir_fd=entry_fd, dst_dir_fd=entry_fd)


def take_lease(root_fd: int, entry: str, token: str, *, take_over: bool,
               holds_image: Callable[[int], bool] | None) -> str | None:
    """Make ``token`` the entry's lease unless another holder's is live: None, or that holder.
    ``holds_image`` (an attach; given the entry's descriptor): an entry holding no stored generation
    is no session to attach, and its lease, a live holder's above all, is left alone (NoImage).
    Call under the store's lock."""
    try:
        with opened_dir(entry, root_fd) as entry_fd:
            if holds_image is not None and not holds_image(entry_fd):
                raise NoImage(entry)
            holder, live = lease_state(entry_fd, time.time())
            if live and not take_over:
                return holder or UNREADABLE_HOLDER
            write_lease(entry_fd, token)
            return None
    except UnsafeFile:  # gone (closed meanwhile), or never there
        raise NoImage(entry) from None


def check_lease(root_fd: int, entry: str, token: str) -> None:
    """LeaseLost unless ``token`` is the entry's lease on disk now (call under the store's lock)."""
    try:
        with opened_dir(entry, root_fd) as entry_fd:
            holder, _ = lease_state(entry_fd, time.time())
    except UnsafeFile:
        holder = None
    if holder is None or not hmac.compare_digest(holder, token):
        raise LeaseLost("this worker no longer holds the session's store entry")


def worker_of(token: str | None) -> str | None:
    """The worker part of a lease's token."""
    return None if token is None else token.rpartition("/")[0] or token


class LeaseKeeper:
    """The leases one store's worker holds, and the thread that keeps them fresh."""

    def __init__(self, root_fd: int, sweep: Callable[[], None], sweep_every_s: float) -> None:
        self._root_fd = root_fd
        self._sweep = sweep  # the store's TTL sweep, run from the same thread now and then
        self._sweep_every_s = sweep_every_s
        self._lock = threading.Lock()
        self._held: dict[str, tuple[str, Callable[[], None]]] = {}  # entry -> (token, on_lost)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name="readie-store-leases", daemon=True)
        self._thread.start()

    def hold(self, entry: str, token: str, on_lost: Callable[[], None]) -> None:
        """Keep ``token``'s lease of ``entry``; a holding of this worker's it replaces is told."""
        with self._lock:
            replaced = self._held.get(entry)
            self._held[entry] = (token, on_lost)
        if replaced is not None and replaced[0] != token:
            replaced[1]()

    def token(self, entry: str) -> str | None:
        with self._lock:
            held = self._held.get(entry)
        return held[0] if held else None

    def forget(self, entry: str) -> str | None:
        """Stop keeping ``entry``'s lease; the token it had, if this worker held it."""
        with self._lock:
            held = self._held.pop(entry, None)
        return held[0] if held else None

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def beat_now(self) -> None:
        """Touch every held lease once, and tell the holders whose lease was taken."""
        with self._lock:
            held = dict(self._held)
        for entry, holding in held.items():
            token, on_lost = holding
            if self._touch(entry, token):
                continue
            with self._lock:
                if self._held.get(entry) is not holding:
                    # Let go (or held anew) since the copy above: its lease is gone because this
                    # worker gave it up, not because another holder took it.
                    continue
                del self._held[entry]
            log.warning("a session's lease was taken by another holder; this copy ends", entry=entry[:16])
            on_lost()

    def _touch(self, entry: str, token: str) -> bool:
        """Whether ``token`` is still the lease of ``entry`` (touched now). A touch the machine
        failed (not the entry: ``_store_files``) is no loss: the next beat tries again, and a lease
        it left to go stale is found taken then."""
        try:
            with opened_dir(entry, self._root_fd) as entry_fd:
                text, _ = lease_state(entry_fd, time.time())
                if text != token:
                    return False
                os.utime(LEASE, dir_fd=entry_fd, follow_symlinks=False)
                return True
        except UnsafeFile:
            return False
        except OSError as exc:
            log.warning("a session's lease could not be touched; trying again at the next beat", entry=entry[:16], error=exc.strerror)
            return True

    def _beat(self) -> None:
        swept = time.monotonic()
        while not self._stop.wait(LEASE_HEARTBEAT_S):
            try:
                self.beat_now()
                if time.monotonic() - swept >= self._sweep_every_s:
                    swept = time.monotonic()
                    self._sweep()
            except Exception:  # never the end of the beat: a lease not kept is a session lost
                log.exception("the session store's lease beat failed")
