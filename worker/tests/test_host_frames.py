"""Host-function frames (readie_worker._host_frames) and their codec (readie_executor.hostwire).

Pure: bytes in, values or typed refusals out. Expected values come from the
standard library's json module, which shares no code with the parser under
test, or are written out by hand.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readie_executor import hostwire
from readie_executor.hostwire import (
    CALL_PREFIX,
    MAX_ARGUMENT_BYTES,
    MAX_CALL_FRAME_BYTES,
    MAX_CALLS_PER_TASK,
    MAX_INT_DIGITS,
    MAX_RESULT_BYTES,
    WireError,
    dumps,
    encode_call,
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
    Refused,
    TooManyRefusedFrames,
    check_functions,
    encode_reply,
    is_call_frame,
    parse_call_frame,
)
from readie_worker.errors import PoolWorkerError, RequestError

DECLARED = frozenset({"search", "fetch"})


def frame(call: object) -> bytes:
    """A frame as a forger would write it: any JSON after the call prefix."""
    return CALL_PREFIX + json.dumps(call).encode() + b"}"


def call_body(call_id: int = 1, function: str = "search", args: list | None = None, kwargs: dict | None = None) -> dict:
    return {"call_id": call_id, "function": function, "args": args or [], "kwargs": kwargs or {}}


def refusal(payload: bytes, expected_id: int = 1) -> FrameRefused:
    with pytest.raises(FrameRefused) as caught:
        parse_call_frame(payload, DECLARED, expected_id)
    return caught.value


# --------------------------------------------------------------------------- the parser

PARSE_CASES = [
    ("null", None),
    ("true", True),
    ("false", False),
    ("0", 0),
    ("-0", 0),
    ("-12", -12),
    ("1.5", 1.5),
    ("-0.0", -0.0),
    ("1e3", 1000.0),
    ("1E-2", 0.01),
    ("2.5e+2", 250.0),
    ('""', ""),
    ('"plain"', "plain"),
    ('"\\"\\\\\\/\\b\\f\\n\\r\\t"', '"\\/\b\f\n\r\t'),
    ('"\\u00e9\\u4e2d"', "é中"),
    ('"\\ud83d\\ude00"', "😀"),  # a surrogate pair is one character
    ('"\\ud800"', "\ud800"),  # a lone surrogate stays, as in json.loads
    ('"\\udc00\\ud800x"', "\udc00\ud800x"),
    ('"é 中 😀"', "é 中 😀"),  # raw UTF-8
    ("[]", []),
    ("{}", {}),
    (" \t\r\n[ 1 , [ ] , { } ] \n", [1, [], {}]),
    ('{"a": {"b": [1, {"c": null}]}, "d": "e"}', {"a": {"b": [1, {"c": None}]}, "d": "e"}),
    ('[{"k": 1}, {"k": 2}]', [{"k": 1}, {"k": 2}]),  # the same key in sibling objects is fine
    ("18446744073709551617", 2**64 + 1),
    ("-18446744073709551617", -(2**64 + 1)),
    ("9007199254740993", 2**53 + 1),  # a double would round this to 2**53
]


@pytest.mark.parametrize(("text", "expected"), PARSE_CASES, ids=[case[0][:30] for case in PARSE_CASES])
def test_parser_golden_cases(text, expected):
    value = loads(text.encode("utf-8"))
    assert value == expected and type(value) is type(expected)
    if isinstance(expected, float):
        assert math.copysign(1, value) == math.copysign(1, expected)
    assert value == json.loads(text)  # the independent oracle agrees


REFUSED_DOCUMENTS = [
    (b"NaN", "NaN and Infinity"),
    (b"[1, Infinity]", "NaN and Infinity"),
    (b"-Infinity", "NaN and Infinity"),
    (b"1e400", "out of range"),
    (b"-1e400", "out of range"),
    (b'{"a": 1, "a": 2}', "duplicate key 'a'"),
    (b'[{"x": {"a": 1, "b": 2, "a": 3}}]', "duplicate key 'a'"),
    (b'"\xff"', "not UTF-8"),
    (b'"\xed\xa0\x80"', "not UTF-8"),  # a surrogate encoded as UTF-8 (CESU)
    (b"\xef\xbb\xbf[]", "unexpected character"),  # a BOM
    (b"", "unexpected end"),
    (b"[", "unexpected end"),
    (b"[1,]", "unexpected character"),
    (b"[1 2]", "expected ',' or ']'"),
    (b'{"a" 1}', "expected ':'"),
    (b"{1: 2}", "expected a string key"),
    (b'{"a": 1,}', "expected a string key"),
    (b'{"a": 1 "b": 2}', "expected ',' or '}'"),
    (b"01", "extra data"),
    (b"[] []", "extra data"),
    (b"1.", "extra data"),
    (b".5", "unexpected character"),
    (b"+1", "unexpected character"),
    (b"tru", "unexpected characters"),
    (b"nul", "unexpected characters"),
    (b"'single'", "unexpected character"),
    (b'"unterminated', "unterminated string"),
    (b'"a\nb"', "control character"),
    (b'"\\x41"', "invalid escape"),
    (b'"\\u12"', "invalid \\uXXXX escape"),
    (b'"\\ud800\\uzzzz"', "invalid \\uXXXX escape"),
    ("[\u0661]".encode(), "unexpected character"),  # an Arabic-Indic digit is not a JSON digit
    (b"1" * (MAX_INT_DIGITS + 1), f"more than {MAX_INT_DIGITS} digits"),
    (b"-" + b"9" * (MAX_INT_DIGITS + 1), f"more than {MAX_INT_DIGITS} digits"),
]


@pytest.mark.parametrize(("raw", "message"), REFUSED_DOCUMENTS, ids=[repr(case[0][:20]) for case in REFUSED_DOCUMENTS])
def test_parser_refuses_what_json_does_not_define_or_leaves_ambiguous(raw, message):
    with pytest.raises(WireError, match=message.replace("\\", "\\\\").replace("(", "\\(")):
        loads(raw)


def test_the_digit_budget_is_inclusive_and_exact():
    literal = "7" * MAX_INT_DIGITS
    assert loads(literal) == int(literal)
    assert loads("-" + literal) == -int(literal)


def test_deep_nesting_under_the_budget_parses_without_recursion():
    depth = 100_000
    value = loads("[" * depth + "]" * depth)
    for _ in range(depth - 1):
        assert isinstance(value, list) and len(value) == 1
        value = value[0]
    assert value == []
    objects = loads('{"a":' * depth + "1" + "}" * depth)
    for _ in range(depth):
        objects = objects["a"]
    assert objects == 1


def test_a_whole_frame_of_nesting_is_a_valid_call():
    # 1 MB of brackets (with the "{}" of kwargs): as deep as a frame can nest.
    depth = (MAX_ARGUMENT_BYTES - 2) // 2
    payload = encode_call(1, "search", [_nested(depth - 1)], {})
    assert len(payload) <= MAX_CALL_FRAME_BYTES
    call = parse_call_frame(payload, DECLARED, 1)
    assert _depth(call.args[0]) == depth - 1


def _nested(depth: int) -> list:
    value: list = []
    for _ in range(depth - 1):
        value = [value]
    return value


def _depth(value: object) -> int:
    depth = 0
    while isinstance(value, list):
        depth += 1
        value = value[0] if value else None
    return depth


# --------------------------------------------------------------------------- the encoder


def test_encoder_writes_compact_json_like_the_standard_library():
    value = {"q": "readie", "n": [1, -2.5, 2**64 + 1, None, True, False], "u": "é😀", "e": {}, "l": []}
    assert dumps(value) == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def test_encoder_escapes_lone_surrogates_so_they_survive():
    assert dumps("a\ud800") == b'"a\\ud800"'
    assert loads(dumps(["\udfff", "é"])) == ["\udfff", "é"]


@pytest.mark.parametrize(
    ("value", "error", "message"),
    [
        (float("nan"), ValueError, "not JSON"),
        ([float("inf")], ValueError, "not JSON"),
        ({1: "a"}, TypeError, "keys must be str"),
        ({"a": {1, 2}}, TypeError, "set is not JSON"),
        (b"bytes", TypeError, "bytes is not JSON"),
        (10**MAX_INT_DIGITS, ValueError, f"more than {MAX_INT_DIGITS} digits"),
        ("x" * 101, ValueError, "too large: more than 100 bytes"),
    ],
    ids=["nan", "inf", "int-key", "set", "bytes", "huge-int", "over-limit"],
)
def test_encoder_refuses_what_cannot_cross_losslessly(value, error, message):
    with pytest.raises(error, match=message):
        dumps(value, 100)


def test_encoder_refuses_cycles_but_not_shared_values():
    loop: list = []
    loop.append(loop)
    with pytest.raises(ValueError, match="circular"):
        dumps(loop)
    shared = [1]
    assert dumps([shared, {"k": shared}]) == b'[[1],{"k":[1]}]'


def test_encoder_is_iterative_too():
    depth = 200_000
    assert dumps(_nested(depth)) == b"[" * depth + b"]" * depth


def test_call_frames_count_arguments_against_one_budget():
    assert encode_call(3, "search", ("readie",), {"limit": 2}) == (
        b'{"call":{"call_id":3,"function":"search","args":["readie"],"kwargs":{"limit":2}}}'
    )
    half = "x" * (MAX_ARGUMENT_BYTES // 2)
    with pytest.raises(ValueError, match="arguments too large"):
        encode_call(1, "search", (half,), {"more": half})


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
    assert isinstance(junk, Refused) and junk.kind == "junk"
    assert json.loads(junk.reply) == {"reply": {"call_id": None, "error": junk_text(junk)}}
    forged = conversation.receive(frame(call_body(call_id=2, function="fetch")))
    assert isinstance(forged, Refused) and json.loads(forged.reply)["reply"]["call_id"] == 2
    second = conversation.receive(frame(call_body(call_id=2)))  # refusals use up no id
    assert isinstance(second, HostCall) and second.call_id == 2
    conversation.answer(second, HostReply(error="backend unavailable"))
    stats = conversation.stats
    assert (stats.calls, stats.replies, stats.junk, stats.forged, stats.host_errors) == (2, 4, 1, 1, 1)
    assert stats.wait_us == 5 and stats.refused == 2


def junk_text(refused: Refused) -> str:
    return f"host call refused: {refused.reason}"


def test_a_flood_of_refused_frames_ends_the_job_at_the_named_limit():
    conversation = HostConversation(["search"])
    for index in range(MAX_REFUSED_FRAMES):
        assert isinstance(conversation.receive(b"%d" % index if index % 2 else b'{"call":[]}'), Refused)
    with pytest.raises(TooManyRefusedFrames, match=f"at most {MAX_REFUSED_FRAMES} are answered") as caught:
        conversation.receive(frame(call_body(function="nope")))
    assert isinstance(caught.value, PoolWorkerError)
    assert conversation.stats.refused == MAX_REFUSED_FRAMES + 1
    assert conversation.stats.replies == MAX_REFUSED_FRAMES


def test_the_call_limit_holds_even_for_frames_written_by_hand():
    conversation = HostConversation(["search"], max_calls=3)
    for call_id in (1, 2, 3):
        assert isinstance(conversation.receive(frame(call_body(call_id=call_id))), HostCall)
    over = conversation.receive(frame(call_body(call_id=4)))
    assert isinstance(over, Refused) and "made its 3 host calls" in over.reason


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


@settings(max_examples=400, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300))
def test_any_bytes_give_a_call_or_a_refusal(data):
    for payload in (data, CALL_PREFIX + data):
        try:
            result = parse_call_frame(payload, DECLARED, 1)
        except FrameRefused as refused:
            assert refused.kind in ("junk", "forged")
        else:
            assert isinstance(result, HostCall)


# Lone surrogates included: Python strings may hold them, and JSON can escape them.
any_text = st.text(st.characters(exclude_categories=()))
# Wrong values for each field of a call, to mutate an honest call with.
WRONG_FIELDS = {
    "call_id": st.integers(-3, 3) | st.none() | st.just(True) | st.just(2**53) | st.just(1.0),
    "function": st.sampled_from(["nope", "", "Search"]) | st.integers(),
    "args": st.just({}) | st.none() | st.text(max_size=2),
    "kwargs": st.lists(st.integers(), max_size=1) | st.none() | st.just({"limit": 2}),
}


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
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


json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.integers(min_value=-(10**40), max_value=10**40)
    | st.floats(allow_nan=False, allow_infinity=False)
    | any_text,
    lambda children: st.lists(children, max_size=5) | st.dictionaries(any_text, children, max_size=5),
    max_leaves=30,
)


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(
    json_values,
    st.sampled_from(
        [
            {},
            {"ensure_ascii": False},
            {"indent": 2},
            {"separators": (",", ":")},
            {"indent": "\t", "sort_keys": True, "ensure_ascii": False},
        ]
    ),
)
def test_the_parser_agrees_with_json_loads_on_what_json_dumps_writes(value, options):
    text = json.dumps(value, **options)
    # Raw lone surrogates (ensure_ascii=False) have no UTF-8 form: those go in as str.
    document = text if _has_surrogate(text) else text.encode("utf-8")
    assert _same(loads(document), json.loads(text))


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_values_round_trip_through_the_codec(value):
    encoded = dumps(value)
    assert _same(loads(encoded), value)
    if not _has_surrogate(json.dumps(value, ensure_ascii=False)):
        assert encoded == json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(json_values, max_size=4), st.dictionaries(any_text, json_values, max_size=4))
def test_any_call_the_sandbox_encodes_is_rebuilt_exactly(args, kwargs):
    call = parse_call_frame(encode_call(1, "search", args, kwargs), DECLARED, 1)
    assert _same(list(call.args), args) and _same(call.kwargs, kwargs)


def _has_surrogate(text: str) -> bool:
    return any("\ud800" <= character <= "\udfff" for character in text)


def _same(left: object, right: object) -> bool:
    """Equal, with types (1 is not 1.0 nor True) and the sign of zero."""
    if type(left) is not type(right):
        return False
    if isinstance(left, list):
        return len(left) == len(right) and all(_same(a, b) for a, b in zip(left, right))  # type: ignore[arg-type]
    if isinstance(left, dict):
        return left.keys() == right.keys() and all(_same(left[key], right[key]) for key in left)  # type: ignore[union-attr,index]
    if isinstance(left, float):
        return left == right and math.copysign(1, left) == math.copysign(1, right)  # type: ignore[arg-type]
    return left == right
