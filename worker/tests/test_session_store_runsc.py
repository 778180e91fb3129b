"""Two workers sharing one session store, in real gVisor sandboxes (issue 30, decision 32).

A session hibernated into the store by one worker (a drain's hand-over) is
attached by key on a second worker that shares the store's directory and key
file, and its next step sees its state. A wrong key is refused like an
unknown one; a tampered image is refused, removed, and the worker goes on
serving; a closed session leaves no entry, no runsc container and no sandbox
dir. The store's file layer is proven without runsc in test_session_store.py.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import RequestError, SandboxSetupError
from readie_worker.jobs import CodeJob, Step
from readie_worker.session_store import entry_name, new_session_key
from readie_worker.testing import sample

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS, new_session_store, two_workers_of_one_store  # noqa: E402


@pytest.fixture(scope="module")
def shared(checkpoints, tmp_path_factory):
    """The store's directory and key file, as an operator would give both to every worker."""
    return new_session_store(tmp_path_factory.mktemp("shared"))


def start(shared: tuple[Path, Path]) -> Worker:
    store, key = shared
    config = WorkerConfig.in_temp(
        CHECKPOINTS / "manifest.json", warm={"base": 0, "pandas": 0}, slots=2, session_store=store, session_store_key=key,
    )
    return Worker(config).start()


@pytest.fixture(scope="module")
def workers(shared):
    """Two workers of one store, shared by every test here (each restore costs a second)."""
    yield from two_workers_of_one_store(lambda: start(shared), lambda: start(shared), shared[0])


def entries(shared: tuple[Path, Path]) -> list[str]:
    return sorted(name for name in os.listdir(shared[0]) if not name.startswith("."))


def samples(worker: Worker) -> dict:
    text = generate_latest(worker.metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_a_drained_pandas_session_goes_on_on_another_worker_and_closes_without_a_trace(workers, shared):
    _, two = workers
    draining = start(shared)  # its own: a drain is its end
    try:
        session, first = draining.open_session(CodeJob(
            checkpoint="pandas", code="import pandas as pd\ndf = pd.DataFrame({'n': range(200_000)})\ncounter = 1",
        ))
        assert first.outcome.exit == 0, first.outcome
        assert session.run_step(Step("counter += 1")).step == 2
        key = session.key
        assert key is not None and len(key) == 43 and entries(shared) == [entry_name(key)]
        draining.drain(grace_s=5)  # SIGTERM's: running steps finish, then every session is handed over
        assert session.ended and session.detached and session.steps == 2
        assert sample(samples(draining), "readie_worker_session_hand_overs_total") == 1
    finally:
        draining.close()
    assert draining.runsc.list_ids() == [] and entries(shared) == [entry_name(key)]

    attached, last_step = two.attach_session(key)
    try:
        assert last_step == 2 and attached.key == key and attached.hibernated
        step = attached.run_step(Step("counter += 1\nprint(counter, len(df), df.n.sum())"))
        assert (step.outcome.exit, step.outcome.stdout) == (0, "3 200000 19999900000\n"), step.outcome
        assert step.resumed_ms is not None and step.resumed_ms > 0
        assert step.step == 3  # numbering goes on from the stored step
        assert sample(samples(two), "readie_worker_session_attaches_total") == 1
        sandbox = attached.sandbox_id
        assert sandbox in two.runsc.list_ids()
    finally:
        attached.close()
    assert entries(shared) == [] and two.runsc.list_ids() == []
    assert os.listdir(two.state.run_dir) == [] and os.listdir(two.state.images_dir) == []


def test_a_wrong_key_is_refused_as_an_unknown_one(workers, shared):
    one, two = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code="x = 1"))
    try:
        session.detach()
        assert session.key is not None and entries(shared) == [entry_name(session.key)]
        refusals = []
        for key in (new_session_key(), session.key[:-1] + ("A" if session.key[-1] != "A" else "B"), "", "x" * 4000):
            with pytest.raises(RequestError) as refused:
                two.attach_session(key)
            refusals.append((refused.value.field, str(refused.value)))
        assert len(set(refusals)) == 1 and refusals[0][0] == "attach"
        assert sample(samples(two), "readie_worker_session_attach_refusals_total", reason="unknown") == 4
        attached, _ = two.attach_session(session.key)  # the right one still works
        attached.close()
    finally:
        session.close()
    assert entries(shared) == []


