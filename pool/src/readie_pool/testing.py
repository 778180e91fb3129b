"""Helpers for testing code that drives ``readie pool``, and the pool engine itself.

* :func:`pool_placement` runs a conformance suite both ways: the pool's
  own worker, or a router in front of two worker processes
  (:func:`readie_rpc.testing.start_cluster`).
* :class:`PoolProcess` runs the real ``readie pool`` over pipes: write
  requests, read results with a timeout, read its stderr log. Reading is
  explicit (nothing reads stdout behind your back), so a test can leave
  results unread and watch backpressure.
* :class:`FakeBackend`, :class:`MemorySource` and :class:`MemorySink` run a
  :class:`~readie_pool._engine.PoolEngine` in memory, without gVisor, with
  jobs (and session steps, :class:`FakeSession`, and their files) that
  finish when the test says so (``_fakes``). :func:`serve_stdio` runs the same engine over a process's stdin
  and stdout with any backend: a ``readie pool`` without sandboxes, for a
  client's tests.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Self

from readie_rpc.testing import start_cluster
from readie_policy.logs import configure_logging
from readie_worker.runsc import Runsc
from readie_worker.testing import readie_command

from ._events import RuntimeInfo
from ._fakes import FakeBackend, FakeSession, ok_outcome
from ._engine import PoolEngine
from ._setup import PoolSetup
from ._stdio import FdReader, FdWriter


__all__ = [
    "FakeBackend",
    "FakeSession",
    "MemorySink",
    "MemorySource",
    "PoolProcess",
    "ok_outcome",
    "pool_placement",
    "serve_stdio",
    "readie_command",
]

#: Long enough for the first restores of a worker's warm sandboxes on a busy two-core machine.
DEFAULT_READY_TIMEOUT_S = 60.0
DEFAULT_READ_TIMEOUT_S = 30.0


@contextmanager
def pool_placement(kind: str, base: Path, manifest: Path) -> Iterator[list[str]]:
    """The ``readie pool`` arguments that place its jobs the ``kind`` way: ``"local"`` (a worker
    in the pool's own process) or ``"router"`` (a two-worker :class:`Cluster` under ``base``,
    stopped and checked clean of containers afterwards). Lets one conformance suite run both ways."""
    if kind == "local":
        yield []
        return
    if kind != "router":
        raise ValueError(f"no placement called {kind!r}")
    cluster = start_cluster(base, manifest)
    try:
        yield ["--router", cluster.address]
    finally:
        cluster.stop()




class PoolProcess:
    """A ``readie pool`` child process with its stdin and stdout as pipes, stderr in a file."""

    def __init__(
        self,
        args: Iterable[str] = (),
        *,
        cwd: str | os.PathLike[str],
        stderr_path: str | os.PathLike[str],
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.stderr_path = Path(stderr_path)
        self._stderr = open(self.stderr_path, "wb")  # noqa: SIM115 - closed in close()
        self.process = subprocess.Popen(
            [*readie_command(), "pool", *args],
            cwd=cwd,
            env={**os.environ, **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
        )
        assert self.process.stdin is not None and self.process.stdout is not None
        self.stdin_fd = self.process.stdin.fileno()
        self.stdout_fd = self.process.stdout.fileno()
        self._buffer = bytearray()
        self._eof = False

    # -- writing

    def send(self, *requests: Mapping[str, Any]) -> None:
        self.send_raw(b"".join(json.dumps(r).encode() + b"\n" for r in requests))

    def send_raw(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            view = view[os.write(self.stdin_fd, view) :]

    def close_stdin(self) -> None:
        assert self.process.stdin is not None
        if not self.process.stdin.closed:
            self.process.stdin.close()

    # -- reading

    def read_line(self, timeout: float = DEFAULT_READ_TIMEOUT_S) -> bytes | None:
        """The next stdout line without its newline; None at EOF; TimeoutError past ``timeout``."""
        deadline = time.monotonic() + timeout
        while True:
            newline = self._buffer.find(b"\n")
            if newline >= 0:
                line = bytes(self._buffer[:newline])
                del self._buffer[: newline + 1]
                return line
            if self._eof:
                if self._buffer:
                    line, self._buffer = bytes(self._buffer), bytearray()
                    return line
                return None
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(f"no line from readie pool within {timeout} s")
            readable, _, _ = select.select([self.stdout_fd], [], [], remaining)
            if readable:
                chunk = os.read(self.stdout_fd, 1024 * 1024)
                if chunk:
                    self._buffer += chunk
                else:
                    self._eof = True

    def read(self, timeout: float = DEFAULT_READ_TIMEOUT_S) -> dict[str, Any]:
        line = self.read_line(timeout)
        if line is None:
            raise EOFError(f"readie pool closed stdout; stderr:\n{self.stderr_text()[-4000:]}")
        value: dict[str, Any] = json.loads(line)
        return value

    def ready(self, timeout: float = DEFAULT_READY_TIMEOUT_S) -> dict[str, Any]:
        event = self.read(timeout)
        if event.get("event") != "ready":
            raise AssertionError(f"expected the ready event first, got {event}")
        return event

    def results(self, count: int, timeout: float = DEFAULT_READ_TIMEOUT_S) -> list[dict[str, Any]]:
        """The next ``count`` lines, in the order the pool wrote them."""
        deadline = time.monotonic() + timeout
        return [self.read(max(0.01, deadline - time.monotonic())) for _ in range(count)]

    def run(
        self, request: Mapping[str, Any], timeout: float = DEFAULT_READ_TIMEOUT_S
    ) -> dict[str, Any]:
        """Send one request and return the next line (use when nothing else is in flight)."""
        self.send(request)
        return self.read(timeout)

    # -- stderr

    def stderr_text(self) -> str:
        return self.stderr_path.read_text(errors="replace")

    def job_logs(self) -> list[dict[str, Any]]:
        """The ``--log=json`` lines written so far."""
        lines = []
        for text in self.stderr_text().splitlines():
            if text.startswith('{"ts_ms"') and (line := json.loads(text)).get("event") == "job":
                lines.append(line)
        return lines

    # -- lifecycle

    def signal(self, signum: int = signal.SIGTERM) -> None:
        self.process.send_signal(signum)

    def wait(self, timeout: float = DEFAULT_READ_TIMEOUT_S) -> int:
        return self.process.wait(timeout)

    def close(self, timeout: float = DEFAULT_READ_TIMEOUT_S) -> int:
        """EOF on stdin, then every remaining line read and the exit status returned."""
        self.close_stdin()
        deadline = time.monotonic() + timeout
        while self.read_line(max(0.01, deadline - time.monotonic())) is not None:
            pass
        return self.finish(timeout)

    def finish(self, timeout: float = DEFAULT_READ_TIMEOUT_S) -> int:
        try:
            return self.process.wait(timeout)
        finally:
            if self.process.poll() is None:
                self.process.kill()
                self.process.wait()
            for stream in (self.process.stdin, self.process.stdout):
                if stream is not None and not stream.closed:
                    stream.close()
            self._stderr.close()

    def stop(self, timeout: float = DEFAULT_READ_TIMEOUT_S) -> int:
        """End the pool whatever state a test left it in, so it can clean up its sandboxes.

        EOF first (a graceful drain, its results read and dropped), then two
        SIGTERMs (stop running jobs), and SIGKILL only as the last resort: a
        killed pool leaves its sandboxes behind.
        """
        if self.process.poll() is None:
            self.close_stdin()
            for signum in (None, signal.SIGTERM, signal.SIGTERM):
                if signum is not None and self.process.poll() is None:
                    self.process.send_signal(signum)
                deadline = time.monotonic() + timeout / 3
                try:
                    while self.read_line(max(0.01, deadline - time.monotonic())) is not None:
                        pass
                    self.process.wait(max(0.01, deadline - time.monotonic()))
                    break
                except (TimeoutError, subprocess.TimeoutExpired):
                    continue
        try:
            return self.finish(0.01)
        except subprocess.TimeoutExpired:  # killed by finish()
            return self.process.returncode

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


# --------------------------------------------------------------------------- in memory


class MemorySource:
    """Bytes the test feeds with :meth:`feed`; :meth:`end` is EOF. Counts what was read."""

    def __init__(self) -> None:
        self._chunks: asyncio.Queue[bytes] = asyncio.Queue()
        self.reads = 0

    def feed(self, data: bytes) -> None:
        if data:
            self._chunks.put_nowait(data)

    def feed_lines(self, *requests: Mapping[str, Any]) -> None:
        for request in requests:
            self.feed(json.dumps(request).encode() + b"\n")

    def end(self) -> None:
        self._chunks.put_nowait(b"")

    @property
    def unread(self) -> int:
        return self._chunks.qsize()

    async def read(self) -> bytes:
        data = await self._chunks.get()
        self.reads += 1
        return data


class MemorySink:
    """Collects written lines; while ``open`` is clear, writes block (a client not reading)."""

    def __init__(self) -> None:
        self.lines: list[dict[str, Any]] = []
        self.open = asyncio.Event()
        self.open.set()
        self.fail: OSError | None = None
        self.written = asyncio.Condition()

    async def write(self, data: bytes) -> None:
        await self.open.wait()
        if self.fail is not None:
            raise self.fail
        assert data.endswith(b"\n") and data.count(b"\n") == 1, data
        async with self.written:
            self.lines.append(json.loads(data))
            self.written.notify_all()

    async def wait_for(self, count: int) -> list[dict[str, Any]]:
        async with self.written:
            await self.written.wait_for(lambda: len(self.lines) >= count)
        return self.lines


def serve_stdio(backend: Any, *, workers: int = 2, cwd: Path | None = None) -> int:
    """Serve the pool protocol on this process's stdin and stdout with the real engine and
    ``backend`` (a :class:`FakeBackend`, say); returns the engine's exit status at EOF."""
    configure_logging()  # on stderr, as readie pool's: stdout carries the protocol alone
    setup = PoolSetup(
        workers=workers,
        checkpoint="fake",
        runtime=RuntimeInfo.pool("3.11.2"),
        cwd=(cwd or Path.cwd()).resolve(),
    )

    async def serve() -> int:
        try:
            return await PoolEngine(setup, backend).serve(FdReader(0), FdWriter(1))
        finally:
            await backend.close()

    return asyncio.run(serve())


def containers_left(state_dir: Path) -> list[str]:
    """The runsc containers a stopped pool left in its ``--state-dir`` (none when it stopped
    clean), destroyed so that none outlives the test that asks."""
    if not state_dir.exists():
        return []
    left = Runsc(root=state_dir).list_ids()
    if left:
        Runsc(root=state_dir).sweep()
    return left
