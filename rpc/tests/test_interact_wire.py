"""The Interact stream's pure parts: no server, no sandbox.

Covered: host calls and replies as proto messages and back (``_host_wire``:
lossless big integers, undeclared functions, oversized or malformed arguments,
unencodable results turned into error replies, replies without an outcome or
with bad JSON), a session step's bounds (``_convert.session_step``, each
refusal naming its field under ``step.``), and the ``_mailbox.Mailbox`` that
joins the stream's threads (bounded puts, close, drain, timeouts), an
error text with a lone surrogate still becoming an error reply, and a relayed
call's ``reply_now`` (``RelayedReply``: once, and never after the caller's
thread has its reply), and that the stream's reader sends on only a reply the driver takes
next (``Interaction`` driven directly: no server).
"""

from __future__ import annotations

import json
import queue
import threading
import time

import pytest

from readie_executor.hostwire import MAX_ARGUMENT_BYTES, MAX_CALL_ID, MAX_RESULT_BYTES
from readie_executor.jobs import bounds
from readie_protocol.requests import MAX_NAME_CHARS, MAX_TIMEOUT_MS
from readie_rpc._client_wire import session_step_message
from readie_rpc._convert import session_step
from readie_worker.jobs import Step
from readie_rpc._host_wire import call_from_message, call_message, reply_from_message, reply_message
from readie_rpc._interact import MAX_STALE_REPLIES, Interaction
from readie_rpc._interact_stream import InteractStream, RelayedReply
from readie_rpc._mailbox import CLOSED, Mailbox
from readie_worker.testing import wait_until
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_worker.errors import PoolWorkerError, RequestError
from readie_worker.jobs import HostCall, HostReply, JobOutcome

BIG = [2**64 + 1, -(2**200), 10**4000]
# Long enough for a thread to block; short enough to keep the tests quick.
BLOCKED_S = 0.2


# --------------------------------------------------------------------------- calls: worker -> client


def test_a_call_crosses_both_ways_with_big_integers_exact():
    kwargs = {"limit": 2**70, "deep": {"a": [None, True, 0.5]}}
    message = call_message(HostCall(3, "lookup", ("q", BIG), kwargs, time.monotonic() + 10))
    assert (message.call_id, message.function) == (3, "lookup")
    assert (json.loads(message.args_json), json.loads(message.kwargs_json)) == (["q", BIG], kwargs)
    assert 9_000 < message.deadline_ms <= 10_000

    back = call_from_message(message, {"lookup"})
    assert back == HostCall(3, "lookup", ("q", BIG), kwargs)
    assert 9 < back.deadline - time.monotonic() <= 10


def test_a_call_past_its_deadline_says_zero_ms():
    assert call_message(HostCall(1, "f", (), {}, time.monotonic() - 5)).deadline_ms == 0
    assert call_message(HostCall(1, "f", (), {}, None)).deadline_ms == 0


def test_a_call_to_an_undeclared_function_is_refused():
    message = pb.HostCall(call_id=1, function="delete_everything", args_json=b"[]", kwargs_json=b"{}")
    with pytest.raises(PoolWorkerError, match="'delete_everything', which was not declared"):
        call_from_message(message, {"lookup"})


@pytest.mark.parametrize("call_id", [0, MAX_CALL_ID + 1])
def test_a_call_id_out_of_range_is_refused(call_id):
    message = pb.HostCall(call_id=call_id, function="f", args_json=b"[]", kwargs_json=b"{}")
    with pytest.raises(PoolWorkerError, match=f"id {call_id}"):
        call_from_message(message, {"f"})


def test_arguments_over_a_megabyte_are_refused_before_parsing():
    half = MAX_ARGUMENT_BYTES // 2
    args = b'["' + b"x" * half + b'"]'
    kwargs = b'{"k":"' + b"y" * half + b'"}'
    message = pb.HostCall(call_id=1, function="f", args_json=args, kwargs_json=kwargs)
    with pytest.raises(PoolWorkerError, match=f"{len(args) + len(kwargs)} bytes of arguments"):
        call_from_message(message, {"f"})


