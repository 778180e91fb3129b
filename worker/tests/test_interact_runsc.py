"""The Interact stream against a real ``readie worker`` process and real gVisor sandboxes.

The tests are the client, a hostile or sloppy one: they drive the raw
generated stub, feeding its request stream from a queue, so they can send
what no honest client would. Covered:

* a job calling a declared host function: the call event's fields, the
  reply's result back in the sandbox (big integers and deep nesting exact),
  an error reply as ``readie_host.HostError``, host stats, the stream's end;
* protocol violations: a first message that is not a job or a session, a
  reply that is not JSON (or NaN, or over 1 MB), too many stale replies, a
  non-step message on an open session: INVALID_ARGUMENT naming the field,
  and the worker serves on; the unary RunJob refusing ``functions``;
* sessions: steps keeping ``__main__``, step numbers, SystemExit ending the
  session; the sandbox destroyed when the client half-closes, cancels (also
  while a host call waits), or breaks the protocol;
* a host call nobody answers: the job's own timeout ends it;
* ``max_sessions`` over gRPC (an in-process worker): UNAVAILABLE;
* ``WorkerClient`` and ``RemoteSession``: host functions, steps, and a
  session lost when its worker drains.

* steps sent before the previous one's result: queued, run in order;
* streams beyond the server's limit refused at once (Capacity still
  answers), and a stream that never sends a first message refused;
* a host's error text with a lone surrogate reaching the sandbox.

Every worker must end with no runsc containers left.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from readie_worker._interact import MAX_STALE_REPLIES
from readie_worker._proto.readie.v1 import worker_pb2 as pb
from readie_worker._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_worker.client import WorkerClient
from readie_worker.core import Worker, WorkerConfig
from readie_worker.grpc_service import serve
from readie_worker.jobs import CodeJob, Step
from readie_worker.remote_session import SessionLost
from readie_worker.testing import FakeHost, WorkerProcess, stop_worker
from readie_worker.testing import wait_until as wait_for
from readie_worker.testing import start_worker as _start_worker

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

WARM = 1  # base sandboxes the module's worker keeps ready
# gRPC deadline of every raw stream: far above any job here, so a hung worker fails the test.
STREAM_DEADLINE_S = 60
# How long a sandbox may take to be destroyed once its session ended.
GONE_WITHIN_S = 10
JOB_TIMEOUT_MS = 20_000


def start_worker(base: Path, name: str) -> WorkerProcess:
    return _start_worker(base, name, CHECKPOINTS / "manifest.json", f"base={WARM}")


@pytest.fixture(scope="module")
def worker_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ri-", dir="/tmp"))  # short: sandbox socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def worker(worker_dir: Path) -> Iterator[WorkerProcess]:
    process = start_worker(worker_dir / "a", "interact-a")
    yield process
    wait_until(lambda: only_warm(process), "the worker kept sandboxes beyond its warm pool")
    assert stop_worker(process) == 0, process.log_path.read_text()[-3000:]
    assert process.containers() == []


# --------------------------------------------------------------------------- helpers


class Stream:
    """One raw Interact call whose requests the test writes one by one; ``close`` half-closes."""

    def __init__(
        self, stub: pb_grpc.WorkerStub, *first: pb.InteractRequest, deadline_s: float = STREAM_DEADLINE_S
    ) -> None:
        self._requests: queue.SimpleQueue[pb.InteractRequest | None] = queue.SimpleQueue()
        for request in first:
            self._requests.put(request)
        self.call = stub.Interact(iter(self._requests.get, None), timeout=deadline_s)

    def send(self, **kind: object) -> None:
        self._requests.put(pb.InteractRequest(**kind))

    def reply(self, call_id: int, result: object = None, **outcome: object) -> None:
        if not outcome:
            outcome = {"result_json": json.dumps(result).encode()}
        self.send(reply=pb.HostReply(call_id=call_id, **outcome))

    def step(self, code: str, **fields: object) -> None:
        self.send(step=pb.SessionStep(code=code, **fields))

    def close(self) -> None:
        self._requests.put(None)

    def event(self, kind: str) -> pb.HostCall | pb.RunJobResponse:
        event = next(self.call)
        assert event.WhichOneof("kind") == kind, event
        return getattr(event, kind)

    def result(self) -> pb.RunJobResponse:
        return self.event("result")  # type: ignore[return-value]

    def host_call(self) -> pb.HostCall:
        return self.event("call")  # type: ignore[return-value]

    def ends_ok(self) -> None:
        assert list(self.call) == []
        assert self.call.code() == grpc.StatusCode.OK

    def refused(self) -> grpc.RpcError:
        """The status the stream ends with, after no further events."""
        with pytest.raises(grpc.RpcError) as ended:
            assert list(self.call) == []
        return ended.value


def job(code: str, functions: tuple[str, ...] = (), **fields: object) -> pb.RunJobRequest:
    fields.setdefault("timeout_ms", JOB_TIMEOUT_MS)
    return pb.RunJobRequest(checkpoint="base", code=code, name="cell.py", functions=functions, **fields)


def open_stream(
    stub: pb_grpc.WorkerStub, kind: str, code: str, functions: tuple[str, ...] = (), **fields: object
) -> Stream:
    return Stream(stub, pb.InteractRequest(**{kind: job(code, functions, **fields)}))


def invalid_argument(error: grpc.RpcError, field: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert dict(error.trailing_metadata()) == {"readie-error": "RequestError", "readie-field": field}
    assert error.details().startswith(f"{field}: ")


def capacity(worker: WorkerProcess) -> pb.CapacityResponse:
    return worker.stub.Capacity(pb.CapacityRequest(), timeout=5)


def wait_until(condition: Callable[[], bool], failure: str, within_s: float = GONE_WITHIN_S) -> None:
    assert wait_for(condition, within_s, poll_s=0.05), failure


def only_warm(worker: WorkerProcess) -> bool:
    """No job, no session, and no sandbox beyond the warm pool's (ready, or one being restored)."""
    reply = capacity(worker)
    targets = sum(pool.target for pool in reply.pools.values())
    return reply.busy == 0 and reply.sessions == 0 and len(worker.containers()) <= targets


