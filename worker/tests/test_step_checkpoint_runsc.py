"""Per-step checkpoints (``session_checkpoint = "step"``, decision 32) in real gVisor sandboxes.

After each step the session's sandbox is written into the session store with
``runsc checkpoint --leave-running`` on a thread of its own; the session
serves on from the same sandbox. When its worker is lost (here: its sandbox
SIGKILLed and the worker abandoned without a detach), a second worker of the
same store takes the session over, and its next step has the last written
step's state and says which step that was.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import SandboxSetupError
from readie_worker.jobs import CodeJob, Step
from readie_worker._sentry import kill_sandbox_process
from readie_worker.session_store import entry_name

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS, new_session_store, two_workers_of_one_store  # noqa: E402

COUNTER = "counter = 0\nprint('set')"
INCREMENT = Step(code="counter += 1\nprint(counter)")


@pytest.fixture(scope="module")
def shared(checkpoints, tmp_path_factory):
    return new_session_store(tmp_path_factory.mktemp("shared"))


def start(shared: tuple[Path, Path], checkpoint: str) -> Worker:
    store, key = shared
    config = WorkerConfig.in_temp(
        CHECKPOINTS / "manifest.json", warm={"base": 0}, slots=2, session_store=store, session_store_key=key,
        session_checkpoint=checkpoint,
    )
    return Worker(config).start()


@pytest.fixture(scope="module")
def workers(shared):
    """The worker that checkpoints each step, and the one that takes its sessions over."""
    yield from two_workers_of_one_store(lambda: start(shared, "step"), lambda: start(shared, "off"), shared[0])


def stored_step(worker: Worker, key: str) -> int:
    assert worker.images is not None
    return worker.images.store.load(key).step


def checkpoints_counted(worker: Worker, result: str) -> float:
    name = "readie_worker_session_checkpoint_duration_seconds_count"
    return worker.metrics.registry.get_sample_value(name, {"result": result}) or 0.0


def test_a_session_goes_on_from_its_last_step_on_another_worker_when_its_own_is_lost(workers, shared):
    one, two = workers
    session, first = one.open_session(CodeJob(checkpoint="base", code=COUNTER, name="cell.py"))
    assert first.outcome.stdout == "set\n", first.outcome
    key, sandbox = session.key, session.sandbox_id
    assert key is not None and sandbox is not None
    for count in (1, 2):  # each waits for the last step's checkpoint, and is served by the same sandbox
        step = session.run_step(INCREMENT)
        assert step.outcome.stdout == f"{count}\n" and step.outcome.duration_us < 5_000_000, step.outcome
    assert session.sandbox_id == sandbox
    session.wait_for_checkpoint()
    assert stored_step(one, key) == 3, "after step N the store holds step N's state"
    assert checkpoints_counted(one, "ok") >= 3

    # The worker is lost: its sandbox killed, no detach, no close. Another worker takes over.
    kill_sandbox_process(sandbox, session._sandbox.dir.pid_file)
    taken, last = two.attach_session(key, take_over=True)
    try:
        assert last == 3
        step = taken.run_step(Step(code="print(counter)"))
        assert (step.outcome.stdout, step.resumed_from_step, step.step) == ("2\n", 3, 4), step
        assert step.resumed_ms is not None
        assert taken.run_step(INCREMENT).resumed_from_step is None, "only the step that resumed says so"
    finally:
        taken.close()
    assert not (shared[0] / entry_name(key)).exists(), "closing the session removes its entry"
    session.close()  # the lost worker's copy: its lease was taken, so it writes and removes nothing


def test_a_checkpoint_that_fails_is_counted_and_the_session_goes_on(workers):
    one, _ = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code=COUNTER, name="cell.py"))
    store = one.images.store
    try:
        session.wait_for_checkpoint()
        failed = checkpoints_counted(one, "failed")
        store.max_bytes, saved_bytes = 0, store.max_bytes  # the store is full: the next write is refused
        try:
            assert session.run_step(INCREMENT).outcome.stdout == "1\n"
            session.wait_for_checkpoint()
        finally:
            store.max_bytes = saved_bytes
        assert checkpoints_counted(one, "failed") == failed + 1
        assert stored_step(one, session.key) == 1, "the older generation is kept"
        assert session.run_step(INCREMENT).outcome.stdout == "2\n", "the session went on"
        session.wait_for_checkpoint()
        assert stored_step(one, session.key) == 3
    finally:
        session.close()


def test_a_resume_keeps_the_stored_state_and_a_refused_detach_never_deletes_it(workers, shared):
    """Findings 11 and 1: after a resume the stored image stays what a crash falls back to,
    and a detach the full store refuses lets the session go with its entry kept: another
    worker attaches it from its last good generation."""
    one, two = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code=COUNTER, name="cell.py"))
    store = one.images.store
    key = session.key
    assert key is not None
    session.hibernate()
    store.max_bytes, saved_bytes = 0, store.max_bytes  # full: every write from here is refused
    try:
        step = session.run_step(INCREMENT)  # resumes; its own checkpoint is refused
        assert step.outcome.stdout == "1\n" and step.resumed_ms is not None, step
        session.wait_for_checkpoint()
        assert stored_step(one, key) == 1, "the resume kept the hibernated state (no checkpoint since)"
        with pytest.raises(SandboxSetupError, match="session store"):
            session.detach()
        assert session.ended and not session.detached and one.runsc.list_ids() == []
    finally:
        store.max_bytes = saved_bytes
    assert stored_step(one, key) == 1 and not store.holds(key), "kept, its lease let go"
    attached, last = two.attach_session(key)  # not a take-over: the lease was released
    try:
        assert last == 1
        assert attached.run_step(Step(code="print(counter)")).outcome.stdout == "0\n"
    finally:
        attached.close()
    assert not (shared[0] / entry_name(key)).exists()