@pytest.mark.parametrize(
    ("args_json", "kwargs_json"),
    [(b'{"a": 1}', b"{}"), (b"1", b"{}"), (b"[]", b"[]"), (b"[]", b"null")],
)
def test_arguments_that_are_not_an_array_and_an_object_are_refused(args_json, kwargs_json):
    message = pb.HostCall(call_id=1, function="f", args_json=args_json, kwargs_json=kwargs_json)
    with pytest.raises(PoolWorkerError, match="not an array and an object"):
        call_from_message(message, {"f"})


@pytest.mark.parametrize("args_json", [b"[NaN]", b"[1,", b"\xff[]", b""])
def test_arguments_that_are_not_json_are_refused(args_json):
    message = pb.HostCall(call_id=1, function="f", args_json=args_json, kwargs_json=b"{}")
    with pytest.raises(PoolWorkerError, match="not valid JSON"):
        call_from_message(message, {"f"})


# --------------------------------------------------------------------------- replies: client -> worker


def test_a_result_crosses_both_ways_losslessly():
    deep = "bottom"
    for _ in range(10_000):
        deep = [deep]
    message = reply_message(9, HostReply(result={"big": BIG, "deep": deep, "text": "é😀\ud800"}))
    assert message.WhichOneof("outcome") == "result_json"
    call_id, reply = reply_from_message(message)
    assert (call_id, reply.error) == (9, None)
    assert reply.result["big"] == BIG and reply.result["text"] == "é😀\ud800"
    depth, value = 0, reply.result["deep"]
    while isinstance(value, list):
        depth, value = depth + 1, value[0]
    assert (depth, value) == (10_000, "bottom")


def test_an_error_crosses_both_ways():
    message = reply_message(4, HostReply(error="backend unavailable"))
    assert (message.call_id, message.WhichOneof("outcome"), message.error) == (4, "error", "backend unavailable")
    assert reply_from_message(message) == (4, HostReply(error="backend unavailable"))


@pytest.mark.parametrize(
    ("result", "problem"),
    [
        (float("nan"), "nan is not JSON"),
        (float("inf"), "inf is not JSON"),
        (object(), "object is not JSON"),
        ({1: "non-str key"}, "keys must be str"),
        ("x" * (MAX_RESULT_BYTES + 1), "result too large"),
    ],
)
def test_an_unencodable_result_becomes_an_error_reply(result, problem):
    message = reply_message(2, HostReply(result=result))
    assert (message.call_id, message.WhichOneof("outcome")) == (2, "error")
    assert message.error.startswith("the host's result cannot be sent: ") and problem in message.error


def test_a_circular_result_becomes_an_error_reply():
    loop: list = []
    loop.append(loop)
    message = reply_message(1, HostReply(result=loop))
    assert message.WhichOneof("outcome") == "error" and "circular reference" in message.error


def test_an_error_text_with_a_lone_surrogate_still_makes_an_error_reply():
    message = reply_message(1, HostReply(error="no such file: 'data-\udcff.csv'"))
    assert message.WhichOneof("outcome") == "error" and message.error.startswith("no such file: 'data-")


def test_a_reply_without_an_outcome_is_refused():
    with pytest.raises(RequestError, match="result_json or error") as refused:
        reply_from_message(pb.HostReply(call_id=1))
    assert refused.value.field == "reply"


@pytest.mark.parametrize(
    "result_json", [b"{not json", b"NaN", b"[Infinity]", b'{"a":1,"a":2}', b"\xff", b""]
)
def test_a_result_that_is_not_json_is_refused(result_json):
    with pytest.raises(RequestError, match="not valid JSON") as refused:
        reply_from_message(pb.HostReply(call_id=1, result_json=result_json))
    assert refused.value.field == "reply.result_json"


