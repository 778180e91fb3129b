"""The worker's slots: how many calls run at once, and draining, which refuses new ones.

A job, a session's step, a hibernation or an execute call holds one slot
for its whole run, so ``busy`` is a plain count that placement can trust.
"""

from __future__ import annotations

import threading
import time

from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import NotStarted
from .errors import Cancelled, SandboxSetupError

__all__ = ["SLOT_WAIT_POLL_S", "Slots"]

# A call waiting for a slot notices its cancellation this often.
SLOT_WAIT_POLL_S = 0.1


class Slots:
    """``count`` slots; :meth:`taken` holds one for the work under it."""

    def __init__(self, count: int) -> None:
        self.count = count
        self._free = threading.BoundedSemaphore(count)
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        self._busy = 0
        self._draining = False

    def taken(self, cancel: Cancellation = NEVER, wait_s: float | None = None, *, draining: bool = False) -> _SlotGuard:
        """A slot for the work under it; with ``wait_s``, SandboxSetupError when none frees up that soon.
        ``draining``: the drain's own work (handing sessions over), which a drain does not refuse."""
        return _SlotGuard(self, cancel, wait_s, draining)

    def state(self) -> tuple[int, bool]:
        """How many are busy, and whether they drain, read together."""
        with self._lock:
            return self._busy, self._draining

    def drain(self, grace_s: float) -> None:
        """Refuse new work, and wait (up to ``grace_s``) for the work under the slots to finish."""
        with self._lock:
            self._draining = True
            deadline = time.monotonic() + grace_s
            while self._busy and time.monotonic() < deadline:
                self._idle.wait(deadline - time.monotonic())


class _SlotGuard:
    def __init__(self, slots: Slots, cancel: Cancellation, wait_s: float | None = None, draining: bool = False) -> None:
        self._slots = slots
        self._draining = draining
        self._cancel = cancel
        self._deadline = None if wait_s is None else time.monotonic() + wait_s

    def __enter__(self) -> None:
        slots = self._slots
        with slots._lock:
            if slots._draining and not self._draining:
                # Before anything ran: the caller may send it elsewhere, and a session's step leaves
                # its session as it was (a drain hands it over).
                raise NotStarted("the worker is draining and takes no new work")
        while not slots._free.acquire(timeout=SLOT_WAIT_POLL_S):
            if self._cancel.cancelled:
                raise Cancelled("the call was cancelled while it waited for a slot")
            if self._deadline is not None and time.monotonic() > self._deadline:
                raise SandboxSetupError("no slot of this worker came free in time; nothing was done")
        with slots._lock:
            slots._busy += 1

    def __exit__(self, *exc: object) -> None:
        slots = self._slots
        with slots._lock:
            slots._busy -= 1
            slots._idle.notify_all()
        slots._free.release()
