"""A few threads serving many owners in turn, each owner at most a share of them at once.

The resolver forwards sandboxes' lookups upstream on blocking calls that can take seconds (an
upstream that does not answer, a zone whose servers never do). With one queue for all, a sandbox
that keeps lookups of such names in flight holds every thread, and every other sandbox's lookups
wait behind its queue past glibc's 5 s. Here each owner queues its own work; a free thread takes
the next owner in turn whose running work is below ``share``, so one owner holds at most
``share`` threads and another's next task waits for one turn, never for a queue.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable, Hashable

import structlog

__all__ = ["FairThreads"]

log = structlog.get_logger("readie.worker")


class FairThreads:
    """``threads`` threads (each first runs ``initializer``) taking owners' tasks in turn."""

    def __init__(self, threads: int, share: int, name: str, initializer: Callable[[], object] = lambda: None) -> None:
        if not 0 < share <= threads:
            raise ValueError(f"a share of 1 to {threads} threads, not {share}")
        self._share = share
        self._initializer = initializer
        self._ready = threading.Condition()
        self._tasks: dict[Hashable, deque[Callable[[], object]]] = {}
        self._turns: deque[Hashable] = deque()  # owners with tasks waiting, in turn order
        self._running: dict[Hashable, int] = {}
        self._closed = False
        self._serving = threads  # threads alive to serve: one that cannot start (its initializer failed) is not
        self._threads = [threading.Thread(target=self._serve, name=f"{name}-{index}", daemon=True) for index in range(threads)]
        for thread in self._threads:
            thread.start()

    def submit(self, owner: Hashable, task: Callable[[], object]) -> None:
        """Queue ``task`` as ``owner``'s; RuntimeError once closed, or with no thread left to run it."""
        with self._ready:
            if self._closed or not self._serving:
                raise RuntimeError("closed" if self._closed else "no thread could start")
            waiting = self._tasks.setdefault(owner, deque())
            if not waiting:
                self._turns.append(owner)
            waiting.append(task)
            self._ready.notify()

    def close(self) -> None:
        """Drop what waits, let what runs finish, and end the threads."""
        with self._ready:
            self._closed = True
            self._tasks.clear()
            self._turns.clear()
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()

    def _next(self) -> tuple[Hashable, Callable[[], object]] | None:
        """The next owner's next task, in turn, among owners below their share (under the lock)."""
        for _ in range(len(self._turns)):
            owner = self._turns.popleft()
            if self._running.get(owner, 0) >= self._share:
                self._turns.append(owner)
                continue
            waiting = self._tasks[owner]
            task = waiting.popleft()
            if waiting:
                self._turns.append(owner)
            else:
                del self._tasks[owner]
            self._running[owner] = self._running.get(owner, 0) + 1
            return owner, task
        return None

    def _serve(self) -> None:
        try:
            self._initializer()
        except Exception:  # this thread cannot serve (its namespace gone): the others do
            log.exception("a fair thread could not start")
            with self._ready:
                self._serving -= 1
                if not self._serving:  # what waits would never run: its owners hear so as they submit next
                    self._tasks.clear()
                    self._turns.clear()
            return
        while True:
            with self._ready:
                while (picked := None if self._closed else self._next()) is None:
                    if self._closed:
                        return
                    self._ready.wait()
            owner, task = picked
            try:
                task()
            except Exception:  # a task's own failure: the thread serves on
                log.exception("a task failed on a fair thread")
            finally:
                with self._ready:
                    left = self._running[owner] - 1
                    if left:
                        self._running[owner] = left
                    else:
                        del self._running[owner]
                    self._ready.notify()  # an owner at its share may take its turn again
