"""The pool's stdin and stdout as awaitable byte streams, read and written on threads.

asyncio's pipe transports refuse regular files (``readie pool < jobs.jsonl``)
and read ahead on their own; here each :meth:`FdReader.read` is exactly one
``os.read`` made when the engine asks, so when the engine stops asking (its
queue is full) the pool stops reading and the writer's pipe fills: that is
the spec's backpressure. Each :meth:`FdWriter.write` completes only once the
bytes are written, so a slow stdout reader holds the engine's permits.

The threads are daemons: a read blocked on a terminal or a write blocked on
a reader that went away must not keep the process alive once the engine is
done with them. A pipe needs no thread (decision 0033): the event loop says
when it is readable, and then one read cannot block; or writable, and then a
write of at most ``PIPE_BUF`` bytes cannot either (the kernel has a free
page for it). That saves every line two thread hand-offs, in and out.
:meth:`FdWriter.write_now` writes such a line from any thread (a host call's or a result's,
from its job's thread), never inside a line :meth:`FdWriter.write` is writing.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import queue
import select
import stat
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
    """``await read()`` returns the next bytes of ``fd``, ``b""`` at its end.

    A pipe stays in the loop's selector from one read to the next (the engine
    asks again at once, most of the time), and leaves it the first time it is
    readable while no read waits: a pipe nobody asks to read is not watched,
    so backpressure holds and the loop does not spin on it.
    """

    def __init__(self, fd: int, chunk: int = READ_CHUNK_BYTES) -> None:
        self._fd = fd
        self._chunk = chunk
        self._thread = None if _is_pipe(fd) else _FdThread(f"readie-read-{fd}")
        self._watched: asyncio.AbstractEventLoop | None = None  # the loop whose selector holds fd
        self._ready: asyncio.Future[None] | None = None  # the read waiting for fd to be readable
        self._data = select.poll()  # whether a read would block (POLLHUP at the end counts: it reads b"")
        self._data.register(fd, select.POLLIN)

    async def read(self) -> bytes:
        if self._thread is not None:
            data: bytes = await self._thread.call(lambda: os.read(self._fd, self._chunk))
            return data
        loop = asyncio.get_running_loop()
        # Asked again: a readiness the selector reported before the last read may reach this wait
        # (its callback was queued behind the read), so the pipe itself says whether a read can block.
        while not self._data.poll(0):
            self._ready = loop.create_future()
            if self._watched is not loop:
                loop.add_reader(self._fd, self._readable)
                self._watched = loop
            try:
                await self._ready
            except BaseException:
                self._unwatch()
                raise
            finally:
                self._ready = None
        return os.read(self._fd, self._chunk)

    def _readable(self) -> None:
        if self._ready is None:  # nobody asks: stop watching until someone does
            self._unwatch()
        elif not self._ready.done():  # done: its read is about to happen
            self._ready.set_result(None)

    def _unwatch(self) -> None:
        if self._watched is not None:
            with contextlib.suppress(RuntimeError):  # its loop is closed already
                self._watched.remove_reader(self._fd)
            self._watched = None


class FdWriter:
    """``await write(data)`` returns once all of ``data`` is in ``fd``; raises OSError if not."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._thread = None if _is_pipe(fd) else _FdThread(f"readie-write-{fd}")
        self._room = select.poll()  # poll, not select: any descriptor number
        self._room.register(fd, select.POLLOUT)
        # write_now's, apart: one poll object must not be polled by two threads at once.
        self._room_now = select.poll()
        self._room_now.register(fd, select.POLLOUT)
        self._lock = threading.Lock()  # a line is written whole: by write (the loop's) or write_now
        self._busy = False  # write has begun a line it has not finished

    async def write(self, data: bytes) -> None:
        if self._thread is not None:
            await self._thread.call(lambda: _write_all(self._fd, data))
            return
        loop = asyncio.get_running_loop()
        view = memoryview(data)
        with self._lock:
            self._busy = True
        try:
            while view:
                if not self._room.poll(0):  # the reader is behind: wait for room
                    await _when_ready(loop.add_writer, loop.remove_writer, self._fd)
                view = view[os.write(self._fd, view[: select.PIPE_BUF]) :]
        finally:
            with self._lock:
                self._busy = False

    def write_now(self, data: bytes) -> bool:
        """From any thread: write ``data`` whole at once if that cannot block nor split a line
        :meth:`write` is writing (a pipe with room, at most ``PIPE_BUF`` bytes: the kernel writes
        those whole); False, and nothing written, otherwise or when the write fails."""
        if self._thread is not None or len(data) > select.PIPE_BUF:
            return False
        with self._lock:
            if self._busy or not self._room_now.poll(0):
                return False
            try:
                os.write(self._fd, data)  # all of it: a pipe with room takes PIPE_BUF bytes whole
            except OSError:  # the loop's write meets it too, and says so
                return False
        return True


def _is_pipe(fd: int) -> bool:
    return stat.S_ISFIFO(os.fstat(fd).st_mode)


async def _when_ready(add: Callable[..., None], remove: Callable[[int], object], fd: int) -> None:
    """Until the loop's selector says ``fd`` is ready (``add``: the loop's add_reader or add_writer)."""
    ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
    add(fd, lambda: ready.done() or ready.set_result(None))
    try:
        await ready
    finally:
        remove(fd)


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
