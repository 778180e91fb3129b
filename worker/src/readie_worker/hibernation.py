"""Hibernated sessions' images, between a worker's sandboxes and its session store (decision 22, 32).

A session that hibernates (``sessions.py``) is checkpointed by runsc into a
fresh directory of the worker's own (``images/`` in its state dir: 0700, a
private dir no grant may reach, never the shared store: runsc runs as root
and must not be pointed at a path others can swap), and its sandbox ends;
the image is then copied into the session store (``session_store.py``) and
the private copy removed. A resume reads it back the other way: verified,
copied into a fresh private dir while hashed, restored from there, removed.
A fork is a second store entry sharing the image's files (hard links).

Bounds are the store's (bytes and entries, across every worker writing it);
a hibernation checks them against the sandbox's memory (about what the image
holds) before it checkpoints, so a session that would not fit goes on
instead of ending. A refusal is a SandboxSetupError: the store is full, not
the request wrong.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import structlog

from .errors import RequestError, SandboxSetupError
from .jobs import CodeJob
from .paths import remove_tree
from .sandbox import Sandbox
from .session_store import LeaseLost, SessionStore, StoredSession, StoreUnreadable

log = structlog.get_logger("readie.worker")

__all__ = ["SessionImages"]

_T = TypeVar("_T")
# Private image directory names: unguessable is not needed (nothing else writes here), unique is.
_NAME_BYTES = 8


class SessionImages:
    """One worker's way into its session store: ``store``, with ``scratch`` (an empty dir of the
    worker's own) for the images on their way in and out. ``shared``: the store outlives the
    worker (``--session-store``), so a drain hands its sessions over instead of ending them."""

    def __init__(self, store: SessionStore, scratch: Path, *, shared: bool) -> None:
        self.store = store
        self.scratch = scratch
        self.shared = shared

    def check_room(self, estimate: int, *, new_entry: bool = True) -> None:
        self.store.check_room(estimate, new_entry=new_entry)

    def write(
        self, key: str, sandbox: Sandbox, *, job: CodeJob, memory_limit: int | None, step: int, lease: str | None,
        save: Callable[[Sandbox, Path], None] = Sandbox.checkpoint,
    ) -> int:
        """Checkpoint ``sandbox`` (it ends, unless ``save`` keeps it running) and store its image under
        ``key`` as the holder of ``lease``; the image's bytes. Raises what the checkpoint raises, and
        SandboxSetupError when the store refuses it (LeaseLost: the entry is another holder's now)."""
        private = self._private()
        try:
            save(sandbox, private)
            return self.store.save(key, private, job=job, memory_limit=memory_limit, step=step, lease=lease)
        finally:
            remove_tree(private)

    def restore(self, key: str, prepared: Path | None, restore: Callable[[Path], _T]) -> _T:
        """``restore(image)`` from ``prepared`` (an image :meth:`prepare` copied at attach), else
        from the image stored under ``key``, prepared now; the private copy removed after.
        Raises as ``SessionStore.load``."""
        if prepared is None:
            _, prepared = self.prepare(key)
        try:
            return restore(prepared)
        finally:
            remove_tree(prepared)

    def prepare(self, key: str, check: Callable[[StoredSession], None] = lambda stored: None) -> tuple[StoredSession, Path]:
        """The session stored under ``key`` and a private dir holding its image, verified as it
        was copied there (the newest generation's, even if one was published meanwhile): the
        caller restores from it and removes it. ``check`` (raising) refuses the stored session."""
        private = self._private()
        try:
            stored = self.store.load_image(key, private)
            check(stored)
        except BaseException:
            remove_tree(private)
            raise
        return stored, private

    def fork(self, key: str, fork_key: str, step: int) -> StoredSession:
        """A new entry under ``fork_key`` sharing the image stored under ``key``."""
        stored = self.store.load(key)
        self.store.share(stored, fork_key, step)
        return stored

    def let_go(self, key: str, lease: str | None, *, keep: bool) -> None:
        """Let go of ``key``'s entry as the holder of ``lease``: ``keep`` its last good generation
        for a later attach (a detach, and a failed write: only the lease is released; an entry
        holding none is removed, there is nothing to continue), or remove it (a close). Nothing
        once the lease is another's (LeaseLost): the entry is the new holder's. A store that
        fails meanwhile (busy past its wait, a disk error) is logged, never raised: the session
        ends here all the same, and its entry, no longer leased, is swept once stale."""
        if lease is None:
            return
        try:
            if keep and self._stored(key):
                self.store.let_go(key)
            else:
                self.store.remove(key, lease=lease)
        except LeaseLost:
            pass
        except (SandboxSetupError, OSError) as exc:
            log.warning("a session's store entry could not be let go; a sweep will take it", error=str(exc))

    def _stored(self, key: str) -> bool:
        """Whether the store holds a generation of ``key`` that verifies, or may: one the machine
        could not read now is kept for an attach, never removed as if it held nothing."""
        try:
            self.store.load(key)
        except StoreUnreadable:
            return True
        except (RequestError, SandboxSetupError):
            return False
        return True

    def _private(self) -> Path:
        path = self.scratch / secrets.token_hex(_NAME_BYTES)
        path.mkdir(mode=0o700)
        return path