def test_a_result_over_a_megabyte_is_refused_by_size():
    result_json = b'"' + b"x" * MAX_RESULT_BYTES + b'"'
    with pytest.raises(RequestError, match=f"{len(result_json)} bytes; at most {MAX_RESULT_BYTES}") as refused:
        reply_from_message(pb.HostReply(call_id=1, result_json=result_json))
    assert refused.value.field == "reply.result_json"
    exactly = b'"' + b"x" * (MAX_RESULT_BYTES - 2) + b'"'
    assert reply_from_message(pb.HostReply(call_id=1, result_json=exactly))[1].result == "x" * (MAX_RESULT_BYTES - 2)


# --------------------------------------------------------------------------- session steps


def test_a_step_round_trips_and_unset_limits_stay_unset():
    asked = Step("x += 1", "cell-2.py", ("a",), 5000, 64)
    assert session_step(session_step_message(asked)) == asked
    assert session_step(pb.SessionStep(code="pass")) == Step("pass", "<string>", ())


@pytest.mark.parametrize(
    ("step", "field", "problem"),
    [
        (pb.SessionStep(code="print(1)\0"), "step.code", "contains a NUL character"),
        (pb.SessionStep(code="pass", name="n" * (MAX_NAME_CHARS + 1)), "step.name", "characters long"),
        (pb.SessionStep(code="pass", name="cell\0.py"), "step.name", "contains a NUL character"),
        (pb.SessionStep(code="pass", args=["ok", "a\0"]), "step.args[1]", "contains a NUL character"),
        (pb.SessionStep(code="pass", timeout_ms=-1), "step.timeout_ms", f"must be between 1 and {MAX_TIMEOUT_MS}, got -1"),
        (pb.SessionStep(code="pass", timeout_ms=0), "step.timeout_ms", f"must be between 1 and {MAX_TIMEOUT_MS}, got 0"),
        (pb.SessionStep(code="pass", timeout_ms=MAX_TIMEOUT_MS + 1), "step.timeout_ms", f"got {MAX_TIMEOUT_MS + 1}"),
        (pb.SessionStep(code="pass", max_output=-1), "step.max_output", "must be between 0 and"),
    ],
    ids=["nul-code", "long-name", "nul-name", "nul-arg", "negative-timeout", "zero-timeout", "over-a-day", "negative-output"],
)
def test_a_bad_step_is_refused_naming_its_field(step, field, problem):
    with pytest.raises(RequestError, match=problem) as refused:
        session_step(step)
    assert refused.value.field == field
    assert str(refused.value).startswith(f"{field}: ")


# --------------------------------------------------------------------------- the mailbox


def _in_thread(target) -> threading.Thread:
    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    return thread


def test_items_come_out_in_order():
    box: Mailbox[int] = Mailbox(3)
    assert [box.put(n) for n in (1, 2, 3)] == [True, True, True]
    assert [box.get(), box.get(), box.get()] == [1, 2, 3]


def test_a_full_mailbox_blocks_put_until_a_get():
    box: Mailbox[int] = Mailbox(1)
    assert box.put(1)
    outcome: list[bool] = []
    putter = _in_thread(lambda: outcome.append(box.put(2)))
    putter.join(BLOCKED_S)
    assert putter.is_alive() and outcome == []
    assert box.get() == 1
    putter.join(5)
    assert outcome == [True]
    assert box.get() == 2


def test_close_wakes_a_blocked_put_and_later_puts_fail():
    box: Mailbox[int] = Mailbox(1)
    assert box.put(1)
    outcome: list[bool] = []
    putter = _in_thread(lambda: outcome.append(box.put(2)))
    putter.join(BLOCKED_S)
    assert putter.is_alive()
    box.close()
    putter.join(5)
    assert outcome == [False]
    assert box.put(3) is False
    assert (box.get(), box.get()) == (1, CLOSED)  # the dropped items never arrive


def test_get_drains_what_is_left_after_close_then_says_closed():
    box: Mailbox[str] = Mailbox(4)
    box.put("a")
    box.put("b")
    box.close()
    assert [box.get(), box.get(), box.get(), box.get(timeout=0)] == ["a", "b", CLOSED, CLOSED]


