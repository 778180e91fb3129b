"""Host-function frames (readie_worker._host_frames): calls, replies, a task's conversation.

Pure: bytes in, values or typed refusals out. Frames are written out by
hand, as a forger would write them, and expected values come from the
standard library's json module or are written out by hand. The JSON codec
under them (readie_executor.hostwire): test_host_frames_codec.py.
"""

from __future__ import annotations

import json

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readie_executor.hostwire import (
    CALL_PREFIX,
    MAX_CALL_FRAME_BYTES,
    MAX_CALLS_PER_TASK,
    MAX_RESULT_BYTES,
    loads,
)
from readie_worker import _host_frames
from readie_worker._host_frames import (
    MAX_ERROR_CHARS,
    MAX_REFUSED_FRAMES,
    FrameRefused,
    HostCall,
    HostConversation,
    HostReply,
    RefusedFrame,
    TooManyRefusedFrames,
    check_functions,
    encode_reply,
    is_call_frame,
    parse_call_frame,
)
from readie_worker.errors import PoolWorkerError, RequestError
from worker.tests._host_frames_common import DECLARED

from conftest import fuzz_examples


def frame(call: object) -> bytes:
    """A frame as a forger would write it: any JSON after the call prefix."""
    return CALL_PREFIX + json.dumps(call).encode() + b"}"


def call_body(call_id: int = 1, function: str = "search", args: list | None = None, kwargs: dict | None = None) -> dict:
    return {"call_id": call_id, "function": function, "args": args or [], "kwargs": kwargs or {}}


def refusal(payload: bytes, expected_id: int = 1) -> FrameRefused:
    with pytest.raises(FrameRefused) as caught:
        parse_call_frame(payload, DECLARED, expected_id)
    return caught.value


# --------------------------------------------------------------------------- frames


def test_the_spec_call_is_rebuilt():
    payload = b'{"call":{"call_id":1,"function":"search","args":["readie"],"kwargs":{"limit":2}}}'
    assert is_call_frame(payload)
    assert parse_call_frame(payload, DECLARED, 1) == HostCall(1, "search", ("readie",), {"limit": 2})


def test_a_frame_over_the_limit_is_refused_before_any_parsing(monkeypatch):
    seen: list[bytes] = []

    def spy(data: bytes) -> object:
        seen.append(data)
        return loads(data)

    monkeypatch.setattr(_host_frames, "parse_json", spy)
    oversized = CALL_PREFIX + b" " * MAX_CALL_FRAME_BYTES
    refused = refusal(oversized)
    assert refused.kind == "junk" and "at most" in refused.reason
    assert seen == []
    parse_call_frame(frame(call_body()), DECLARED, 1)  # the spy does watch real frames
    assert len(seen) == 1


@pytest.mark.parametrize(
    ("payload", "reason"),
    [
        (b'{"call" :{}}', "not a call frame"),  # the prefix is exact
        (b'{"exit":0}', "not a call frame"),
        (CALL_PREFIX + b"\xff}", "not UTF-8"),
        (CALL_PREFIX + b"NaN}", "NaN"),
        (CALL_PREFIX + b"[" * 300_000, "unexpected end"),  # deep and never closed
        (CALL_PREFIX + b'{"call_id":1,"call_id":1}}', "duplicate key"),
        (frame(call_body()) + b"junk", "extra data"),
        (CALL_PREFIX + b'{"call_id":1,"function":"search","args":[],"kwargs":{}},"extra":1}', "nothing else"),
        (frame([]), "call must be an object"),
        (frame({**call_body(), "sneaky": True}), "unknown fields: sneaky"),
        (frame({"call_id": 1, "function": "search", "args": []}), "lacks kwargs"),
        (frame(call_body(call_id=0)), "call_id must be"),
        (frame({**call_body(), "call_id": True}), "call_id must be"),
        (frame({**call_body(), "call_id": 1.0}), "call_id must be"),
        (frame({**call_body(), "call_id": "1"}), "call_id must be"),
        (frame({**call_body(), "call_id": 2**53}), "call_id must be"),
        (frame({**call_body(), "function": ["search"]}), "function must be a string"),
        (frame({**call_body(), "args": {"0": 1}}), "args must be an array"),
        (frame({**call_body(), "kwargs": [["limit", 2]]}), "kwargs must be an object"),
        (CALL_PREFIX + b'{"call_id":1,"function":"search","args":[' + b"9" * 5000 + b'],"kwargs":{}}}', "digits"),
    ],
    ids=lambda value: repr(value[:40]) if isinstance(value, bytes) else None,
)
def test_junk_is_refused_with_the_reason(payload, reason):
    refused = refusal(payload)
    assert refused.kind == "junk"
    assert reason in refused.reason


