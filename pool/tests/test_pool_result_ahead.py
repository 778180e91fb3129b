"""Result lines written by their job thread (decision 0033): the engine on real pipes. No gVisor.

A job's or a later session step's result goes out from the thread that ran it
when it can (``PoolTasks.ahead_for``); the loop does the rest afterwards, and
no line the client sends after reading that result is taken before the loop
has: these tests hold the loop's part back and check what a quick client sees.
"""

from __future__ import annotations

import asyncio
import json
import os
import select
import threading
from pathlib import Path

import pytest
from readie_pool._backend import ThreadedBackend
from readie_pool._engine import PoolEngine, PoolSetup
from readie_pool._events import RuntimeInfo
from readie_pool._stdio import FdReader, FdWriter
from readie_pool.testing import FakeBackend, FakeSession, ok_outcome
from readie_protocol.cancel import NEVER
from readie_worker.errors import SandboxSetupError

RUNTIME = RuntimeInfo.pool("3.11.2")
READ_TIMEOUT_S = 5.0
HOLD_S = 10.0  # the longest a test holds the loop: longer than it waits to read a line


class PipePool:
    """A pool engine serving two pipes on a thread of its own; the test is its client."""

    def __init__(self, backend, cwd: Path, workers: int = 2, writer=FdWriter) -> None:
        self._to_pool, self._pool_in = _pipe()
        self._from_pool, self._pool_out = _pipe()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.code: int | None = None
        self._buffer = b""
        started = threading.Event()
        setup = PoolSetup(workers=workers, checkpoint="base", runtime=RUNTIME, cwd=cwd)

        async def serve() -> int:
            self.loop = asyncio.get_running_loop()
            started.set()
            return await PoolEngine(setup, backend).serve(FdReader(self._to_pool), writer(self._pool_out))

        def run() -> None:
            self.code = asyncio.run(serve())

        self._thread = threading.Thread(target=run, daemon=True)
        self._thread.start()
        assert started.wait(READ_TIMEOUT_S)
        assert self.read()["event"] == "ready"

    def send(self, **request) -> None:
        os.write(self._pool_in, json.dumps(request).encode() + b"\n")

    def read(self, timeout: float = READ_TIMEOUT_S) -> dict | None:
        while b"\n" not in self._buffer:
            if not select.select([self._from_pool], [], [], timeout)[0]:
                return None
            self._buffer += os.read(self._from_pool, 65536)
        line, self._buffer = self._buffer.split(b"\n", 1)
        return json.loads(line)

    def on_loop(self, callback) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(callback)

    def close(self) -> int | None:
        os.close(self._pool_in)
        self._thread.join(READ_TIMEOUT_S)
        for fd in (self._to_pool, self._pool_out, self._from_pool):
            os.close(fd)
        return self.code


def _pipe() -> tuple[int, int]:
    read_end, write_end = os.pipe()
    return read_end, write_end


class _BlockingRunner:
    """A blocking runner whose job, once done, blocks the event loop until the test lets it go:
    a line that reaches the client meanwhile was written by the job's thread."""

    def __init__(self) -> None:
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loop_blocked = threading.Event()
        self.release = threading.Event()

    def run_job(self, job, job_id=None, host=None, cancel=None, output=None):
        if job.code == "hold the loop":
            assert self.loop is not None
            self.loop.call_soon_threadsafe(self._block)
            assert self.loop_blocked.wait(READ_TIMEOUT_S)
        return ok_outcome(job.code if job.code != "big" else "x" * 8192)

    def _block(self) -> None:
        self.loop_blocked.set()
        self.release.wait(HOLD_S)

    def close(self) -> None:
        pass


def test_a_jobs_result_is_written_by_its_thread_while_the_loop_is_busy(tmp_path):
    runner = _BlockingRunner()
    pool = PipePool(ThreadedBackend(runner, slots=2), tmp_path)
    runner.loop = pool.loop
    try:
        pool.send(id="a", code="hold the loop")
        line = pool.read(timeout=2.0)  # the loop is held for longer (HOLD_S)
        assert line is not None and runner.loop_blocked.is_set()
        assert (line["id"], line["exit"], line["stdout"]) == ("a", 0, "hold the loop")
    finally:
        runner.release.set()
    # A line too long to be written whole at once goes the loop's way, as before.
    pool.send(id="b", code="big")
    assert pool.read()["stdout"] == "x" * 8192
    assert pool.close() == 0


class _LateBackend(FakeBackend):
    """Writes a result line (``then``) as soon as its job is done, and hands the outcome back to
    the loop only once ``late`` is set: a slow hop from the job thread to the loop."""

    def __init__(self) -> None:
        super().__init__(session_ends=lambda job: job.code == "exit()")
        self.late = asyncio.Event()

    async def run(self, job, job_id, host=None, cancel=NEVER, output=None, then=None):
        outcome = await super().run(job, job_id, host, cancel, output, then)
        if then is not None:
            await self.late.wait()
        return outcome

    async def open_session(self, job, job_id, host=None, output=None, cancel=NEVER):
        session = _LateSession(self, job)
        self.sessions.append(session)
        return session, await session.step(job, job_id, host, output, cancel)


