"""Steps and host calls on Interact streams: a fake runner behind the real ``serve()`` on loopback.

No runsc: a fake runner (_interact_fakes.py) stands in for the worker; the
gRPC service and ``_interact.Interaction`` are the real ones, driven by raw
streams. Covered:

* a cancelled session runs none of the steps it had queued, including
  steps held while a host call waited;
* a client that never reads events (and never replies, or replies blind so
  the outbox fills) does not hold the runner's host callback past the
  call's deadline: it gets an error reply by then;
* steps sent while a host call waits are held and run after it, in order;
* a short reply goes on from the stream's reader (``HostCall.reply_now``), a long one does not.

Where a test must know the server has seen a cancellation, it spies on
``Interaction._hang_up`` (the RPC's end callback) rather than sleeping.

Request-writer threads and the stream cap: test_interact_streams_resources.py.
Real sandboxes behind the same stream: test_interact_runsc_jobs.py and
test_interact_runsc_sessions.py.
"""

from __future__ import annotations

import time

import grpc
import pytest

from readie_rpc._interact import Interaction
from readie_policy.jobs import MAX_EARLY_REPLY_BYTES
from readie_worker.jobs import HostReply
from rpc.tests._interact_fakes import (
    WAIT_S,
    job_message,
    open_message,
    reply_message,
    step_message,
    wait_until,
)
from rpc.tests._interact_fakes import hang_ups, serve_fake  # noqa: F401 - fixtures


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


def test_a_client_that_replies_blind_but_never_reads_does_not_hold_host_calls_past_their_deadline(serve_fake, hang_ups):
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
    assert hang_ups == []  # a call's event that could not go failed that call alone, never the stream


def test_a_client_that_stops_reading_has_its_rpc_ended_when_its_result_cannot_go(serve_fake, hang_ups, monkeypatch):
    import readie_rpc._interact as interact

    monkeypatch.setattr(interact, "RESULT_SEND_S", 0.5)
    served = serve_fake()
    stream = served.stream(job_message("call 20 1.0 500000", functions=("f",)))
    stream.send(*(reply_message(call_id) for call_id in range(1, 21)))  # answered blind, never read
    assert served.runner.job_done.wait(WAIT_S)
    # The result waited its 0.5 s behind events grpc could not send: the server ends the RPC, so the
    # thread grpc's send held is free again, though the client still holds its side open.
    deadline = time.monotonic() + WAIT_S
    while not hang_ups and time.monotonic() < deadline:
        time.sleep(0.05)
    assert hang_ups, "the RPC of a client that stopped reading was never ended: its server thread stays held"
    with pytest.raises(grpc.RpcError) as ended:
        while True:
            stream.next()
    assert ended.value.code() == grpc.StatusCode.CANCELLED


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


# --------------------------------------------------------------------------- replies sent on by the reader


def test_a_short_reply_goes_on_from_the_streams_reader_and_a_long_one_waits_for_the_driver(serve_fake):
    served = serve_fake()
    runner = served.runner
    stream = served.stream(job_message("call 3 5.0", functions=("f",)))
    long = b'"' + b"x" * MAX_EARLY_REPLY_BYTES + b'"'
    for call_id, result_json in ((1, b"[1, 2]"), (2, long), (3, b"not json")):
        event = stream.next()
        assert event.call.call_id == call_id, event
        stream.send(reply_message(call_id, result_json))
    with pytest.raises(grpc.RpcError) as ended:  # the client broke the protocol: the stream ends
        stream.next()
    assert ended.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    # The job saw every reply as the driver read it, the bad one as the client's break.
    assert [reply.result for reply, _ in runner.replies[:2]] == [[1, 2], "x" * MAX_EARLY_REPLY_BYTES]
    assert "broke the protocol" in runner.replies[2][0].error
    # Only the short, valid reply went on early, and from the reader, before the driver had it.
    assert [(call_id, thread, reply.result) for call_id, thread, reply in runner.early] == [(1, "interact-read", [1, 2])]
