"""Idle sessions wait paused, in real gVisor sandboxes (``readie_worker._idle_pause``).

A session idle long and quiet has its sandbox frozen whole (its cgroup's freezer: no CPU, no
signal); whatever holds it next (a step, a file, a hibernation: runsc's checkpoint would wait for
ever on a frozen sentry) runs it again first. A session whose own code runs between steps is
never paused.
"""

from __future__ import annotations

import time
import pytest

from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob, Step
from readie_worker.testing import cpu_ticks, stopped, wait_until

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402


@pytest.fixture(scope="module")
def worker(checkpoints):
    # Ten seconds of idleness in earnest (session_pause); half a second here.
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 1}, slots=2, session_pause_s=0.5)
    worker = Worker(config).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []


def job(code: str) -> CodeJob:
    return CodeJob(checkpoint="base", code=code, name="cell.py")


def sentry(session) -> int:
    return int(session._sandbox.dir.pid_file.read_text())


def paused(session) -> bool:
    # The pauser's first look only samples the sandbox's CPU (it pauses from its second: up to
    # 2.5 s in earnest); the first look may come a whole check interval late.
    pid = sentry(session)
    return wait_until(lambda: stopped(pid), timeout=10)


def test_an_idle_session_is_paused_and_a_step_runs_it_again_with_its_state(worker):
    session, first = worker.open_session(job("x = 41\nprint('set')"))
    try:
        assert first.outcome.stdout == "set\n"
        pid = sentry(session)
        assert paused(session)
        assert worker.sessions.paused == 1  # the worker's gauge (readie_worker_sessions_paused)
        before = cpu_ticks(pid)
        time.sleep(1.0)  # running idle, systrap's sentry takes a few ticks a second here
        assert cpu_ticks(pid) == before
        step = session.run_step(Step("x += 1\nprint(x)"))
        assert (step.session_ended, step.outcome.stdout) == (False, "42\n")
        assert not stopped(pid) and worker.sessions.paused == 0
        # Paused again, a file operation (its own exchange, no step) runs it first too.
        assert paused(session)
        assert "cell.py" not in {entry.name for entry in session.list_files(".").entries}
        assert not stopped(pid)
    finally:
        session.close()
    assert session.sandbox_id not in worker.runsc.list_ids()


def test_a_paused_session_hibernates_and_resumes(worker):
    # runsc checkpoint asks the sentry: stopped, it would wait until runsc's own timeout.
    session, _ = worker.open_session(job("x = 7"))
    try:
        assert paused(session)
        started = time.monotonic()
        assert session.hibernate() > 0
        assert time.monotonic() - started < 20
        step = session.run_step(Step("print(x * 6)"))
        assert (step.session_ended, step.outcome.stdout, step.resumed_ms is not None) == (False, "42\n", True)
    finally:
        session.close()


def test_a_session_whose_code_runs_between_steps_is_not_paused(worker):
    spin = "import threading\ndef spin():\n    while True: pass\nthreading.Thread(target=spin, daemon=True).start()"
    session, first = worker.open_session(job(spin))
    try:
        assert first.outcome.exit == 0
        pid = sentry(session)
        deadline = time.monotonic() + 2.0  # four times the idle time, ten looks
        while time.monotonic() < deadline:
            assert not stopped(pid)
            time.sleep(0.05)
        assert session.run_step(Step("print('still here')")).outcome.stdout == "still here\n"
    finally:
        session.close()


def test_a_paused_sandbox_is_frozen_whole_and_hears_no_signal(worker):
    # Paused by hand: the pauser leaves a computing session alone. systrap runs a job's code in stub
    # processes beside the sentry, so a thread computing without a system call ran on through a
    # SIGSTOP of the sentry alone, and the SIGCONT that resumed it reached the job's handler.
    code = (
        "import signal, threading\nheard = []\nsignal.signal(signal.SIGCONT, lambda *_: heard.append(1))\n"
        "def spin():\n    while True: pass\nthreading.Thread(target=spin, daemon=True).start()"
    )
    session, first = worker.open_session(job(code))
    try:
        assert first.outcome.exit == 0
        sandbox = session._sandbox
        sandbox.pause()
        assert wait_until(lambda: stopped(sentry(session)), timeout=5)
        before = sandbox.cpu_ns()
        time.sleep(1.0)
        assert sandbox.cpu_ns() - before < 50_000_000  # the spinning thread alone takes a core
        assert sandbox.resume()  # the pauser, which saw it quiet while frozen, may pause it again: the step thaws it
        step = session.run_step(Step("print(len(heard))"))
        assert (step.session_ended, step.outcome.stdout) == (False, "0\n")
    finally:
        session.close()
