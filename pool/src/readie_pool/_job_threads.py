"""Threads fed by a queue of their own, answering the loop through ``call_soon_threadsafe``.

What ``ThreadedBackend`` runs a job, a step or a file chunk on (decision 0033, "The hop into
the job thread"). ``loop.run_in_executor`` did the same with more parts: a
``concurrent.futures.Future`` and a work item per call, the executor's thread accounting, and
the future chained into an asyncio one. Here a call handed over (:meth:`JobThreads.submit`) is
on the queue when ``submit`` returns, so a waiting thread starts it at once, in the same turn of
the loop that handed it over (the caller need not be a task that has started yet); its answer
sets the asyncio future ``submit`` returned, through one ``call_soon_threadsafe``.

The threads start with the first call and end at :meth:`JobThreads.close`, which waits for
them: a call queued when it starts does not run, and is answered with a
:class:`~readie_worker.errors.PoolWorkerError`, as a call handed over after it is.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
from collections.abc import Callable
from typing import Any, TypeVar

from readie_worker.errors import PoolWorkerError

__all__ = ["JobThreads"]

_T = TypeVar("_T")

_SHUT = "the pool is shutting down; the job did not run"

# A call, the loop to answer on and the future to answer; None ends a thread.
_Item = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"] | None


class JobThreads:
    """``count`` threads named ``name``_N, taking calls in the order handed over."""

    def __init__(self, count: int, name: str) -> None:
        self._count = count
        self._name = name
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self.closed = False

    def submit(self, call: Callable[[], _T]) -> asyncio.Future[_T]:
        """On the loop: ``call`` is queued for a thread now; the future is its answer (or what it
        raised). PoolWorkerError once :meth:`close` has begun."""
        if self.closed:
            raise PoolWorkerError(_SHUT)
        loop = asyncio.get_running_loop()
        if not self._threads:
            self._start()
        answer: asyncio.Future[_T] = loop.create_future()
        self._queue.put((call, loop, answer))
        return answer

    def _start(self) -> None:
        for number in range(self._count):
            thread = threading.Thread(target=self._serve, name=f"{self._name}_{number}", daemon=True)
            thread.start()
            self._threads.append(thread)

    def _serve(self) -> None:
        while (item := self._queue.get()) is not None:
            call, loop, answer = item
            value: Any = None
            error: BaseException | None = None
            try:
                if self.closed:  # queued before close began: not run
                    raise PoolWorkerError(_SHUT)
                value = call()
            except BaseException as exc:  # the caller's to handle, as an executor's future carries it
                error = exc
            with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
                loop.call_soon_threadsafe(_settle, answer, value, error)
            del item, call, answer, value, error  # hold nothing while waiting for the next

    async def close(self) -> None:
        """Stop taking calls, answer the queued ones with PoolWorkerError, and wait for the threads
        (each finishes the call it runs). May be called more than once."""
        self.closed = True
        for _ in self._threads:
            self._queue.put(None)
        threads, self._threads = self._threads, []
        for thread in threads:
            await asyncio.to_thread(thread.join)


def _settle(answer: asyncio.Future[Any], value: Any, error: BaseException | None) -> None:
    if answer.cancelled():  # its task was cancelled (an abort gave up on it)
        return
    if isinstance(error, StopIteration):  # a future refuses it, and would stay unanswered for good
        error = RuntimeError(f"the call raised StopIteration: {error!r}")
    if error is not None:
        answer.set_exception(error)
    else:
        answer.set_result(value)