def test_forged_calls_are_refused_and_keep_their_id_for_the_answer():
    undeclared = refusal(frame(call_body(function="delete_everything")))
    assert (undeclared.kind, undeclared.call_id) == ("forged", 1)
    assert "'delete_everything' is not a declared host function" in undeclared.reason
    early = refusal(frame(call_body(call_id=7)), expected_id=3)
    assert (early.kind, early.call_id) == ("forged", 7)
    assert "out of sequence: the next call is 3" in early.reason
    replayed = refusal(frame(call_body(call_id=2)), expected_id=3)
    assert replayed.kind == "forged"
    over = refusal(frame(call_body(call_id=MAX_CALLS_PER_TASK + 1)), expected_id=MAX_CALLS_PER_TASK + 1)
    assert over.kind == "forged" and f"made its {MAX_CALLS_PER_TASK} host calls" in over.reason


def test_rebuilt_calls_carry_nothing_the_frame_added():
    call = parse_call_frame(frame(call_body(args=[{"a": [1]}], kwargs={"limit": 2})), DECLARED, 1)
    assert call == HostCall(1, "search", ({"a": [1]},), {"limit": 2})
    assert call.deadline is None
    assert type(call.args) is tuple and type(call.kwargs) is dict


# --------------------------------------------------------------------------- replies


def test_replies_are_exact_bytes():
    assert encode_reply(7, HostReply(["first hit", "second hit"])) == (
        b'{"reply":{"call_id":7,"result":["first hit","second hit"]}}'
    )
    assert encode_reply(7, HostReply(error="backend unavailable")) == (
        b'{"reply":{"call_id":7,"error":"backend unavailable"}}'
    )
    assert encode_reply(None, HostReply(error="no")) == b'{"reply":{"call_id":null,"error":"no"}}'
    assert encode_reply(1, HostReply(None)) == b'{"reply":{"call_id":1,"result":null}}'


def test_a_result_that_cannot_be_sent_becomes_an_error_reply():
    for result, message in (
        ({1, 2}, "set is not JSON"),
        (float("nan"), "not JSON"),
        ("x" * MAX_RESULT_BYTES, f"result too large: more than {MAX_RESULT_BYTES} bytes"),
    ):
        reply = json.loads(encode_reply(1, HostReply(result)))["reply"]
        assert "result" not in reply and message in reply["error"]


def test_a_huge_error_text_is_cut_to_fit():
    payload = encode_reply(1, HostReply(error="\U0001f600\ud800" * MAX_RESULT_BYTES))
    assert len(payload) <= MAX_RESULT_BYTES + 100
    assert json.loads(payload)["reply"]["error"].endswith(" [cut]")
    assert MAX_ERROR_CHARS * 12 < MAX_RESULT_BYTES


# --------------------------------------------------------------------------- a conversation


def test_a_conversation_numbers_calls_and_counts_everything():
    conversation = HostConversation(["search"])
    first = conversation.receive(frame(call_body(call_id=1)))
    assert isinstance(first, HostCall)
    assert conversation.answer(first, HostReply(["hit"]), waited_ns=5000) == b'{"reply":{"call_id":1,"result":["hit"]}}'
    junk = conversation.receive(b'{"call":nope')
    assert isinstance(junk, RefusedFrame) and junk.kind == "junk"
    assert json.loads(junk.reply) == {"reply": {"call_id": None, "error": junk_text(junk)}}
    forged = conversation.receive(frame(call_body(call_id=2, function="fetch")))
    assert isinstance(forged, RefusedFrame) and json.loads(forged.reply)["reply"]["call_id"] == 2
    second = conversation.receive(frame(call_body(call_id=2)))  # refusals use up no id
    assert isinstance(second, HostCall) and second.call_id == 2
    conversation.answer(second, HostReply(error="backend unavailable"))
    stats = conversation.stats
    assert (stats.calls, stats.replies, stats.junk, stats.forged, stats.host_errors) == (2, 4, 1, 1, 1)
    assert stats.wait_us == 5 and stats.refused == 2


