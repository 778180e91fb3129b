"""Jobs on the Interact stream against a real ``readie worker`` process and real gVisor sandboxes.

The tests are the client, a hostile or sloppy one: they drive the raw
generated stub, feeding its request stream from a queue, so they can send
what no honest client would (_interact_worker.py). Covered:

* a job calling a declared host function: the call event's fields, the
  reply's result back in the sandbox (big integers and deep nesting exact),
  an error reply as ``readie_host.HostError``, host stats, the stream's end;
* a host call nobody answers: the job's own timeout ends it;
* protocol violations: a first message that is not a job or a session, a
  reply that is not JSON (or NaN, or over 1 MB), too many stale replies:
  INVALID_ARGUMENT naming the field, and the worker serves on; the unary
  RunJob refusing ``functions``;
* ``WorkerClient``: host functions, and a host's error text with a lone
  surrogate reaching the sandbox.

Sessions, a remote session lost when its worker drains, and the stream and
session limits: test_interact_runsc_sessions.py. Every worker must end with
no runsc containers left.
"""

from __future__ import annotations

import json
import time

import grpc
import pytest

from readie_rpc._interact import MAX_STALE_REPLIES
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc.client import WorkerClient
from readie_worker.jobs import CodeJob
from readie_worker.testing import FakeHost
from rpc.tests._interact_worker import (
    JOB_TIMEOUT_MS,
    STREAM_DEADLINE_S,
    Stream,
    invalid_argument,
    job,
    open_stream,
    unary_job,
    wait_until,
)
from rpc.tests._interact_worker import worker, worker_dir  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc


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
