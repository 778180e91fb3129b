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
  jobs (and session steps, :class:`FakeSession`) that finish when the test
  says so. :func:`serve_stdio` runs the same engine over a process's stdin
  and stdout with any backend: a ``readie pool`` without sandboxes, for a
  client's tests.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import select
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

from readie_worker.errors import ErrorType, PoolWorkerError, RequestError
from readie_protocol.cancel import NEVER, Cancellation
from readie_worker.jobs import (
    CANCELLED_MESSAGE,
    CodeJob,
    HostCall,
    HostFunction,
    HostReply,
    JobOutcome,
    OutputChunk,
    OutputSink,
    Step,
)
from readie_worker.sessions import StepOutcome
from readie_rpc.testing import start_cluster
from readie_policy.logs import configure_logging
from readie_worker.testing import readie_command

from ._events import RuntimeInfo
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


def ok_outcome(
    stdout: str = "", *, exit: int | None = 0, error: Any = None, duration_us: int = 1000
) -> JobOutcome:
    """A worker outcome for FakeBackend answers; by default a clean exit printing ``stdout``."""
    return JobOutcome(
        exit=exit,
        stdout=stdout,
        stderr="",
        stdout_truncated=False,
        stderr_truncated=False,
        error=error,
        duration_us=duration_us,
        python="3.11.2",
        preloaded_modules=(),
        sandbox_id="fake",
        backend="fake",
    )


@dataclass
class FakeBackend:
    """Runs no code: ``answer(job)`` gives each outcome (or raises), gates hold jobs back.

    A job whose ``code`` is a key of ``gates`` waits until that event is set.
    Session steps go through the same ``answer`` and gates; a step ends its
    session when ``session_ends(job)`` says so or it timed out.
    With a ``host``,
    a job first makes the calls ``host_calls(job)`` lists, one at a time on a
    thread (as the worker does, with the job's deadline set), then waits for
    its gate; ``replies`` keeps what each job id got back.
    """

    answer: Callable[[CodeJob], JobOutcome] = lambda job: ok_outcome(job.code)
    gates: dict[str, asyncio.Event] = field(default_factory=dict)
    started: list[CodeJob] = field(default_factory=list)
    running: int = 0
    most_running: int = 0
    closed: int = 0
    session_ends: Callable[[CodeJob], bool] = lambda job: job.code.startswith("exit")
    sessions: list[FakeSession] = field(default_factory=list)
    host_calls: Callable[[CodeJob], list[HostCall]] = lambda job: []
    replies: dict[str | None, list[HostReply]] = field(default_factory=dict)

    async def open_session(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> tuple[FakeSession, StepOutcome]:
        session = FakeSession(self, job)
        self.sessions.append(session)
        return session, await session.step(job, job_id, host, output, cancel)

    async def run(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> JobOutcome:
        if self.closed:
            raise PoolWorkerError("the pool is shutting down; the job did not run")
        self.started.append(job)
        self.running += 1
        self.most_running = max(self.most_running, self.running)
        try:
            if host is not None:
                deadline = time.monotonic() + job.timeout_ms / 1000
                for call in self.host_calls(job):
                    call = dataclasses.replace(call, deadline=deadline)
                    reply = await asyncio.to_thread(host, call)
                    self.replies.setdefault(job_id, []).append(reply)
            gate = self.gates.get(job.code)
            if gate is not None:
                while not gate.is_set():  # as a worker does: a cancel stops the job at once
                    if cancel.cancelled:
                        return JobOutcome.failure(ErrorType.POOL_WORKER, CANCELLED_MESSAGE, 0, "fake")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(gate.wait(), 0.01)
            outcome = self.answer(job)
            if output is not None:  # as a worker streams: what the result holds, ahead of it
                for stream, data in (("stdout", outcome.stdout), ("stderr", outcome.stderr)):
                    if data:
                        await asyncio.to_thread(output, OutputChunk(stream, data))
            return outcome
        finally:
            self.running -= 1

    async def close(self) -> None:
        self.closed += 1
        for gate in self.gates.values():
            gate.set()


@dataclass(eq=False)
class FakeSession:
    """A :class:`FakeBackend` session: each step is one of the backend's jobs, numbered."""

    backend: FakeBackend
    job: CodeJob
    steps: int = 0
    ended: bool = False
    closes: int = 0

    async def run_step(
        self, step: Step, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> StepOutcome:
        return await self.step(self.job.step(step), job_id, host, output, cancel)

    async def step(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> StepOutcome:
        if self.ended:
            raise RequestError("the session has ended", "session")
        outcome = await self.backend.run(job, job_id, host, cancel, output)
        self.steps += 1
        # As the worker's sessions: a step that did not end on its own (timeout, cancel) ends the session.
        timed_out = outcome.error is not None and getattr(outcome.error, "type", None) == ErrorType.TIMEOUT
        self.ended = self.backend.session_ends(job) or timed_out or outcome.exit is None
        return StepOutcome(outcome, self.steps, self.ended)

    async def close(self) -> None:
        self.closes += 1
        self.ended = True

    # A fake has no sandbox to checkpoint: hibernation is the real worker's (test_pool_hibernate).
    hibernated = False

    async def hibernate(self) -> float:
        raise RequestError("a FakeBackend session cannot hibernate", "session")

    async def fork(self) -> tuple[FakeSession, float]:
        raise RequestError("a FakeBackend session cannot fork", "session")


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
