"""Cancellation: when the caller of some work is gone, the work stops and its sandbox is freed.

A gRPC call that is cancelled, or whose deadline passes, sets its
:class:`Cancellation` from grpc's termination callback. Whatever runs the
call's work registers, for as long as it runs, how to stop it at once
(:meth:`Cancellation.stopping`): the worker interrupts the sandbox's
exchange, a router cancels its own call to the worker. The work then ends
the ordinary way (the sandbox is destroyed as after any broken job), within
a second instead of at the job's timeout.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

__all__ = ["NEVER", "Cancellation"]


class Cancellation:
    """Set once; a stop registered with :meth:`stopping` runs when it is (at once if it was already)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._cancelled = False
        self._stops: list[Callable[[], None]] = []

    @property
    def cancelled(self) -> bool:
        return self._cancelled

    def cancel(self) -> None:
        """From any thread (grpc's callback thread, typically); a second call does nothing."""
        with self._lock:
            if self._cancelled:
                return
            self._cancelled = True
            stops = list(self._stops)
        for stop in stops:
            stop()

    @contextmanager
    def stopping(self, stop: Callable[[], None]) -> Iterator[None]:
        """While the block runs, a cancel calls ``stop``; ``stop`` must be safe from another thread."""
        with self._lock:
            cancelled = self._cancelled
            if not cancelled:
                self._stops.append(stop)
        if cancelled:
            stop()
        try:
            yield
        finally:
            with self._lock:
                if stop in self._stops:
                    self._stops.remove(stop)


class _Never(Cancellation):
    """For work nobody can cancel (an in-process caller that waits for its answer)."""

    def cancel(self) -> None:
        raise TypeError("NEVER is never cancelled; make a Cancellation of your own")


NEVER = _Never()
