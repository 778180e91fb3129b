"""The pool's stdin and stdout as awaitable byte streams, read and written on threads.

asyncio's pipe transports refuse regular files (``readie pool < jobs.jsonl``)
and read ahead on their own; here each :meth:`FdReader.read` is exactly one
``os.read`` made when the engine asks, so when the engine stops asking (its
queue is full) the pool stops reading and the writer's pipe fills: that is
the spec's backpressure. Each :meth:`FdWriter.write` completes only once the
bytes are written, so a slow stdout reader holds the engine's permits.

The threads are daemons: a read blocked on a terminal or a write blocked on
a reader that went away must not keep the process alive once the engine is
done with them.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading
from collections.abc import Callable
from typing import Any

__all__ = ["READ_CHUNK_BYTES", "FdReader", "FdWriter"]

#: One read takes at most this much: a pipe's default capacity on Linux, so a
#: read empties a full pipe in one call, and what was read but not yet
#: accepted (the tail of a chunk) stays small next to the queue.
READ_CHUNK_BYTES = 64 * 1024


# A blocking function, the loop to answer in, and the future to settle there.
_Call = tuple[Callable[[], Any], asyncio.AbstractEventLoop, "asyncio.Future[Any]"]


class _FdThread:
    """One daemon thread running blocking calls in order, answering into the event loop."""

    def __init__(self, name: str) -> None:
        self._calls: queue.SimpleQueue[_Call] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._serve, name=name, daemon=True)
        self._thread.start()

    async def call(self, function: Callable[[], Any]) -> Any:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._calls.put((function, loop, future))
        return await future

    def _serve(self) -> None:
        while True:
            function, loop, future = self._calls.get()
            try:
                result, error = function(), None
            except BaseException as exc:  # noqa: BLE001 - raised again in the awaiting coroutine
                result, error = None, exc
            try:
                loop.call_soon_threadsafe(_settle, future, result, error)
            except RuntimeError:  # the loop is closed: nobody is waiting any more
                return


def _settle(future: asyncio.Future[Any], result: Any, error: BaseException | None) -> None:
    if future.done():  # the awaiting task was cancelled (a drain stopped intake)
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)


class FdReader:
    """``await read()`` returns the next bytes of ``fd``, ``b""`` at its end."""

    def __init__(self, fd: int, chunk: int = READ_CHUNK_BYTES) -> None:
        self._fd = fd
        self._chunk = chunk
        self._thread = _FdThread(f"readie-read-{fd}")

    async def read(self) -> bytes:
        data: bytes = await self._thread.call(lambda: os.read(self._fd, self._chunk))
        return data


class FdWriter:
    """``await write(data)`` returns once all of ``data`` is in ``fd``; raises OSError if not."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._thread = _FdThread(f"readie-write-{fd}")

    async def write(self, data: bytes) -> None:
        await self._thread.call(lambda: _write_all(self._fd, data))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
