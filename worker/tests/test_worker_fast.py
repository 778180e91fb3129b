"""The Worker's own lifecycle on a launcher that fails on demand: slots, a failed start, the drain,
session places. Host executor processes (an unisolated worker), no gVisor: seconds.

Under runsc the same rules run in the conformance suites and test_restore.py; here each is
checked alone, and fast.
"""

from __future__ import annotations

import threading
import time

import pytest
import structlog
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import SandboxSetupError
from readie_worker.jobs import CodeJob, Step
from readie_worker._states import SessionState
from readie_worker.testing import FaultyLauncher, stopped, wait_until


@pytest.fixture
def launcher() -> FaultyLauncher:
    return FaultyLauncher()


def start(tmp_path, launcher: FaultyLauncher, **config: object) -> Worker:
    settings = WorkerConfig.in_temp(tmp_path / "no-manifest.json", allow_unisolated=True, unisolated_launcher=launcher, **config)
    return Worker(settings).start()


def job(code: str) -> CodeJob:
    return CodeJob(checkpoint="base", code=code, timeout_ms=20_000)


def test_jobs_wait_for_one_of_the_slots_and_never_run_more_at_once(tmp_path, launcher):
    worker = start(tmp_path, launcher, slots=2)
    busiest: list[int] = []
    watching = threading.Event()

    def watch() -> None:
        while not watching.is_set():
            busiest.append(worker.capacity().busy)
            time.sleep(0.01)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        outcomes: list[str] = []
        runs = [threading.Thread(target=lambda i=i: outcomes.append(worker.run_job(job(f"import time\ntime.sleep(0.4)\nprint({i})")).stdout)) for i in range(3)]
        for run in runs:
            run.start()
        for run in runs:
            run.join(30)
        assert sorted(outcomes) == ["0\n", "1\n", "2\n"]
        assert max(busiest) == 2 and launcher.starts == 3
    finally:
        watching.set()
        watcher.join()
        worker.close()


def test_a_sandbox_that_cannot_start_fails_its_job_and_the_worker_keeps_serving(tmp_path):
    launcher = FaultyLauncher(fail_starts=1)
    worker = start(tmp_path, launcher)
    try:
        failed = worker.run_job(job("print('never')"))
        assert failed.exit is None and failed.error.type == "SandboxSetupError", failed
        assert "start failed as the test asked" in failed.error.message
        served = worker.run_job(job("print('next')"))
        assert (served.exit, served.stdout) == (0, "next\n"), served
        # The failed start's, and the served job's sandbox (retired on the worker's retire thread).
        assert wait_until(lambda: launcher.destroys == 2, 10), launcher
    finally:
        worker.close()


def test_a_drain_refuses_new_work_and_lets_running_jobs_finish(tmp_path, launcher):
    worker = start(tmp_path, launcher)
    finished: list[str] = []
    running = threading.Thread(target=lambda: finished.append(worker.run_job(job("import time\ntime.sleep(0.5)\nprint('done')")).stdout))
    running.start()
    assert wait_until(lambda: worker.capacity().busy == 1, 10)
    draining = threading.Thread(target=worker.drain, kwargs={"grace_s": 10})
    draining.start()
    assert wait_until(lambda: worker.capacity().draining, 5)
    with pytest.raises(SandboxSetupError, match="draining"):
        worker.run_job(job("print('late')"))
    running.join(10)
    draining.join(15)
    assert finished == ["done\n"] and not draining.is_alive()
    assert wait_until(lambda: launcher.destroys == launcher.starts, 10)


def test_a_worker_keeps_at_most_max_sessions_and_a_closed_one_frees_its_place(tmp_path, launcher):
    worker = start(tmp_path, launcher, max_sessions=1)
    try:
        session, first = worker.open_session(job("x = 41"))
        assert first.outcome.exit == 0, first
        with pytest.raises(SandboxSetupError, match="at most 1 sessions"):
            worker.open_session(job("y = 1"))
        assert worker.capacity().sessions == 1
        session.close()
        again, _ = worker.open_session(job("y = 1"))
        assert worker.capacity().sessions == 1
        again.close()
    finally:
        worker.close()


def test_then_has_the_answer_before_the_workers_own_bookkeeping(tmp_path, launcher, monkeypatch):
    """A pool writes its result line in ``then``: before the job's log line and its sandbox's
    retirement, and for a step once the session is idle again (its next step may come at once)."""
    worker = start(tmp_path, launcher)
    order: list[object] = []
    retire = worker._retirer.retire
    monkeypatch.setattr(worker._retirer, "retire", lambda sandbox: (order.append("retired"), retire(sandbox)))
    try:
        with structlog.testing.capture_logs() as logs:
            def then(outcome: object) -> None:
                order.append(("then", outcome, sum(line["event"] == "job" for line in logs)))

            outcome = worker.run_job(job("print(1)"), then=then)
            assert order == [("then", outcome, 0), "retired"] and outcome.stdout == "1\n"
            assert sum(line["event"] == "job" for line in logs) == 1

            session, _ = worker.open_session(job("x = 1"))
            order.clear()
            step = session.run_step(Step(code="print(x)"), then=lambda done: order.append((done, session.state)))
            assert order == [(step, SessionState.IDLE)] and step.outcome.stdout == "1\n"
            # A step that ends its session is answered after the teardown, as a client that opens
            # the next one at once would find it (its sandbox destroyed, its place free).
            destroys = launcher.destroys
            ended = session.run_step(Step(code="raise SystemExit"),
                                     then=lambda done: order.append((done.session_ended, launcher.destroys - destroys)))
            assert order[1:] == [(True, 1)] and ended.session_ended
            # With the retirer backed up, the destroy is the job's own, before its answer, as it always was.
            monkeypatch.setattr(worker._retirer, "backed_up", lambda: True)
            order.clear()
            worker.run_job(job("print(2)"), then=lambda done: order.append("then"))
            assert order == ["retired", "then"]
    finally:
        worker.close()


def test_an_idle_session_is_paused_and_whatever_holds_it_next_runs_it_again(tmp_path, launcher):
    worker = start(tmp_path, launcher, session_pause_s=0.3)
    try:
        session, first = worker.open_session(job("x = 41"))
        assert first.outcome.exit == 0, first
        executor = session._sandbox.launched.process.pid
        assert wait_until(lambda: stopped(executor), timeout=5)
        step = session.run_step(Step("x += 1\nprint(x)"))
        assert (step.session_ended, step.outcome.stdout, stopped(executor)) == (False, "42\n", False)
        assert wait_until(lambda: stopped(executor), timeout=5)
        assert "cell.py" not in {entry.name for entry in session.list_files(".").entries}
        assert not stopped(executor)
        # One that cannot be resumed ends its session at once with a worker error, not after the
        # step's 20 s timeout charged to the user's code.
        assert wait_until(lambda: stopped(executor), timeout=5)
        launcher.fail_resumes = 1
        started = time.monotonic()
        broken = session.run_step(Step("print(x)"))
        assert time.monotonic() - started < 5
        assert broken.session_ended and broken.outcome.error.type == "PoolWorkerError", broken
    finally:
        worker.close()


def test_with_session_pause_0_an_idle_session_is_never_paused(tmp_path, launcher):
    worker = start(tmp_path, launcher, session_pause_s=0)
    try:
        session, _ = worker.open_session(job("x = 1"))
        executor = session._sandbox.launched.process.pid
        time.sleep(0.6)
        assert not stopped(executor)
        assert "idle-pause" not in {thread.name for thread in threading.enumerate()}
        assert session.run_step(Step("print(x)")).outcome.stdout == "1\n"
    finally:
        worker.close()
