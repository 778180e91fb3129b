"""Output callbacks: a job's output as it is written, for ``run(on_stdout=..., on_stderr=...)``.

A request with a callback asks the pool to stream (``"stream": true``); the
pool then sends output events ahead of the result, and each event's text is
handed to the callback of its stream, in order, on the thread (or, in
:class:`~readie.AsyncPool`, the task) that called ``run``. The result still
holds the whole output, so a callback is for watching, never for collecting.
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from readie_protocol.events import OutputEvent

from ._errors import ReadieError

__all__ = ["OutputCallback", "OutputCallbacks", "Waiter", "delivering"]

#: Takes one piece of text the job wrote; AsyncPool also awaits a coroutine function.
OutputCallback = Callable[[str], object] | Callable[[str], Awaitable[object]]


@dataclass(frozen=True, slots=True)
class OutputCallbacks:
    on_stdout: OutputCallback | None = None
    on_stderr: OutputCallback | None = None

    @classmethod
    def of(cls, on_stdout: OutputCallback | None, on_stderr: OutputCallback | None) -> OutputCallbacks | None:
        """The callbacks, checked; None when neither is given (the job does not stream)."""
        for name, callback in (("on_stdout", on_stdout), ("on_stderr", on_stderr)):
            if callback is not None and not callable(callback):
                raise TypeError(f"{name}: expected a callable, got {type(callback).__name__}")
        if on_stdout is None and on_stderr is None:
            return None
        return cls(on_stdout, on_stderr)

    def deliver(self, event: OutputEvent) -> object:
        """Call the callback of ``event``'s stream; its return value (an awaitable, in async code)."""
        callback = self.on_stdout if event.stream == "stdout" else self.on_stderr
        return None if callback is None else callback(event.data)

    async def deliver_async(self, event: OutputEvent) -> None:
        returned = self.deliver(event)
        if inspect.isawaitable(returned):
            await returned


_T = TypeVar("_T")
_ANSWERED = object()


class Waiter:
    """One caller's pending request: output events in order, then, once, the answer or an error.

    The reader thread puts, the caller's thread takes (:meth:`wait`), so an
    output callback runs on the caller's thread and a slow one slows only its
    own caller. What waits here is bounded by the pool: a job's output events
    carry at most its max_output per stream.
    """

    __slots__ = ("_events", "answer", "error", "callbacks")

    def __init__(self, callbacks: OutputCallbacks | None = None) -> None:
        self._events: queue.SimpleQueue[OutputEvent | object] = queue.SimpleQueue()
        self.callbacks = callbacks
        self.answer: Any = None
        self.error: ReadieError | None = None

    def set(self, answer: Any) -> None:
        self.answer = answer
        self._events.put(_ANSWERED)

    def fail(self, error: ReadieError) -> None:
        self.error = error
        self._events.put(_ANSWERED)

    def output(self, event: OutputEvent) -> None:
        self._events.put(event)

    def wait(self, deadline: float | None) -> bool:
        """Run the output callbacks until the answer is in; False when ``deadline`` passes first."""
        while True:
            timeout = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                event = self._events.get(timeout=timeout)
            except queue.Empty:
                return False
            if event is _ANSWERED:
                return True
            if self.callbacks is not None and isinstance(event, OutputEvent):
                self.callbacks.deliver(event)


async def delivering(answer: asyncio.Future[_T], outputs: asyncio.Queue[OutputEvent], callbacks: OutputCallbacks) -> _T:
    """Hand each output event to its callback until ``answer`` is in (the events all come before it)."""
    while not answer.done():
        taking = asyncio.ensure_future(outputs.get())
        try:
            await asyncio.wait({answer, taking}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            taking.cancel()
        if taking.done() and not taking.cancelled():
            await callbacks.deliver_async(taking.result())
    while not outputs.empty():
        await callbacks.deliver_async(outputs.get_nowait())
    return answer.result()
