"""Sessions and limits on the Interact stream: real ``readie worker``s and real gVisor sandboxes.

The tests are the client, a hostile or sloppy one: they drive the raw
generated stub, feeding its request stream from a queue, so they can send
what no honest client would (_interact_worker.py). Covered:

* sessions: steps keeping ``__main__``, step numbers, SystemExit ending the
  session; steps sent before the previous one's result (or while a host
  call waits) queued and run in order; a non-step message on an open
  session: INVALID_ARGUMENT naming the field; the sandbox destroyed when
  the client half-closes, cancels (also while a host call waits), or
  breaks the protocol;
* ``WorkerClient`` and ``RemoteSession``: steps, and a session lost when
  its worker drains;
* ``max_sessions`` over gRPC (an in-process worker): UNAVAILABLE;
* streams beyond the server's limit refused at once (Capacity still
  answers), and a stream that never sends a first message refused.

Jobs with host functions and protocol violations: test_interact_runsc_jobs.py.
Every worker must end with no runsc containers left.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator

import grpc
import pytest

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.client import WorkerClient
from readie_worker.core import Worker, WorkerConfig
from readie_rpc.grpc_service import serve
from readie_worker.jobs import CodeJob, Step
from readie_rpc.remote_session import SessionLost
from readie_rpc.testing import stop_worker
from rpc.tests._interact_worker import (
    JOB_TIMEOUT_MS,
    Stream,
    capacity,
    invalid_argument,
    job,
    open_stream,
    session_gone,
    start_worker,
    wait_until,
)
from rpc.tests._interact_worker import worker, worker_dir  # noqa: F401 - fixtures

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


# --------------------------------------------------------------------------- sessions


def test_a_step_sent_while_a_host_call_waits_runs_after_it(worker):
    stream = open_stream(worker.stub, "open_session", "import readie_host", ("lookup",))
    first = stream.result()
    stream.step("print(readie_host.lookup())")
    assert stream.host_call().call_id == 1
    stream.step("print('next')")  # sent ahead: held until the step before it ends
    stream.reply(1, "found")
    assert [(r.step, r.stdout) for r in (stream.result(), stream.result())] == [(2, "found\n"), (3, "next\n")]
    stream.close()
    stream.ends_ok()
    session_gone(worker, first.sandbox_id)


def test_a_job_message_while_a_host_call_waits_breaks_the_protocol(worker):
    stream = open_stream(worker.stub, "open_session", "import readie_host", ("lookup",))
    first = stream.result()
    stream.step("readie_host.lookup()")
    assert stream.host_call().call_id == 1
    stream.send(job=job("print('not here')"))
    invalid_argument(stream.refused(), "job")
    session_gone(worker, first.sandbox_id)


def test_steps_sent_before_the_previous_result_run_in_order(worker):
    stream = open_stream(worker.stub, "open_session", "import time\nn = 0")
    first = stream.result()
    stream.step("time.sleep(0.5)\nn += 1")
    stream.step("n += 1\nprint(n)")
    assert [stream.result().step, (second := stream.result()).step] == [2, 3]
    assert second.stdout == "2\n"
    stream.close()
    stream.ends_ok()
    session_gone(worker, first.sandbox_id)


def test_session_steps_keep_main_until_system_exit_ends_it(worker):
    stream = open_stream(worker.stub, "open_session", "x = 40\nprint('opened')")
    first = stream.result()
    assert first.session_id.startswith("ws-")
    assert (first.step, first.session_ended, first.exit, first.stdout) == (1, False, 0, "opened\n")
    sandbox = first.sandbox_id
    assert sandbox in worker.containers() and capacity(worker).sessions == 1

    for number in (2, 3):
        stream.step("x += 1\nprint(x)", name=f"cell-{number}.py")
        step = stream.result()
        assert (step.session_id, step.step, step.session_ended) == (first.session_id, number, False)
        assert (step.exit, step.stdout, step.sandbox_id) == (0, f"{39 + number}\n", sandbox)

    stream.step("print('bye', x)\nraise SystemExit(4)")
    last = stream.result()
    assert (last.session_id, last.step, last.session_ended) == (first.session_id, 4, True)
    assert (last.system_exit, last.exit, last.stdout) == (True, 4, "bye 42\n")
    stream.ends_ok()
    session_gone(worker, sandbox)


def test_a_non_step_message_on_an_open_session_ends_it(worker):
    stream = open_stream(worker.stub, "open_session", "x = 1")
    first = stream.result()
    assert (first.step, first.session_ended) == (1, False)
    stream.send(job=job("print('a job on a session stream')"))
    invalid_argument(stream.refused(), "job")
    session_gone(worker, first.sandbox_id)


def test_half_closing_an_idle_session_ends_it_quietly(worker):
    stream = open_stream(worker.stub, "open_session", "x = 1")
    first = stream.result()
    assert first.sandbox_id in worker.containers()
    stream.close()
    stream.ends_ok()
    session_gone(worker, first.sandbox_id)


def test_cancelling_an_idle_session_destroys_its_sandbox(worker):
    stream = open_stream(worker.stub, "open_session", "x = 1")
    first = stream.result()
    assert capacity(worker).sessions == 1
    stream.call.cancel()
    session_gone(worker, first.sandbox_id)


def test_cancelling_while_a_host_call_waits_destroys_the_session(worker):
    stream = open_stream(worker.stub, "open_session", "import readie_host", ("lookup",))
    first = stream.result()
    stream.step("readie_host.lookup('never answered')")
    assert stream.host_call().function == "lookup"
    assert capacity(worker).busy == 1
    stream.call.cancel()
    session_gone(worker, first.sandbox_id)


# --------------------------------------------------------------------------- the client classes


def test_a_remote_session_is_lost_when_its_worker_drains(worker_dir):
    process = start_worker(worker_dir / "b", "interact-b")
    client = WorkerClient(f"127.0.0.1:{process.port}")
    try:
        opening = CodeJob(checkpoint="base", code="x = 41", timeout_ms=JOB_TIMEOUT_MS)
        session, first = client.open_session(opening)
        assert (first.step, first.session_ended, first.outcome.exit) == (1, False, 0)
        assert session.id.startswith("ws-") and session.address == client.address
        step = session.run_step(Step("print(x + 1)"))
        assert (step.step, step.session_ended, step.outcome.stdout) == (2, False, "42\n")
        assert step.outcome.sandbox_id in process.containers()
        assert stop_worker(process) == 0, process.log_path.read_text()[-3000:]
        assert process.containers() == []
        with pytest.raises(SessionLost, match="ended") as lost:
            session.run_step(Step("print(x)"))
        # The message names the worker, not the worker's internal session id.
        assert client.address in str(lost.value) and session.id not in str(lost.value) and session.ended
    finally:
        client.close()
        stop_worker(process)


# --------------------------------------------------------------------------- a small worker, in process


@pytest.fixture(scope="module")
def small_worker() -> Iterator[tuple[Worker, pb_grpc.WorkerStub]]:
    """One session at most, no warm pool: served in this process (``readie worker`` has no test hook for it)."""
    worker = Worker(WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", max_sessions=1, warm={"base": 0})).start()
    server = serve(worker, "127.0.0.1:0", name="interact-in-process")
    channel = grpc.insecure_channel(server.address)
    try:
        yield worker, pb_grpc.WorkerStub(channel)
    finally:
        channel.close()
        server.drain(5)
    assert worker.runsc.list_ids() == []


def test_a_session_beyond_max_sessions_is_unavailable(small_worker):
    worker, stub = small_worker
    held = open_stream(stub, "open_session", "x = 1")
    first = held.result()
    assert (first.step, first.session_ended) == (1, False)
    reply = stub.Capacity(pb.CapacityRequest(), timeout=5)
    assert (reply.sessions, reply.max_sessions) == (1, 1)

    refused = open_stream(stub, "open_session", "x = 2").refused()
    assert refused.code() == grpc.StatusCode.UNAVAILABLE, refused
    assert dict(refused.trailing_metadata()) == {"readie-error": "SandboxSetupError"}
    assert "at most 1 sessions" in refused.details()

    held.close()
    held.ends_ok()
    wait_until(lambda: worker.capacity().sessions == 0, "the held session never closed")
    assert worker.runsc.list_ids() == []
    assert open_stream(stub, "job", "print('a job still runs')").result().stdout == "a job still runs\n"


def test_streams_beyond_the_limit_are_refused_at_once_and_capacity_still_answers(small_worker):
    worker, stub = small_worker
    limit = worker.config.slots + worker.config.max_sessions  # serve's default max_streams
    silent = [Stream(stub) for _ in range(limit)]
    try:
        # The server is in this process: each stream it serves has a reader thread.
        wait_until(lambda: _reading_streams() >= limit, "the silent streams never reached the server")
        extra = Stream(stub).refused()
        assert extra.code() == grpc.StatusCode.UNAVAILABLE
        assert f"its {limit} Interact streams open" in extra.details()
        assert stub.Capacity(pb.CapacityRequest(), timeout=2).sessions == 0
    finally:
        for stream in silent:
            stream.call.cancel()
    wait_until(lambda: _reading_streams() == 0, "the silent streams' threads never ended")
    assert open_stream(stub, "job", "print('served')").result().stdout == "served\n"


def test_a_stream_that_never_says_what_it_wants_is_refused(small_worker, monkeypatch):
    from readie_rpc import _interact

    monkeypatch.setattr(_interact, "FIRST_MESSAGE_S", 0.5)
    invalid_argument(Stream(stub := small_worker[1]).refused(), "kind")
    assert stub.Capacity(pb.CapacityRequest(), timeout=2).sessions == 0


def _reading_streams() -> int:
    return sum(thread.name == "interact-read" for thread in threading.enumerate())


def _answers(stub: pb_grpc.WorkerStub) -> bool:
    try:
        return stub.Capacity(pb.CapacityRequest(), timeout=1).sessions == 0
    except grpc.RpcError:
        return False