def test_get_with_a_timeout_gives_none_when_nothing_comes():
    box: Mailbox[int] = Mailbox(1)
    started = time.monotonic()
    assert box.get(timeout=BLOCKED_S) is None
    assert time.monotonic() - started >= BLOCKED_S * 0.9
    assert box.get(timeout=0) is None


def test_close_wakes_a_blocked_get():
    box: Mailbox[int] = Mailbox(1)
    got: list[object] = []
    getter = _in_thread(lambda: got.append(box.get()))
    getter.join(BLOCKED_S)
    assert getter.is_alive()
    box.close()
    getter.join(5)
    assert got == [CLOSED]


def test_a_put_wakes_a_get_waiting_with_a_timeout():
    box: Mailbox[int] = Mailbox(1)
    got: list[object] = []
    getter = _in_thread(lambda: got.append(box.get(timeout=10)))
    getter.join(BLOCKED_S)
    box.put(7)
    getter.join(5)
    assert got == [7]


def test_a_relayed_call_and_reply_keep_the_bytes_they_arrived_in():
    # A router parses what it relays (to check it) but never encodes it again:
    # the spacing, which an encoder would drop, crosses both hops as it came.
    arrived = pb.HostCall(call_id=3, function="search", args_json=b'[1, {"a": 2}]', kwargs_json=b'{"k": [ ]}', deadline_ms=5000)
    call = call_from_message(arrived, {"search"})
    assert (call.args, call.kwargs) == ((1, {"a": 2}), {"k": []})
    relayed = call_message(call)
    assert (relayed.args_json, relayed.kwargs_json) == (arrived.args_json, arrived.kwargs_json)
    call_id, reply = reply_from_message(pb.HostReply(call_id=3, result_json=b'{"hits": [1, 2]}'))
    assert reply.result == {"hits": [1, 2]}
    assert reply_message(call_id, reply).result_json == b'{"hits": [1, 2]}'
    # A value made here (no bytes it arrived in) is encoded, compact, as before.
    assert reply_message(3, HostReply(result={"hits": [1, 2]})).result_json == b'{"hits":[1,2]}'


# --------------------------------------------------------------------------- a relayed call's reply_now


def test_a_relayed_reply_goes_once_from_whichever_thread_has_it_first():
    sent: list[HostReply] = []
    early = RelayedReply(sent.append)
    assert early(HostReply(result=1)) is True
    assert early(HostReply(result=2)) is False  # a second reply to the call: not sent
    assert early.close() is True  # the caller's thread sends nothing of its own
    assert sent == [HostReply(result=1)]


def test_a_relayed_reply_sends_nothing_once_the_callers_thread_has_its_reply():
    sent: list[HostReply] = []
    early = RelayedReply(sent.append)
    assert early.close() is False  # the caller's thread sends its reply itself (an error, at a deadline)
    assert early(HostReply(result=1)) is False
    assert sent == []


class _Call:
    """grpc's call object as ``InteractStream`` uses it: events in order, never done."""

    def __init__(self, events: list[pb.InteractEvent]) -> None:
        self._events = iter(events)

    def __next__(self) -> pb.InteractEvent:
        return next(self._events)

    def cancel(self) -> None:
        pass

    def done(self) -> bool:
        return False


class _Stub:
    def __init__(self, *events: pb.InteractEvent) -> None:
        self._events = list(events)

    def Interact(self, requests, timeout=None, metadata=()):  # noqa: N802 - grpc's name
        return _Call(self._events)


