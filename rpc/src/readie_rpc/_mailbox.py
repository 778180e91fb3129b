"""A bounded mailbox one side can close: the Interact stream's inbox and outbox (``_interact``)."""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

__all__ = ["CLOSED", "Closed", "Mailbox"]

_T = TypeVar("_T")


class Closed:
    """What a closed, empty mailbox gives instead of an item."""


CLOSED = Closed()


class Mailbox(Generic[_T]):
    """A bounded queue one side can close: puts then fail, gets drain what is left, then CLOSED."""

    def __init__(self, bound: int) -> None:
        self._items: deque[_T] = deque()
        self._bound = bound
        self._closed = False
        self._getters = 0  # threads waiting in get() for an item
        self._changed = threading.Condition()

    def put(self, item: _T, timeout: float | None = None, *, taken_next: Callable[[_T], None] | None = None) -> bool:
        """Wait for room; False (and the item dropped) once the mailbox is closed or ``timeout`` passes.

        ``taken_next`` is called with ``item``, under the mailbox's lock, when a :meth:`get` waits
        for it with nothing ahead: the waiting thread has taken every earlier item, and this is the
        next it gets (unless a ``close(discard=True)`` comes first). It must not block.
        """
        with self._changed:
            self._changed.wait_for(lambda: self._closed or len(self._items) < self._bound, timeout)
            if self._closed or len(self._items) >= self._bound:
                return False
            if taken_next is not None and self._getters and not self._items:
                taken_next(item)
            self._items.append(item)
            self._changed.notify_all()
            return True

    def get(self, timeout: float | None = None, stop: Callable[[], bool] = lambda: False) -> _T | Closed | None:
        """The next item; CLOSED once closed and drained; None when ``timeout`` passes first, or
        when ``stop()`` holds (checked first, and again at each :meth:`wake`)."""
        with self._changed:
            self._getters += 1
            try:
                ready = self._changed.wait_for(lambda: stop() or self._closed or self._items, timeout)
            finally:
                self._getters -= 1
            if not ready or stop():
                return None
            if not self._items:
                return CLOSED
            item = self._items.popleft()
            self._changed.notify_all()
            return item

    def wake(self) -> None:
        """Wake a :meth:`get` whose ``stop`` condition may hold now."""
        with self._changed:
            self._changed.notify_all()

    def close(self, discard: bool = False) -> None:
        """Refuse further puts; with ``discard``, drop what is waiting too."""
        with self._changed:
            self._closed = True
            if discard:
                self._items.clear()
            self._changed.notify_all()
