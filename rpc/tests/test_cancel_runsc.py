"""Cancellation frees the sandbox: a cancelled call, or one whose deadline passes, stops its job
(or its session's running step) within a second, on a worker and through a router; the log
says CANCELLED. A deadline before the job's own timeout gets the job's own TimeoutError."""

from __future__ import annotations

import queue
import time

import grpc
import pytest

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.testing import start_cluster, start_worker, stop_worker
from readie_worker.testing import wait_until

pytestmark = pytest.mark.runsc

SLEEP = "import time\nprint('started', flush=True)\ntime.sleep(30)\nprint('never')"
# Within this long of the cancel, the sandbox is gone and the slot free: the bound.
FREED_WITHIN_S = 2.0


def busy(stub: pb_grpc.WorkerStub) -> int:
    return stub.Capacity(pb.CapacityRequest(), timeout=5).busy


@pytest.fixture(scope="module")
def worker(checkpoints, checkpoint_dir, tmp_path_factory):
    process = start_worker(tmp_path_factory.mktemp("cancel"), "cancel", checkpoint_dir / "manifest.json", warm="base=1")
    yield process
    assert stop_worker(process) == 0
    assert process.containers() == []


def open_steps(stub: pb_grpc.WorkerStub):
    """An Interact call opened with a session of ``x = 1``; returns (its requests, its events)."""
    steps: queue.Queue[pb.InteractRequest | None] = queue.Queue()
    steps.put(pb.InteractRequest(open_session=pb.RunJobRequest(checkpoint="base", code="x = 1", timeout_ms=40_000)))
    return steps, stub.Interact(iter(steps.get, None), timeout=120)


def test_a_cancelled_run_job_stops_and_frees_its_sandbox(worker):
    # Until the warm sandbox is ready the job would restore one of its own and the one being
    # warmed would stay: wait for it, so the job takes the sandbox listed here.
    assert wait_until(lambda: worker.stub.Capacity(pb.CapacityRequest(), timeout=5).pools["base"].ready == 1, 30)
    warm = set(worker.containers())
    call = worker.stub.RunJob.future(pb.RunJobRequest(checkpoint="base", code=SLEEP, timeout_ms=40_000), timeout=60)
    assert wait_until(lambda: busy(worker.stub) == 1, 10)
    time.sleep(1)
    cancelled_at = time.monotonic()
    call.cancel()
    # The warm sandbox it took is destroyed, and its slot is free again.
    assert wait_until(lambda: not warm & set(worker.containers()) and busy(worker.stub) == 0, FREED_WITHIN_S)
    assert time.monotonic() - cancelled_at < FREED_WITHIN_S
    assert wait_until(lambda: any(line.get("rpc") == "RunJob" and line.get("status") == "CANCELLED" for line in worker.log_lines()), 5)


def test_a_cancelled_session_step_stops_and_ends_its_session(worker):
    steps, events = open_steps(worker.stub)
    first = next(events).result
    sandbox = first.sandbox_id
    assert sandbox in worker.containers()
    steps.put(pb.InteractRequest(step=pb.SessionStep(code=SLEEP)))
    assert wait_until(lambda: busy(worker.stub) == 1, 10)
    time.sleep(1)
    events.cancel()
    assert wait_until(lambda: sandbox not in worker.containers() and busy(worker.stub) == 0, FREED_WITHIN_S)
    steps.put(None)


def test_a_deadline_before_the_jobs_timeout_ends_it_with_its_own_timeout_error(worker):
    started = time.monotonic()
    response = worker.stub.RunJob(pb.RunJobRequest(checkpoint="base", code=SLEEP, timeout_ms=600_000), timeout=4)
    assert response.error.type == "TimeoutError" and not response.HasField("exit"), response
    assert response.stdout == "started\n"  # what it printed before its deadline
    assert time.monotonic() - started < 4
    assert wait_until(lambda: busy(worker.stub) == 0, FREED_WITHIN_S)


def test_cancelling_through_a_router_frees_the_workers_sandbox(checkpoints, checkpoint_dir, short_tmp):
    cluster = start_cluster(short_tmp, checkpoint_dir / "manifest.json", workers=1, warm="base=0")
    try:
        [worker] = cluster.workers
        call = cluster.stub.RunJob.future(pb.RunJobRequest(checkpoint="base", code=SLEEP, timeout_ms=40_000), timeout=60)
        assert wait_until(lambda: busy(worker.stub) == 1, 15)
        time.sleep(1)
        call.cancel()
        assert wait_until(lambda: worker.containers() == [] and busy(worker.stub) == 0, FREED_WITHIN_S)
        # And a session's step.
        steps, events = open_steps(cluster.stub)
        assert next(events).result.step == 1
        steps.put(pb.InteractRequest(step=pb.SessionStep(code=SLEEP)))
        assert wait_until(lambda: busy(worker.stub) == 1, 10)
        time.sleep(1)
        events.cancel()
        assert wait_until(lambda: worker.containers() == [] and busy(worker.stub) == 0, FREED_WITHIN_S)
        steps.put(None)
        with pytest.raises(grpc.FutureCancelledError):
            call.result()
    finally:
        cluster.stop()
