"""Worker sessions in real gVisor sandboxes: one sandbox per session, __main__ kept between steps."""

from __future__ import annotations

import threading

import pytest

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import RequestError, SandboxSetupError
from readie_worker.jobs import CodeJob, Step

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402


@pytest.fixture(scope="module")
def worker(checkpoints):
    # `checkpoints` (conftest) fails loudly when the checkpoints are stale.
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 1}, slots=2)
    worker = Worker(config).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []


def job(code: str, **fields) -> CodeJob:
    return CodeJob(checkpoint="base", code=code, name=fields.pop("name", "cell.py"), **fields)


def test_main_survives_between_steps_in_one_sandbox(worker):
    session, first = worker.open_session(job("x = 20\nimport math\nprint('set')"))
    try:
        assert (first.step, first.session_ended, first.outcome.exit, first.outcome.stdout) == (1, False, 0, "set\n")
        assert first.outcome.backend == "gvisor:runsc-restore"
        second = session.run_step(Step("x += 1\nprint(x, math.pi > 3)", name="cell-2.py"))
        assert (second.step, second.session_ended, second.outcome.stdout) == (2, False, "21 True\n")
        assert second.outcome.sandbox_id == first.outcome.sandbox_id == session.sandbox_id
        assert session.sandbox_id in worker.runsc.list_ids()
        # Between steps the session holds a sandbox but no slot.
        assert worker.capacity().busy == 0 and worker.capacity().sessions == 1
    finally:
        session.close()
    assert session.ended and worker.capacity().sessions == 0
    assert session.sandbox_id not in worker.runsc.list_ids()
    with pytest.raises(RequestError, match="has ended"):
        session.run_step(Step("print(x)"))


def test_an_exception_keeps_the_session_and_its_state(worker):
    session, _ = worker.open_session(job("x = 1"))
    try:
        failed = session.run_step(Step("x = 2\nraise KeyError('k')", name="cell.py"))
        assert (failed.session_ended, failed.outcome.exit, failed.outcome.error.type) == (False, 1, "KeyError")
        assert (failed.outcome.error.file, failed.outcome.error.line) == ("cell.py", 2)
        assert session.run_step(Step("print(x)")).outcome.stdout == "2\n"
    finally:
        session.close()


def test_a_timeout_ends_the_session_and_destroys_its_sandbox(worker):
    session, _ = worker.open_session(job("x = 1", timeout_ms=1000))
    spun = session.run_step(Step("while True:\n    pass\n"))
    assert spun.session_ended and spun.outcome.error.type == "TimeoutError" and spun.outcome.exit is None
    assert "1000 ms" in spun.outcome.error.message
    assert session.ended and worker.capacity().sessions == 0
    assert spun.outcome.sandbox_id not in worker.runsc.list_ids()


def test_sys_exit_ends_the_session_with_its_status(worker):
    session, _ = worker.open_session(job("x = 1"))
    exited = session.run_step(Step("import sys\nprint('bye')\nsys.exit(3)"))
    assert (exited.session_ended, exited.outcome.exit, exited.outcome.stdout) == (True, 3, "bye\n")
    assert session.ended and exited.outcome.sandbox_id not in worker.runsc.list_ids()


def test_a_step_timeout_overrides_the_sessions_and_grants_persist(worker, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "n.txt").write_text("41")
    session, first = worker.open_session(
        job(f"n = int(open('{data}/n.txt').read())", allow_read=(str(data),), timeout_ms=20_000, env={"K": "v"})
    )
    try:
        assert first.outcome.exit == 0, first
        assert first.outcome.backend == "gvisor:runsc-restore"
        step = session.run_step(
            Step(f"import os\nprint(n + 1, open('{data}/n.txt').read(), os.environ['K'])", timeout_ms=5000)
        )
        assert step.outcome.stdout == "42 41 v\n", step
        # The grant is read-only in every step, as it was in the first.
        denied = session.run_step(Step(f"open('{data}/w.txt', 'w')"))
        assert denied.outcome.error.type in ("PermissionError", "OSError") and not denied.session_ended
    finally:
        session.close()


def test_one_step_at_a_time(worker):
    session, _ = worker.open_session(job("import time"))
    started = threading.Event()
    results = []

    def slow():
        started.set()
        results.append(session.run_step(Step("time.sleep(1)\nprint('slept')")))

    thread = threading.Thread(target=slow)
    thread.start()
    started.wait()
    try:
        for _ in range(200):  # until the slow step is running
            if session.state.value == "running":
                break
            threading.Event().wait(0.01)
        with pytest.raises(RequestError, match="one at a time"):
            session.run_step(Step("print('too soon')"))
        thread.join()
        assert results[0].outcome.stdout == "slept\n"
    finally:
        thread.join()
        session.close()


def test_closing_the_worker_destroys_open_sessions(checkpoints):
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 0}, slots=1)
    worker = Worker(config).start()
    try:
        sessions = [worker.open_session(job(f"v = {i}"))[0] for i in range(2)]
        assert worker.capacity().sessions == 2 and len(worker.runsc.list_ids()) == 2
        worker.drain(grace_s=5)
        assert all(s.ended for s in sessions) and worker.runsc.list_ids() == []
        with pytest.raises(SandboxSetupError, match="draining"):
            worker.open_session(job("v = 9"))
    finally:
        worker.close()
