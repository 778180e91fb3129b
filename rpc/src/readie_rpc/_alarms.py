"""One thread for every stream's watchdog in a process (``_interact_stream``).

A ``threading.Timer`` per step started and stopped a thread each time: about
0.5 ms of CPU on this project's two busy cores, paid by the pool and again by
the router on every step through a router (decision 0033). An :class:`Alarm`
here is an entry in a heap that one long-lived thread waits on.
"""

from __future__ import annotations

import heapq
import itertools
import math
import threading
import time
from collections.abc import Callable

import structlog

__all__ = ["Alarm", "after"]

log = structlog.get_logger("readie.grpc")


class Alarm:
    """``action`` due at ``due`` (monotonic seconds) unless :meth:`cancel` comes first."""

    __slots__ = ("action", "cancelled", "due")

    def __init__(self, due: float, action: Callable[[], None]) -> None:
        self.due = due
        self.action = action
        self.cancelled = False

    def cancel(self) -> None:
        _ALARMS.cancel(self)


class _Alarms:
    """The heap and its thread, started with the first alarm. Cancelled entries are dropped
    once they are half the heap, so it holds at most twice the alarms set and not yet cancelled
    (a stream sets one at a time: the heap is bounded by the streams a process serves)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Alarm]] = []
        self._order = itertools.count()  # equal due times: first set, first run; Alarms never compared
        self._cancelled = 0
        self._changed = threading.Condition()
        self._thread: threading.Thread | None = None
        # When the thread wakes next on its own: a new alarm due later needs no wake-up (each
        # step's watchdog is set and cancelled long before it is due; a wake-up each costs CPU).
        self._wakes_at = math.inf

    def after(self, seconds: float, action: Callable[[], None]) -> Alarm:
        alarm = Alarm(time.monotonic() + seconds, action)
        with self._changed:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="stream-alarms", daemon=True)
                self._thread.start()
            heapq.heappush(self._heap, (alarm.due, next(self._order), alarm))
            if alarm.due < self._wakes_at:
                self._changed.notify()
        return alarm

    def cancel(self, alarm: Alarm) -> None:
        with self._changed:
            if alarm.cancelled:
                return
            alarm.cancelled = True
            self._cancelled += 1
            if self._cancelled * 2 > len(self._heap):
                self._heap = [entry for entry in self._heap if not entry[2].cancelled]
                heapq.heapify(self._heap)
                self._cancelled = 0

    def _run(self) -> None:
        while True:
            with self._changed:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._wakes_at = self._heap[0][0] if self._heap else math.inf
                    self._changed.wait(self._wakes_at - time.monotonic() if self._heap else None)
                self._wakes_at = -math.inf  # running alarms: it looks at the heap again before it waits
                _, _, alarm = heapq.heappop(self._heap)
                if alarm.cancelled:
                    self._cancelled -= 1
                    continue
                alarm.cancelled = True  # it ran: a later cancel() does nothing
            try:
                alarm.action()  # outside the lock: an action may set or cancel alarms
            except Exception:  # noqa: BLE001 - one action's failure must not stop every other stream's
                log.exception("a stream's alarm failed")


_ALARMS = _Alarms()


def after(seconds: float, action: Callable[[], None]) -> Alarm:
    """Call ``action`` (quick, never blocking: it runs on the one alarm thread) in ``seconds``."""
    return _ALARMS.after(seconds, action)