def test_a_tampered_image_is_refused_removed_and_the_worker_keeps_serving(workers, shared):
    one, two = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code="secret = 42"))
    session.detach()
    assert session.key is not None
    image = max((shared[0] / entry_name(session.key)).glob("g*/*.img"), key=lambda path: path.stat().st_size)
    with open(image, "r+b") as opened:
        opened.seek(image.stat().st_size // 2)
        byte = opened.read(1)
        opened.seek(-1, os.SEEK_CUR)
        opened.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(SandboxSetupError, match="failed verification"):
        two.attach_session(session.key)
    assert entries(shared) == [] and two.capacity().sessions == 0
    assert os.listdir(two.state.images_dir) == []  # nothing of it kept, nothing restored
    assert sample(samples(two), "readie_worker_session_attach_refusals_total", reason="invalid") == 1
    still, first = two.open_session(CodeJob(checkpoint="base", code="print('serving')"))
    still.close()
    assert first.outcome.stdout == "serving\n" and two.runsc.list_ids() == []


def test_a_take_over_ends_the_old_holders_copy_without_touching_the_store(workers, shared):
    one, two = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code="n = 7"))
    session.hibernate()  # held live by `one`, its state in the store
    assert session.key is not None
    attached, last_step = two.attach_session(session.key, take_over=True)  # the caller saw `one` die
    try:
        one.images.store.leases.beat_now()  # `one`'s next beat finds its lease taken
        assert session.ended and not session.detached and one.capacity().sessions == 0
        assert entries(shared) == [entry_name(session.key)]  # left for the new holder
        step = attached.run_step(Step("print(n)"))
        assert (step.outcome.stdout, step.step, last_step) == ("7\n", 2, 1)
        attached.hibernate()
        # Taken over on its own holder (a client that reconnected to the same worker): the
        # older copy ends without touching the lease or the entry the new one holds.
        again, _ = two.attach_session(session.key, take_over=True)
        assert attached.ended and not again.ended and two.capacity().sessions == 1
        assert two.images.store.holds(session.key) and (shared[0] / entry_name(session.key) / "lease").exists()
        two.images.store.leases.beat_now()
        assert not again.ended and again.run_step(Step("print(n + 1)")).outcome.stdout == "8\n"
        attached = again
    finally:
        attached.close()
    assert entries(shared) == []


def test_a_stored_job_this_worker_would_not_take_is_refused_at_attach_and_kept(workers, shared):
    """Finding 4: what the store says a session is gets the worker's own checks, as a new job
    does; a refusal is a SandboxSetupError (another worker may take it) and the entry stays."""
    one, two = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code="x = 1"))
    store = one.images.store
    planted = []
    try:
        session.hibernate()
        assert session.key is not None
        stored = store.load(session.key)
        backstop = two.config.sandbox_memory_bytes
        for job, limit in ((dataclasses.replace(stored.job, checkpoint="nope"), stored.memory_limit),
                           (stored.job, backstop + 1),
                           (dataclasses.replace(stored.job, memory_bytes=backstop), stored.memory_limit)):
            key = new_session_key()  # written with the store's key, as another worker would
            lease = store.hold(key, lambda: None, new=True)
            store.share(dataclasses.replace(stored, job=job, memory_limit=limit), key, 1, lease=lease)
            store.let_go(key)
            planted.append(key)
            with pytest.raises(SandboxSetupError, match="cannot take the stored session"):
                two.attach_session(key)
            assert store.load(key).step == 1, "the entry is kept"
        assert two.capacity().sessions == 0 and os.listdir(two.state.images_dir) == []
        assert sample(samples(two), "readie_worker_session_attach_refusals_total", reason="invalid") >= 3
    finally:
        for key in planted:
            store.remove_entry(entry_name(key))
        session.close()
    assert entries(shared) == []


def test_an_old_holder_that_closes_before_it_saw_the_take_over_leaves_the_entry(workers, shared):
    """Finding 2b: removing goes by the holder's own lease token, checked on disk under the
    store's lock, so a copy whose lease was taken (its beat not yet run) never wipes the entry."""
    one, two = workers
    session, _ = one.open_session(CodeJob(checkpoint="base", code="n = 5"))
    session.hibernate()
    assert session.key is not None
    attached, _ = two.attach_session(session.key, take_over=True)
    try:
        session.close()  # `one` still thinks it holds the lease: no beat since the take-over
        assert entries(shared) == [entry_name(session.key)]
        assert attached.run_step(Step("print(n)")).outcome.stdout == "5\n"
    finally:
        attached.close()
    assert entries(shared) == []
