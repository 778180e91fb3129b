"""The Interact stream's life on both ends, over a fake runner behind the real ``serve()`` on loopback.

No runsc: a fake runner (jobs and session steps that block on an Event,
raise, end the session or make host calls) stands in for the worker; the
gRPC service, ``_interact.Interaction``, ``WorkerClient``, ``InteractStream``
and ``RemoteSession`` are the real ones. Covered:

* the calling side keeps no grpc request-writer thread (grpc's
  ``consume_request_iterator``) once a stream is over: a session ended by a
  step, a session whose worker server stopped (SessionLost), a session
  closed while its step runs, a job with host functions whose runner
  raises (and, for contrast, the plain ends: a job that succeeds, a
  session closed between steps);
* the server's stream cap bounds work, not just open streams: streams
  cancelled while their jobs run keep their places until the jobs finish;
* a cancelled session runs none of the steps it had queued, including
  steps held while a host call waited;
* a client that never reads events (and never replies, or replies blind so
  the outbox fills) does not hold the runner's host callback past the
  call's deadline: it gets an error reply by then;
* steps sent while a host call waits are held and run after it, in order.

Where a test must know the server has seen a cancellation, it spies on
``Interaction._hang_up`` (the RPC's end callback) rather than sleeping.

Real sandboxes behind the same stream: test_interact_runsc.py.
"""

from __future__ import annotations

import faulthandler
import queue
import re
import tempfile
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from readie_worker.testing import wait_until as wait_for
from readie_worker._interact import Interaction
from readie_worker._proto.readie.v1 import worker_pb2 as pb
from readie_worker._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_worker.client import WorkerClient
from readie_worker.core import Capacity
from readie_worker.errors import PoolWorkerError
from readie_worker.grpc_service import WorkerServer, serve
from readie_worker.jobs import CodeJob, HostCall, HostReply, JobOutcome, Step
from readie_worker.remote_session import SessionLost
from readie_worker.sessions import StepOutcome

WAIT_S = 5.0  # the most any bounded wait below takes when things go right


# --------------------------------------------------------------------------- the fake runner


def _ok(text: str) -> JobOutcome:
    return JobOutcome(0, text, "", False, False, None, 1, "", (), None, "fake")


class FakeSession:
    """Steps by code: ``block`` waits for the runner's release, ``exit`` ends the session,
    ``call N`` makes N host calls (5 s deadline each); anything else returns at once."""

    def __init__(self, runner: FakeRunner, number: int) -> None:
        self._runner = runner
        self.id = f"fs-{number}"
        self.steps: list[str] = []  # codes, recorded as each step starts
        self.replies: list[HostReply] = []
        self.ended = False
        self.closed = threading.Event()

    def run_step(self, step, *, job_id=None, host=None, cancel=None):
        code = step.code
        self.steps.append(code)
        if code == "block":
            self._runner.release.wait(30)
        if code.startswith("call"):
            for call_id in range(1, int(code.split()[1]) + 1):
                self.replies.append(host(HostCall(call_id, "f", (), {}, time.monotonic() + 5)))
        if code == "exit":
            self.ended = True
        return StepOutcome(_ok(code), len(self.steps) + 1, code == "exit")

    def close(self) -> None:
        self.ended = True
        self.closed.set()


class FakeRunner:
    """The runner shape (runner.JobRunner) plus capacity/drain/close; jobs and openings by code.

    ``block`` waits for ``release``; ``raise`` is a bug; ``fail`` a PoolWorkerError;
    ``call N DEADLINE_S [ARG_BYTES]`` makes N host calls sharing one deadline.
    """

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.finished = 0
        self.sessions: list[FakeSession] = []
        self.replies: list[tuple[HostReply, float]] = []  # a job's host replies, seconds after the job began
        self.job_done = threading.Event()

    def capacity(self) -> Capacity:
        return Capacity(2, self.running, False, {}, True, sum(not s.closed.is_set() for s in self.sessions), 4)

    def run_job(self, job: CodeJob, job_id=None, host=None, cancel=None) -> JobOutcome:
        with self.lock:
            self.running += 1
        try:
            started = time.monotonic()
            word, *rest = job.code.split()
            if word == "block":
                self.release.wait(30)
            elif word == "raise":
                raise RuntimeError("a bug in the fake runner")
            elif word == "fail":
                raise PoolWorkerError("the fake worker failed the job")
            elif word == "call":
                calls, deadline = int(rest[0]), started + float(rest[1])
                payload = "x" * int(rest[2]) if len(rest) > 2 else None
                for call_id in range(1, calls + 1):
                    reply = host(HostCall(call_id, "f", (payload,) if payload else (), {}, deadline))
                    self.replies.append((reply, time.monotonic() - started))
                self.job_done.set()
            return _ok(job.code)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1

    def open_session(self, job: CodeJob, job_id=None, host=None, cancel=None):
        with self.lock:
            session = FakeSession(self, len(self.sessions) + 1)
            self.sessions.append(session)
        if job.code == "block":
            self.release.wait(30)
        return session, StepOutcome(_ok(job.code), 1, job.code == "exit")

    def drain(self, grace_s: float) -> None:
        pass

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- helpers


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    return wait_for(predicate, timeout)


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