def junk_text(refused: RefusedFrame) -> str:
    return f"host call refused: {refused.reason}"


def test_a_flood_of_refused_frames_ends_the_job_at_the_named_limit():
    conversation = HostConversation(["search"])
    for index in range(MAX_REFUSED_FRAMES):
        assert isinstance(conversation.receive(b"%d" % index if index % 2 else b'{"call":[]}'), RefusedFrame)
    with pytest.raises(TooManyRefusedFrames, match=f"at most {MAX_REFUSED_FRAMES} are allowed") as caught:
        conversation.receive(frame(call_body(function="nope")))
    assert isinstance(caught.value, PoolWorkerError)
    assert conversation.stats.refused == MAX_REFUSED_FRAMES + 1
    assert conversation.stats.replies == MAX_REFUSED_FRAMES


def test_the_call_limit_holds_even_for_frames_written_by_hand():
    conversation = HostConversation(["search"], max_calls=3)
    for call_id in (1, 2, 3):
        assert isinstance(conversation.receive(frame(call_body(call_id=call_id))), HostCall)
    over = conversation.receive(frame(call_body(call_id=4)))
    assert isinstance(over, RefusedFrame) and "made its 3 host calls" in over.reason


@pytest.mark.parametrize(
    ("names", "message"),
    [
        (["search", "search"], "declared twice"),
        (["not valid"], "not a Python identifier"),
        (["class"], "not a Python identifier"),
        (["\u0430"], "not a Python identifier"),
        (["HostError"], "reserved"),
        (["__getattr__"], "reserved"),
        (["f" * 256], "at most 255"),
        ([f"f{index}" for index in range(257)], "at most 256"),
    ],
)
def test_declared_names_are_checked_before_anything_runs(names, message):
    with pytest.raises(RequestError, match=message) as caught:
        check_functions(names)
    assert caught.value.field == "functions"


# --------------------------------------------------------------------------- properties


@settings(max_examples=fuzz_examples(400), suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_give_a_call_or_a_refusal(data):
    for payload in (data, CALL_PREFIX + data):
        try:
            result = parse_call_frame(payload, DECLARED, 1)
        except FrameRefused as refused:
            assert refused.kind in ("junk", "forged")
        else:
            assert isinstance(result, HostCall)


# Wrong values for each field of a call, to mutate an honest call with.
WRONG_FIELDS = {
    "call_id": st.integers(-3, 3) | st.none() | st.just(True) | st.just(2**53) | st.just(1.0),
    "function": st.sampled_from(["nope", "", "Search"]) | st.integers(),
    "args": st.just({}) | st.none() | st.text(max_size=2),
    "kwargs": st.lists(st.integers(), max_size=1) | st.none() | st.just({"limit": 2}),
}


@settings(max_examples=fuzz_examples(300), suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(st.integers(), max_size=3),
    st.sets(st.sampled_from(sorted(WRONG_FIELDS))),
    st.sets(st.sampled_from(sorted(WRONG_FIELDS))),
    st.booleans(),
    st.booleans(),
    st.data(),
)
def test_any_mutation_of_a_call_gives_that_call_or_a_refusal(args, replaced, dropped, extra, closed, data):
    call: dict = {"call_id": 1, "function": "search", "args": args, "kwargs": {}}
    for name in sorted(replaced):
        call[name] = data.draw(WRONG_FIELDS[name], label=name)
    for name in dropped:
        del call[name]
    if extra:
        call["extra"] = None
    payload = CALL_PREFIX + json.dumps(call).encode() + (b"}" if closed else b"")
    try:
        result = parse_call_frame(payload, DECLARED, 1)
    except FrameRefused as refused:
        assert refused.kind in ("junk", "forged")
    else:
        assert closed and not dropped and not extra
        assert result == HostCall(call["call_id"], call["function"], tuple(call["args"]), call["kwargs"])


def test_a_reply_that_arrived_as_json_goes_into_the_sandbox_as_it_came():
    reply = HostReply(result=[1, 2], encoded=b"[1, 2]")
    assert encode_reply(4, reply) == b'{"reply":{"call_id":4,"result":[1, 2]}}'
    assert loads(encode_reply(4, reply)) == {"reply": {"call_id": 4, "result": [1, 2]}}
