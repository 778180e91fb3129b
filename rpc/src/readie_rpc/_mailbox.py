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
        self._changed = threading.Condition()

    def put(self, item: _T, timeout: float | None = None) -> bool:
        """Wait for room; False (and the item dropped) once the mailbox is closed or ``timeout`` passes."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or len(self._items) < self._bound, timeout)
            if self._closed or len(self._items) >= self._bound:
                return False
            self._items.append(item)
            self._changed.notify_all()
            return True

    def get(self, timeout: float | None = None, stop: Callable[[], bool] = lambda: False) -> _T | Closed | None:
        """The next item; CLOSED once closed and drained; None when ``timeout`` passes first, or
        when ``stop()`` holds (checked first, and again at each :meth:`wake`)."""
        with self._changed:
            if not self._changed.wait_for(lambda: stop() or self._closed or self._items, timeout) or stop():
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