def job_message(code: str, functions: tuple[str, ...] = (), timeout_ms: int = 5000) -> pb.InteractRequest:
    return pb.InteractRequest(job=pb.RunJobRequest(checkpoint="base", code=code, timeout_ms=timeout_ms, functions=functions))


def open_message(code: str, functions: tuple[str, ...] = ()) -> pb.InteractRequest:
    return pb.InteractRequest(open_session=pb.RunJobRequest(checkpoint="base", code=code, timeout_ms=5000, functions=functions))


def step_message(code: str) -> pb.InteractRequest:
    return pb.InteractRequest(step=pb.SessionStep(code=code))


def reply_message(call_id: int, result_json: bytes = b"1") -> pb.InteractRequest:
    return pb.InteractRequest(reply=pb.HostReply(call_id=call_id, result_json=result_json))


class RawStream:
    """An Interact call driven by hand: messages queued, events read only when asked."""

    def __init__(self, stub: pb_grpc.WorkerStub, *first: pb.InteractRequest, timeout: float | None = None) -> None:
        self.requests: queue.SimpleQueue[pb.InteractRequest | None] = queue.SimpleQueue()
        for message in first:
            self.requests.put(message)
        self.call = stub.Interact(iter(self.requests.get, None), timeout=timeout)

    def send(self, *messages: pb.InteractRequest) -> None:
        for message in messages:
            self.requests.put(message)

    def next(self) -> pb.InteractEvent:
        return next(self.call)

    def cancel(self) -> None:
        self.requests.put(None)  # grpc's writer thread ends with the iterator
        self.call.cancel()


class Served:
    def __init__(self, runner: FakeRunner, server: WorkerServer) -> None:
        self.runner = runner
        self.server = server
        self.address = server.address
        self._channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.WorkerStub(self._channel)
        self._cleanups: list[Callable[[], None]] = []

    def client(self) -> WorkerClient:
        client = WorkerClient(self.address)
        self._cleanups.append(client.close)
        return client

    def stream(self, *first: pb.InteractRequest, timeout: float | None = None) -> RawStream:
        stream = RawStream(self.stub, *first, timeout=timeout)
        self._cleanups.append(stream.cancel)
        return stream

    def stop(self) -> None:
        self.runner.release.set()
        for cleanup in reversed(self._cleanups):
            cleanup()
        self._channel.close()
        self.server.server.stop(0).wait()


@pytest.fixture
def serve_fake() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(max_streams: int | None = None) -> Served:
        runner = FakeRunner()
        served = Served(runner, serve(runner, "127.0.0.1:0", max_streams=max_streams))  # type: ignore[arg-type]
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


@pytest.fixture
def hang_ups(monkeypatch: pytest.MonkeyPatch) -> list[Interaction]:
    """Interactions whose RPC has ended on the server (its hang-up callback ran), in order."""
    ended: list[Interaction] = []
    original = Interaction._hang_up

    def spy(self: Interaction) -> None:
        original(self)
        ended.append(self)

    monkeypatch.setattr(Interaction, "_hang_up", spy)
    return ended


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


# --------------------------------------------------------------------------- a cancelled session runs nothing more


@pytest.mark.parametrize("during", ["opening", "first step"])
def test_a_session_cancelled_during_its_first_step_runs_none_of_its_queued_steps(serve_fake, hang_ups, during):
    served = serve_fake()
    runner = served.runner
    if during == "opening":
        stream = served.stream(open_message("block"), step_message("s1"), step_message("s2"), step_message("s3"))
        assert wait_until(lambda: len(runner.sessions) == 1)
    else:
        stream = served.stream(open_message("open"))
        assert stream.next().result.step == 1
        stream.send(step_message("block"), step_message("s2"), step_message("s3"), step_message("s4"))
        assert wait_until(lambda: runner.sessions[0].steps == ["block"])
    stream.cancel()
    assert wait_until(lambda: len(hang_ups) == 1)  # the server has seen the cancellation
    runner.release.set()  # only now does the step (or the opening) end

    session = runner.sessions[0]
    assert session.closed.wait(WAIT_S), "the worker never closed the cancelled session"
    assert session.steps == {"opening": [], "first step": ["block"]}[during]