def session_gone(worker: WorkerProcess, sandbox_id: str) -> None:
    wait_until(
        lambda: sandbox_id not in worker.containers() and only_warm(worker),
        f"session sandbox {sandbox_id} outlived its session",
    )


def unary_job(worker: WorkerProcess, code: str) -> pb.RunJobResponse:
    """A unary job: the worker still serves after whatever came before."""
    return worker.stub.RunJob(job(code), timeout=STREAM_DEADLINE_S)


# --------------------------------------------------------------------------- jobs with host functions


def test_a_declared_function_is_called_and_its_reply_returned(worker):
    code = "from readie_host import lookup\nprint(lookup('readie', 2, limit=3))"
    stream = open_stream(worker.stub, "job", code, ("lookup",))
    call = stream.host_call()
    assert (call.call_id, call.function) == (1, "lookup")
    assert (json.loads(call.args_json), json.loads(call.kwargs_json)) == (["readie", 2], {"limit": 3})
    assert 0 < call.deadline_ms <= JOB_TIMEOUT_MS
    stream.reply(1, {"hits": ["first", "second"]})
    result = stream.result()
    assert (result.exit, result.stdout, result.HasField("error")) == (0, "{'hits': ['first', 'second']}\n", False)
    host = result.host
    assert (host.calls, host.replies, host.host_errors, host.junk, host.forged) == (1, 1, 0, 0, 0)
    assert result.backend == "gvisor:runsc-restore" and not result.HasField("session_id")
    stream.ends_ok()


def test_big_integers_and_deep_nesting_survive_a_reply_exactly(worker):
    code = (
        "from readie_host import echo\n"
        "big = echo('big')\n"
        "print(*big, sep='\\n')\n"
        "value, depth = echo('deep'), 0\n"
        "while isinstance(value, list):\n"
        "    value, depth = value[0], depth + 1\n"
        "print(depth, value)\n"
    )
    big = [2**64 + 1, -(2**200), 10**4000 + 7]
    stream = open_stream(worker.stub, "job", code, ("echo",))
    assert stream.host_call().call_id == 1
    stream.reply(1, big)
    assert stream.host_call().call_id == 2
    depth = 10_000
    stream.send(reply=pb.HostReply(call_id=2, result_json=b"[" * depth + b'"bottom"' + b"]" * depth))
    result = stream.result()
    assert result.stdout == "".join(f"{number}\n" for number in big) + f"{depth} bottom\n", result.error
    assert (result.host.calls, result.host.replies) == (2, 2)
    stream.ends_ok()


def test_an_error_reply_raises_host_error_in_the_sandbox(worker):
    code = (
        "import readie_host\n"
        "try:\n"
        "    readie_host.lookup('x')\n"
        "except readie_host.HostError as exc:\n"
        "    print('caught:', type(exc).__name__, exc)\n"
    )
    stream = open_stream(worker.stub, "job", code, ("lookup",))
    stream.reply(stream.host_call().call_id, error="backend unavailable")
    result = stream.result()
    assert (result.exit, result.stdout) == (0, "caught: HostError backend unavailable\n")
    assert (result.host.calls, result.host.replies, result.host.host_errors) == (1, 1, 1)
    stream.ends_ok()


def test_no_reply_before_the_jobs_timeout_ends_it_with_timeout_error(worker):
    code = "from readie_host import slow\nslow()\nprint('answered')"
    stream = open_stream(worker.stub, "job", code, ("slow",), timeout_ms=1500)
    call = stream.host_call()
    assert 0 < call.deadline_ms <= 1500
    started = time.monotonic()
    result = stream.result()
    assert result.error.type == "TimeoutError" and "1500 ms" in result.error.message, result.error
    assert (result.HasField("exit"), result.stdout) == (False, "")
    assert time.monotonic() - started < 5
    stream.ends_ok()
    wait_until(lambda: result.sandbox_id not in worker.containers(), "the timed-out sandbox was kept")