def _relayed_replies(host) -> list[bytes | str]:
    """The replies ``InteractStream.result`` queues for the worker when ``host`` answers two calls."""
    call = pb.HostCall(function="f", args_json=b"[]", kwargs_json=b"{}", deadline_ms=5000)
    events = [pb.InteractEvent(call=call), pb.InteractEvent(call=call), pb.InteractEvent(result=pb.RunJobResponse())]
    for event, call_id in zip(events, (1, 2)):
        event.call.call_id = call_id
    stream = InteractStream(_Stub(*events), pb.InteractRequest(), ("f",), timeout_s=None)
    stream.result(host, 5.0)
    stream.send(None)  # the end of what was queued
    queued = [request.reply for request in iter(stream._requests.get, None) if request.WhichOneof("kind") == "reply"]
    return [reply.result_json or reply.error for reply in queued]


def test_a_relayed_calls_reply_goes_once_whether_another_thread_or_the_host_sends_it():
    def early_from_another_thread(call: HostCall) -> HostReply:
        reply = HostReply(result=call.call_id)
        sender = threading.Thread(target=call.reply_now, args=(reply,))
        sender.start()
        sender.join()
        return reply

    assert _relayed_replies(early_from_another_thread) == [b"1", b"2"]
    assert _relayed_replies(lambda call: HostReply(result=call.call_id * 10)) == [b"10", b"20"]

    def early_then_gives_up(call: HostCall) -> HostReply:
        call.reply_now(HostReply(result="early"))
        return HostReply(error="no reply before the task's deadline")  # its own wait ended first

    assert _relayed_replies(early_then_gives_up) == [b'"early"', b'"early"']


def test_taken_next_runs_only_for_an_item_a_waiting_get_takes_next():
    box: Mailbox[int] = Mailbox(4)
    seen: list[int] = []
    assert box.put(1, taken_next=seen.append)  # nobody waits
    getter = threading.Thread(target=lambda: [box.get(5), box.get(5)])
    getter.start()
    assert wait_until(lambda: box._getters == 1, 5)  # it took 1 and waits for the next
    assert box.put(2, taken_next=seen.append)
    getter.join(5)
    assert seen == [2]
    box.put(3)
    assert box.put(4, taken_next=seen.append)  # 3 is ahead of it: nobody takes 4 next
    assert seen == [2]


class _Context:
    def add_callback(self, callback) -> bool:
        return True

    def time_remaining(self) -> float:
        return 30.0


class _OneCallRunner:
    """Runs a job that makes one host call, with a ``reply_now`` that takes the reply early."""

    def __init__(self) -> None:
        self.early: list[HostReply] = []
        self.returned: list[HostReply] = []

    def run_job(self, job, job_id, host=None, cancel=None, output=None) -> JobOutcome:
        early = RelayedReply(self.early.append)
        self.returned.append(host(HostCall(1, "f", (), {}, time.monotonic() + 5, reply_now=early)))
        early.close()
        return JobOutcome(0, "", "", False, False, None, 1, "", (), None, "fake")


@pytest.mark.parametrize("ahead", ["hibernate mid-call", "one stale reply too many"])
def test_the_reader_never_sends_on_a_reply_behind_a_protocol_break(ahead):
    # The requests wait in a queue, all there before the reader reads them: without the rule
    # (only a reply the driver takes next), the reader sent this reply on every time.
    requests: queue.SimpleQueue[pb.InteractRequest | None] = queue.SimpleQueue()
    requests.put(pb.InteractRequest(job=pb.RunJobRequest(checkpoint="base", code="x", timeout_ms=5000, functions=["f"])))
    runner = _OneCallRunner()
    events = Interaction(runner, iter(requests.get, None), _Context(), "job").start().events()
    assert next(events).call.call_id == 1
    if ahead == "hibernate mid-call":
        requests.put(pb.InteractRequest(hibernate=pb.HibernateSession()))
    for _ in range(MAX_STALE_REPLIES + 1 if ahead == "one stale reply too many" else 0):
        requests.put(pb.InteractRequest(reply=pb.HostReply(call_id=99, result_json=b"1")))
    requests.put(pb.InteractRequest(reply=pb.HostReply(call_id=1, result_json=b"[1, 2]")))
    with pytest.raises(RequestError):
        list(events)
    requests.put(None)
    assert "broke the protocol" in runner.returned[0].error
    assert runner.early == []
