"""The hop into the job thread (decision 0033): the threaded backend's own threads, and intake handing
a job or a later session step to them before any task starts. No gVisor: a blocking runner.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import pytest
from readie_pool._backend import ThreadedBackend, _ThreadedSession
from readie_pool._engine import PoolEngine, PoolSetup
from readie_pool._events import RuntimeInfo
from readie_pool._job_threads import JobThreads
from readie_pool.testing import MemorySink, MemorySource, ok_outcome
from readie_worker.errors import PoolWorkerError
from readie_worker.sessions import StepOutcome

RUNTIME = RuntimeInfo.pool("3.11.2")
WAIT_S = 5.0


def _threads_named(prefix: str) -> list[str]:
    return [thread.name for thread in threading.enumerate() if thread.name.startswith(prefix)]


def test_a_call_runs_on_a_named_thread_and_its_answer_or_error_comes_back():
    async def main():
        threads = JobThreads(2, "test-jt-a")
        name = await threads.submit(lambda: threading.current_thread().name)
        with pytest.raises(ZeroDivisionError):
            await threads.submit(lambda: 1 / 0)
        await threads.close()
        return name

    assert asyncio.run(main()).startswith("test-jt-a_")
    assert _threads_named("test-jt-a") == []  # close joined them


def test_close_answers_a_queued_call_without_running_it_and_refuses_later_ones():
    ran: list[str] = []
    running, go = threading.Event(), threading.Event()

    async def main():
        threads = JobThreads(1, "test-jt-b")
        first = threads.submit(lambda: (running.set(), go.wait(WAIT_S), ran.append("first")))
        queued = threads.submit(lambda: ran.append("queued"))
        assert running.wait(WAIT_S)  # on its thread without a turn of the loop
        closing = asyncio.create_task(threads.close())
        await asyncio.sleep(0.05)
        go.set()
        await closing
        await first
        with pytest.raises(PoolWorkerError):
            await queued
        with pytest.raises(PoolWorkerError):
            threads.submit(lambda: ran.append("late"))

    asyncio.run(main())
    assert ran == ["first"] and _threads_named("test-jt-b") == []


def test_a_call_that_raises_stop_iteration_is_still_answered():
    # A future refuses StopIteration as its exception: set as it is, the call would never be answered.
    def stops():
        raise StopIteration("a runner's bug")

    async def main():
        threads = JobThreads(1, "test-jt-s")
        try:
            with pytest.raises(RuntimeError, match="StopIteration"):
                await asyncio.wait_for(threads.submit(stops), WAIT_S)
        finally:
            await threads.close()

    asyncio.run(main())


class _Runner:
    """Records, for each job and step, which task of the loop handed it to the backend."""

    def __init__(self) -> None:
        self.steps: list[str] = []

    def run_job(self, job, job_id=None, host=None, cancel=None, output=None):
        return ok_outcome(job.code)

    def open_session(self, job, job_id=None, host=None, cancel=None, output=None):
        runner = self

        class _Session:
            hibernated = False
            key = None
            id = "s"

            def __init__(self) -> None:
                self.job = job

            def run_step(self, step, *, job_id=None, host=None, cancel=None, output=None):
                runner.steps.append(step.code)
                return StepOutcome(ok_outcome(step.code), len(runner.steps) + 1, False)

            def close(self) -> None:
                pass

        return _Session(), StepOutcome(ok_outcome(job.code), 1, False)

    def close(self) -> None:
        pass


class _Recording(ThreadedBackend):
    def __init__(self, runner, slots: int) -> None:
        super().__init__(runner, slots)
        self.callers: dict[str, str] = {}

    def run(self, job, job_id, host=None, cancel=None, output=None, then=None):
        self.callers[job_id] = asyncio.current_task().get_name()
        return super().run(job, job_id, host, cancel=cancel, output=output, then=then)


@pytest.fixture
def step_callers(monkeypatch):
    callers: dict[str, str] = {}
    run_step = _ThreadedSession.run_step

    def recorded(self, step, job_id, *args, **kwargs):
        callers[job_id] = asyncio.current_task().get_name()
        return run_step(self, step, job_id, *args, **kwargs)

    monkeypatch.setattr(_ThreadedSession, "run_step", recorded)
    return callers


def _serve(
    tmp_path: Path, backend: ThreadedBackend, lines: list[dict], workers: int = 2, *, ran: bool = True
) -> list[dict]:
    (tmp_path / "app.py").write_text("print(1)\n")

    async def main():
        source, sink = MemorySource(), MemorySink()
        setup = PoolSetup(workers=workers, checkpoint="base", runtime=RUNTIME, cwd=tmp_path)
        serving = asyncio.create_task(PoolEngine(setup, backend).serve(source, sink))
        await asyncio.wait_for(sink.wait_for(1), WAIT_S)  # the ready line
        for line in lines:  # one at a time: each finds the slots free
            source.feed_lines(line)
            await asyncio.wait_for(sink.wait_for(len(sink.lines) + 1), WAIT_S)
        source.end()
        assert await asyncio.wait_for(serving, WAIT_S) == 0
        threads = list(backend._threads._threads)
        await backend.close()
        assert (bool(threads) is ran) and not any(thread.is_alive() for thread in threads)  # close joined them
        return sink.lines[1:]

    return asyncio.run(main())


def test_an_inline_job_goes_to_its_thread_from_intake_and_a_script_from_its_task(tmp_path):
    backend = _Recording(_Runner(), slots=2)
    results = _serve(tmp_path, backend, [{"id": "inline", "code": "print(2)"}, {"id": "script", "script": "app.py"}])
    assert [(line["id"], line["exit"]) for line in results] == [("inline", 0), ("script", 0)]
    assert backend.callers["inline"] == "readie-pool-intake"  # before any task of its own ran
    assert backend.callers["script"] != "readie-pool-intake"  # its script is read off the loop first


def test_a_later_step_goes_to_its_thread_from_intake(tmp_path, step_callers):
    runner = _Runner()
    lines = [{"id": "1", "session": "s", "code": "a = 1"}, {"id": "2", "session": "s", "code": "print(a)"}]
    results = _serve(tmp_path, ThreadedBackend(runner, slots=2), lines)
    assert [(line["id"], line["step"], line["stdout"]) for line in results] == [("1", 1, "a = 1"), ("2", 2, "print(a)")]
    assert step_callers == {"2": "readie-pool-intake"} and runner.steps == ["print(a)"]


def test_with_no_slot_free_a_job_waits_for_one_in_its_task(tmp_path):
    gate = threading.Event()

    class _Gated(_Runner):
        def run_job(self, job, job_id=None, host=None, cancel=None, output=None):
            if job.code == "wait":
                assert gate.wait(WAIT_S)
            return ok_outcome(job.code)

    backend = _Recording(_Gated(), slots=1)

    async def main():
        source, sink = MemorySource(), MemorySink()
        setup = PoolSetup(workers=1, checkpoint="base", runtime=RUNTIME, cwd=tmp_path)
        serving = asyncio.create_task(PoolEngine(setup, backend).serve(source, sink))
        source.feed_lines({"id": "held", "code": "wait"}, {"id": "next", "code": "print(3)"})
        await asyncio.sleep(0.1)
        assert "next" not in backend.callers  # no slot: not handed to the backend
        gate.set()
        await asyncio.wait_for(sink.wait_for(3), WAIT_S)
        source.end()
        assert await asyncio.wait_for(serving, WAIT_S) == 0
        await backend.close()
        return [line["id"] for line in sink.lines[1:]]

    assert asyncio.run(main()) == ["held", "next"]
    assert backend.callers == {"held": "readie-pool-intake", "next": backend.callers["next"]}
    assert backend.callers["next"] != "readie-pool-intake"


class _Refusing(_Runner):
    def run_job(self, job, job_id=None, host=None, cancel=None, output=None):
        if job.code == "refuse":
            raise PoolWorkerError("no worker")
        return ok_outcome(job.code)


def test_what_a_started_job_raises_and_a_bug_after_it_each_cost_one_line(tmp_path, monkeypatch):
    from readie_pool._tasks import PoolTasks

    count_host = PoolTasks.count_host

    def broken(self, outcome):
        if outcome.stdout == "bug":
            raise RuntimeError("a bug in the bookkeeping")
        count_host(self, outcome)

    monkeypatch.setattr(PoolTasks, "count_host", broken)
    lines = [{"id": "r", "code": "refuse"}, {"id": "b", "code": "bug"}, {"id": "ok", "code": "fine"}]
    results = _serve(tmp_path, _Recording(_Refusing(), slots=1), lines, workers=1)
    by_id = {line["id"]: line for line in results}
    assert by_id["r"]["error"]["type"] == "PoolWorkerError"
    assert by_id["b"]["error"]["message"] == "internal error (RuntimeError)"
    assert by_id["ok"]["stdout"] == "fine"  # and the one slot came back each time


def test_a_step_after_a_bug_in_its_sessions_bookkeeping_opens_a_new_session(tmp_path, monkeypatch):
    from readie_pool._tasks import PoolTasks

    count_host = PoolTasks.count_host

    def broken(self, outcome):
        if outcome.stdout == "bug":
            raise RuntimeError("a bug in the bookkeeping")
        count_host(self, outcome)

    monkeypatch.setattr(PoolTasks, "count_host", broken)
    lines = [{"id": n, "session": "s", "code": code} for n, code in (("1", "a = 1"), ("2", "bug"), ("3", "again"))]
    results = _serve(tmp_path, ThreadedBackend(_Runner(), slots=2), lines)
    assert [(line["id"], line.get("step")) for line in results] == [("1", 1), ("2", None), ("3", 1)]
    assert results[1]["error"]["message"] == "internal error (RuntimeError)"


def test_a_bug_building_a_job_intake_would_hand_over_is_answered_by_the_jobs_own_id(tmp_path, monkeypatch):
    # Intake gives the job to its task, which meets the bug again and answers it with its id
    # (an answer without one would leave the client waiting, and its cancel entry behind).
    import readie_pool._engine as engine

    def broken(setup, request):
        raise RuntimeError("a bug")

    monkeypatch.setattr(engine, "code_job_now", broken)
    monkeypatch.setattr(engine, "code_job", lambda setup, request: _raises(RuntimeError("a bug")))
    lines = [{"id": "b", "code": "print(1)"}, {"id": "c", "cancel": "b"}]
    results = _serve(tmp_path, ThreadedBackend(_Runner(), slots=2), lines, ran=False)
    assert (results[0]["id"], results[0]["error"]["type"]) == ("b", "PoolWorkerError")
    assert (results[1]["id"], results[1]["found"]) == ("c", False)


async def _raises(error: Exception):
    raise error