def test_steps_held_during_a_host_call_do_not_run_after_the_client_cancels(serve_fake, monkeypatch):
    original = Interaction._hang_up

    def late_hang_up(self: Interaction) -> None:
        # grpc wakes the request iterator before it runs the end callbacks (grpc/_server.py
        # _receive_message, then the serve loop's callbacks); this only widens that window.
        time.sleep(0.2)
        original(self)

    monkeypatch.setattr(Interaction, "_hang_up", late_hang_up)
    served = serve_fake()
    runner = served.runner
    stream = served.stream(open_message("open", functions=("f",)))
    assert stream.next().result.step == 1
    stream.send(step_message("call 1"))
    assert stream.next().WhichOneof("kind") == "call"
    stream.send(step_message("s2"), step_message("s3"))  # held while the call waits
    time.sleep(0.1)  # let them reach the worker's inbox before the cancellation
    stream.cancel()

    session = runner.sessions[0]
    assert session.closed.wait(WAIT_S), "the worker never closed the cancelled session"
    assert session.replies[0].error is not None  # the waiting call was answered with an error
    assert session.steps == ["call 1"], f"steps ran after the client cancelled: {session.steps[1:]}"


# --------------------------------------------------------------------------- a client that does not read


def test_a_host_call_nobody_answers_gets_an_error_reply_by_its_deadline(serve_fake):
    served = serve_fake()
    runner = served.runner
    # No deadline on the RPC, no replies, events never read.
    served.stream(job_message("call 1 1.0", functions=("f",)))
    assert runner.job_done.wait(WAIT_S), "the fake's host callback was held past the call's deadline"
    [(reply, after_s)] = runner.replies
    assert reply.error is not None and "no reply" in reply.error
    assert 0.9 <= after_s < 1.0 + 0.5


def test_a_client_that_replies_blind_but_never_reads_does_not_hold_host_calls_past_their_deadline(serve_fake):
    served = serve_fake()
    runner = served.runner
    calls, deadline_s = 40, 1.5
    stream = served.stream(job_message(f"call {calls} {deadline_s} 500000", functions=("f",)))
    # A reply to every call the worker will make, sent without reading a single event: the
    # calls' half-megabyte events fill grpc's window and the outbox behind it.
    stream.send(*(reply_message(call_id) for call_id in range(1, calls + 1)))
    assert runner.job_done.wait(deadline_s + WAIT_S), "the fake's host callback was held past the calls' deadline"
    assert len(runner.replies) == calls
    errors = [(reply, after_s) for reply, after_s in runner.replies if reply.error is not None]
    assert errors, "every call was answered, so the outbox never filled: the test proves nothing"
    assert runner.replies[0][0].result == 1  # the blind replies were taken while events could still go out
    assert all("not reading" in reply.error or "deadline" in reply.error for reply, _ in errors)
    assert max(after_s for _, after_s in runner.replies) < deadline_s + 0.5


# --------------------------------------------------------------------------- steps sent early wait their turn


def test_steps_sent_while_a_host_call_waits_are_held_and_run_after_it_in_order(serve_fake):
    served = serve_fake()
    runner = served.runner
    stream = served.stream(open_message("open", functions=("f",)))
    assert stream.next().result.step == 1
    stream.send(step_message("call 1"))
    call = stream.next().call
    assert (call.call_id, call.function) == (1, "f")

    stream.send(step_message("s2"), step_message("s3"), step_message("s4"))
    time.sleep(0.1)  # they reach the worker while the call still waits
    assert runner.sessions[0].steps == ["call 1"]
    stream.send(reply_message(1, b'"answer"'))

    results = [stream.next().result for _ in range(4)]
    assert [(r.stdout, r.step) for r in results] == [("call 1", 2), ("s2", 3), ("s3", 4), ("s4", 5)]
    assert runner.sessions[0].steps == ["call 1", "s2", "s3", "s4"]
    assert runner.sessions[0].replies == [HostReply(result="answer")]
    stream.send(None)  # the client closes its side: the session ends with the stream
    with pytest.raises(StopIteration):
        stream.next()
    assert runner.sessions[0].closed.wait(WAIT_S)
