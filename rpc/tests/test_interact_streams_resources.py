"""Interact streams leave nothing behind: a fake runner behind the real ``serve()`` on loopback.

No runsc: a fake runner (_interact_fakes.py) stands in for the worker; the
gRPC service, ``_interact.Interaction``, ``WorkerClient``, ``InteractStream``
and ``RemoteSession`` are the real ones. Covered:

* the calling side keeps no grpc request-writer thread (grpc's
  ``consume_request_iterator``) once a stream is over: a session ended by a
  step, a session whose worker server stopped (SessionLost), a session
  closed while its step runs, a job with host functions whose runner
  raises (and, for contrast, the plain ends: a job that succeeds, a
  session closed between steps);
* the server's stream cap bounds work, not just open streams: streams
  cancelled while their jobs run keep their places until the jobs finish.

Where a test must know the server has seen a cancellation, it spies on
``Interaction._hang_up`` (the RPC's end callback) rather than sleeping.

Queued steps, host calls and clients that do not read: test_interact_streams_steps.py.
Real sandboxes behind the same stream: test_interact_runsc_jobs.py and
test_interact_runsc_sessions.py.
"""

from __future__ import annotations

import faulthandler
import re
import tempfile
import threading
import time

import grpc
import pytest

from readie_worker.errors import PoolWorkerError
from readie_worker.jobs import CodeJob, Step
from readie_rpc.remote_session import SessionLost
from rpc.tests._interact_fakes import WAIT_S, Served, job_message, wait_until
from rpc.tests._interact_fakes import hang_ups, serve_fake  # noqa: F401 - fixtures


def request_writers() -> int:
    """Threads of grpc's client writing a stream's requests (grpc/_channel.py ``consume_request_iterator``).

    Read from faulthandler's dump of every thread: walking other threads'
    frames with ``sys._current_frames()`` while they run can crash CPython 3.11.
    """
    with tempfile.TemporaryFile("w+") as dump:
        faulthandler.dump_traceback(dump, all_threads=True)
        dump.seek(0)
        stacks = re.split(r"^(?:Thread|Current thread) 0x", dump.read(), flags=re.MULTILINE)
    return sum("in consume_request_iterator" in stack for stack in stacks)


def threads_outside_the_server_pool() -> int:
    """Live threads but the gRPC server's own pool, which starts threads as calls overlap (up to its size)."""
    return sum(not thread.name.startswith("rpc_") for thread in threading.enumerate())


SESSION_JOB = CodeJob("base", "open", timeout_ms=2000)


# --------------------------------------------------------------------------- no request-writer thread left behind


def _session_ended_by_a_step(served: Served) -> None:
    session, _ = served.client().open_session(SESSION_JOB)
    assert request_writers() >= 1  # the detector sees a live stream's writer
    assert session.run_step(Step("exit")).session_ended
    assert session.ended


def _session_lost_after_the_server_stops(served: Served) -> None:
    session, _ = served.client().open_session(SESSION_JOB)
    served.server.server.stop(0).wait()
    with pytest.raises(SessionLost, match="was lost"):
        session.run_step(Step("x"))
    assert session.ended


def _session_closed_while_its_step_runs(served: Served) -> None:
    session, _ = served.client().open_session(SESSION_JOB)
    failure: list[BaseException] = []

    def step() -> None:
        try:
            session.run_step(Step("block"))
        except BaseException as exc:  # noqa: BLE001
            failure.append(exc)

    stepping = threading.Thread(target=step)
    stepping.start()
    assert wait_until(lambda: served.runner.sessions[0].steps == ["block"])
    session.close()
    stepping.join(WAIT_S)
    assert not stepping.is_alive()
    assert len(failure) == 1 and type(failure[0]) is PoolWorkerError
    assert "closed while its step ran" in str(failure[0])
    served.runner.release.set()
    assert served.runner.sessions[0].closed.wait(WAIT_S)  # the worker closed it too


def _job_whose_runner_raises(served: Served) -> None:
    client = served.client()
    for code in ("raise", "fail"):
        with pytest.raises(PoolWorkerError):
            client.run_job(CodeJob("base", code, timeout_ms=2000, functions=("f",)))


def _job_that_succeeds(served: Served) -> None:
    assert served.client().run_job(CodeJob("base", "fine", timeout_ms=2000, functions=("f",))).stdout == "fine"


def _session_closed_between_steps(served: Served) -> None:
    session, _ = served.client().open_session(SESSION_JOB)
    session.run_step(Step("x"))
    session.close()
    assert served.runner.sessions[0].closed.is_set()


@pytest.mark.parametrize(
    "scenario",
    [
        _session_ended_by_a_step,
        _session_lost_after_the_server_stops,
        _session_closed_while_its_step_runs,
        _job_whose_runner_raises,
        _job_that_succeeds,
        _session_closed_between_steps,
    ],
    ids=lambda scenario: scenario.__name__.strip("_"),
)
def test_a_finished_stream_leaves_no_request_writer_thread(serve_fake, scenario):
    served = serve_fake()
    before = request_writers()
    scenario(served)
    assert wait_until(lambda: request_writers() <= before), (
        f"{request_writers() - before} grpc request-writer thread(s) still wait on a finished stream's requests"
    )


def test_request_writer_threads_do_not_pile_up_over_many_sessions(serve_fake):
    served = serve_fake()
    client = served.client()

    def sessions(count: int) -> None:
        for _ in range(count):
            session, _ = client.open_session(SESSION_JOB)
            session.run_step(Step("exit"))
            session, _ = client.open_session(SESSION_JOB)
            session.close()

    before = request_writers()
    sessions(1)  # the server's pool starts the threads it keeps
    assert wait_until(lambda: request_writers() <= before)
    threads_before = threads_outside_the_server_pool()
    sessions(10)
    assert wait_until(lambda: request_writers() <= before and threads_outside_the_server_pool() <= threads_before)


# --------------------------------------------------------------------------- the stream cap counts work


def test_cancelled_streams_keep_their_places_until_their_jobs_finish(serve_fake, hang_ups):
    served = serve_fake(max_streams=2)
    runner = served.runner
    first = [served.stream(job_message("block"), timeout=30) for _ in range(2)]
    assert wait_until(lambda: runner.running == 2)
    for stream in first:
        stream.cancel()
    assert wait_until(lambda: len(hang_ups) == 2)  # the server has seen both cancellations

    # The jobs still run, so their places are still taken: a third stream is refused, every time.
    for _ in range(5):
        refused = served.stream(job_message("quick"), timeout=5)
        with pytest.raises(grpc.RpcError) as caught:
            refused.next()
        assert caught.value.code() == grpc.StatusCode.UNAVAILABLE
        assert "2 Interact streams" in caught.value.details()
        time.sleep(0.05)
    assert runner.running == 2

    runner.release.set()
    assert wait_until(lambda: runner.finished == 2)

    def accepted() -> bool:
        try:
            event = served.stream(job_message("quick"), timeout=5).next()
        except grpc.RpcError as error:
            assert error.code() == grpc.StatusCode.UNAVAILABLE
            return False  # the driver is between its job's end and giving the place back
        assert event.result.stdout == "quick"
        return True

    assert wait_until(accepted)
