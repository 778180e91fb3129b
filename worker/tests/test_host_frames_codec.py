"""Host-function frames' JSON codec (readie_executor.hostwire): parser, encoder, round trips.

Pure: bytes in, values or typed refusals out. Expected values come from the
standard library's json module, which shares no code with the parser under
test, or are written out by hand. The frames built on it (readie_worker._host_frames):
test_host_frames_calls.py.
"""

from __future__ import annotations

import json
import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from readie_executor.hostwire import (
    MAX_ARGUMENT_BYTES,
    MAX_CALL_FRAME_BYTES,
    MAX_INT_DIGITS,
    WireError,
    dumps,
    encode_call,
    loads,
)
from readie_worker._host_frames import parse_call_frame
from worker.tests._host_frames_common import DECLARED


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


# --------------------------------------------------------------------------- properties


# Lone surrogates included: Python strings may hold them, and JSON can escape them.
any_text = st.text(st.characters(exclude_categories=()))

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