# --------------------------------------------------------------------------- protocol violations


@pytest.mark.parametrize(
    ("first", "field"),
    [(pb.InteractRequest(step=pb.SessionStep(code="print(1)")), "step"), (pb.InteractRequest(), "kind")],
    ids=["step", "nothing"],
)
def test_the_first_message_must_be_a_job_or_open_session(worker, first, field):
    invalid_argument(Stream(worker.stub, first).refused(), field)


def test_a_first_message_that_is_a_reply_is_refused(worker):
    stream = Stream(worker.stub, pb.InteractRequest(reply=pb.HostReply(call_id=1, result_json=b"1")), deadline_s=3)
    invalid_argument(stream.refused(), "reply")


def test_a_stream_closed_before_its_first_message_ends_quietly(worker):
    stream = Stream(worker.stub)
    stream.close()
    stream.ends_ok()


def test_unary_run_job_refuses_host_functions(worker):
    with pytest.raises(grpc.RpcError) as refused:
        worker.stub.RunJob(job("print(1)", ("lookup",)), timeout=STREAM_DEADLINE_S)
    invalid_argument(refused.value, "functions")


@pytest.mark.parametrize(
    "result_json",
    [b"{not json", b"NaN", b'"' + b"x" * 1_000_001 + b'"'],
    ids=["not-json", "nan", "over-1mb"],
)
def test_a_bad_reply_during_a_call_ends_the_stream(worker, result_json):
    stream = open_stream(worker.stub, "job", "from readie_host import lookup\nlookup()", ("lookup",))
    stream.send(reply=pb.HostReply(call_id=stream.host_call().call_id, result_json=result_json))
    invalid_argument(stream.refused(), "reply.result_json")
    assert unary_job(worker, "print('still serving')").stdout == "still serving\n"


def test_stale_replies_are_skipped_while_a_call_waits(worker):
    stream = open_stream(worker.stub, "job", "from readie_host import lookup\nprint(lookup())", ("lookup",))
    assert stream.host_call().call_id == 1
    for stale in range(MAX_STALE_REPLIES):  # ids no call has: 0, then 2 upward
        stream.reply(0 if stale == 0 else stale + 1, "stale")
    stream.reply(1, "fresh")
    result = stream.result()
    assert (result.exit, result.stdout) == (0, "fresh\n")
    assert (result.host.calls, result.host.replies) == (1, 1)
    stream.ends_ok()


def test_more_stale_replies_than_allowed_break_the_protocol(worker):
    stream = open_stream(worker.stub, "job", "from readie_host import lookup\nprint(lookup())", ("lookup",))
    assert stream.host_call().call_id == 1
    for stale in range(MAX_STALE_REPLIES + 1):
        stream.reply(stale + 2, "stale")
    invalid_argument(stream.refused(), "reply.call_id")
    assert str(MAX_STALE_REPLIES) in stream.call.details()


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


def test_worker_client_answers_host_calls_with_its_host(worker):
    client = WorkerClient(f"127.0.0.1:{worker.port}")
    try:
        host = FakeHost(add=lambda a, b: a + b)
        code = "from readie_host import add\nprint(add(2**64, b=1))"
        asked = CodeJob(checkpoint="base", code=code, functions=host.names)
        outcome = client.run_job(asked, "interact-client-1", host=host)
    finally:
        client.close()
    assert (outcome.exit, outcome.stdout, outcome.error) == (0, f"{2**64 + 1}\n", None)
    calls = [(call.call_id, call.function, call.args, call.kwargs) for call in host.calls]
    assert calls == [(1, "add", (2**64,), {"b": 1})]
    assert (outcome.host.calls, outcome.host.replies) == (1, 1)


def test_a_host_error_text_with_a_lone_surrogate_reaches_the_sandbox(worker):
    def load(name: str) -> None:
        raise FileNotFoundError(f"no such file: {name}\udcff.csv")  # as os.fsdecode leaves undecodable bytes

    client = WorkerClient(f"127.0.0.1:{worker.port}")
    code = (
        "import readie_host\n"
        "try:\n"
        "    readie_host.load('data')\n"
        "except readie_host.HostError as exc:\n"
        "    print('caught:', ascii(str(exc)))\n"
    )
    try:
        host = FakeHost(load=load)
        outcome = client.run_job(CodeJob(checkpoint="base", code=code, functions=host.names), host=host)
    finally:
        client.close()
    # However a fix escapes the surrogate, the call fails with the text, not the job.
    assert outcome.exit == 0 and outcome.stdout.startswith("caught: 'no such file: data"), outcome
    assert (outcome.host.calls, outcome.host.host_errors) == (1, 1)


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
    from readie_worker import _interact

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