class _LateSession(FakeSession):
    async def run_step(self, step, job_id, host=None, output=None, cancel=NEVER, then=None):
        outcome = await super().run_step(step, job_id, host, output, cancel, then)
        if then is not None:
            await self.backend.late.wait()
        return outcome


def _let_go(pool: PipePool, backend: _LateBackend) -> None:
    pool.on_loop(backend.late.set)


@pytest.fixture
def late(tmp_path):
    backend = _LateBackend()
    pool = PipePool(backend, tmp_path)
    yield pool, backend
    pool.on_loop(backend.late.set)
    assert pool.close() == 0


def test_a_line_read_after_a_thread_written_result_waits_for_its_bookkeeping(late):
    pool, backend = late
    pool.send(id="job", code="print(1)")
    assert pool.read()["id"] == "job"  # written ahead: the loop has not counted it yet
    pool.send(id="stats", stats=True)
    assert pool.read(timeout=0.3) is None  # held until the loop has
    _let_go(pool, backend)
    stats = pool.read()
    assert (stats["id"], stats["jobs"]) == ("stats", 1)


def test_a_step_that_ends_its_session_ends_it_before_the_next_step_under_its_name_is_taken(late):
    pool, backend = late
    pool.send(id="1", session="s", code="x = 1")
    assert pool.read()["step"] == 1
    pool.send(id="2", session="s", code="exit()")
    ended = pool.read()
    assert (ended["id"], ended["session_ended"]) == ("2", True)
    pool.send(id="3", session="s", code="x")  # the client's next step, at once: a new session
    assert pool.read(timeout=0.3) is None
    _let_go(pool, backend)
    again = pool.read()
    assert (again["id"], again["exit"], again["step"], again["session_ended"]) == ("3", 0, 1, False)
    assert len(backend.sessions) == 2


def test_a_streaming_job_leaves_its_result_to_the_loop_behind_its_output(late):
    pool, _ = late
    pool.send(id="out", code="streamed", stream=True)
    lines = [pool.read() for _ in range(2)]
    assert [line.get("event", "result") for line in lines] == ["output", "result"]


def test_a_bug_after_the_thread_wrote_the_line_costs_no_second_line(late, monkeypatch):
    from readie_pool._tasks import PoolTasks

    pool, backend = late
    _let_go(pool, backend)

    def broken(self, outcome):
        raise RuntimeError("a bug in the bookkeeping")

    monkeypatch.setattr(PoolTasks, "count_host", broken)
    pool.send(id="a", code="print(1)")
    assert (pool.read()["id"], pool.read(timeout=0.3)) == ("a", None)
    pool.send(id="stats", stats=True)  # intake is not stuck behind the written line
    assert (pool.read() or {}).get("jobs") == 1


class _FailingOnce(FdWriter):
    """stdout whose first thread write of a result raises (a MemoryError, say), not only refuses."""

    failed = False

    def write_now(self, data: bytes) -> bool:
        if not _FailingOnce.failed and b'"exit"' in data:
            _FailingOnce.failed = True
            raise MemoryError
        return super().write_now(data)


def test_a_thread_write_that_raises_leaves_the_line_to_the_loop_and_intake_reading(tmp_path):
    # The write was counted (written_ahead) before it raised: uncounted again, or intake would
    # wait for it for good; the job's answer is its own result, once.
    pool = PipePool(ThreadedBackend(_BlockingRunner(), slots=2), tmp_path, writer=_FailingOnce)
    pool.send(id="a", code="a")
    answer = pool.read()
    assert (answer["id"], answer["exit"], answer["stdout"]) == ("a", 0, "a") and _FailingOnce.failed
    pool.send(id="stats", stats=True)
    stats = pool.read()
    assert (stats["id"], stats["jobs"], pool.read(timeout=0.3)) == ("stats", 1, None)
    assert pool.close() == 0


class _AnswersThenFails:
    """A runner that takes ``then`` itself, as the local worker does, and fails after calling it
    (its own bookkeeping, say a session store whose lock stayed busy)."""

    def run_job(self, job, job_id=None, host=None, cancel=None, output=None, then=None):
        outcome = ok_outcome(job.code)
        then(outcome)
        if job.code == "then fail":
            raise SandboxSetupError("the session store's lock was busy")
        return outcome

    def close(self) -> None:
        pass


class _EarlyBackend(ThreadedBackend):
    def _job_call(self, job, job_id, host, cancel, output, then):
        return lambda: self.runner.run_job(job, job_id, host, cancel=cancel, output=output, then=then)


def test_a_runner_that_fails_after_its_answer_was_written_costs_no_second_line(tmp_path):
    pool = PipePool(_EarlyBackend(_AnswersThenFails(), slots=2), tmp_path)
    pool.send(id="a", code="then fail")
    answer = pool.read()
    assert (answer["id"], answer["exit"], answer["error"], pool.read(timeout=0.3)) == ("a", 0, None, None)
    pool.send(id="stats", stats=True)  # intake is not stuck behind the written line
    stats = pool.read()
    assert (stats["id"], stats["jobs"], stats["ok"], pool.read(timeout=0.3)) == ("stats", 1, 1, None)
    assert pool.close() == 0
