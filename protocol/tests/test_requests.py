"""Request parsing: the spec's own lines, a table of refusals, and fuzz properties."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_protocol.errors import RequestError
from readie_protocol.connection import PoolConnection, Role
from readie_protocol.encoding import encode_request
from readie_protocol.lines import MAX_LINE_BYTES, Line, OversizeLine
from readie_protocol.request_lines import request_json
from readie_protocol.requests import (
    MAX_OUTPUT_BYTES,
    MAX_REPLY_BYTES,
    MAX_TIMEOUT_MS,
    SESSION_SETUP_FIELDS,
    SESSION_STEP_FIELDS,
    CancelJob,
    CloseSession,
    ForkSession,
    HibernateSession,
    JobRequest,
    Refused,
    ReplyRequest,
    Request,
    StatsRequest,
    parse_event,
    parse_request,
    refuse_oversize,
)

from conftest import fuzz_examples

# The spec's example lines, verbatim.
SPEC_TASK_1 = r"""{"id": "task-1", "code": "import json\nprint(json.dumps({'ok': True}))", "name": "step.py", "allow_write": ["out"]}"""
SPEC_TASK_2 = r"""{"id": "task-2", "script": "app.py", "args": ["one"], "allow_read": ["data"], "package_dirs": [], "env": {"KEY": "value"}, "allow_network": false, "timeout": "5s", "memory": "512m", "max_output": 65536}"""
SPEC_SESSION_1 = r"""{"id": 1, "session": "notebook-7", "code": "import pandas as pd\ndf = pd.read_csv('data/orders.csv')", "allow_read": ["data"]}"""
SPEC_SESSION_2 = r"""{"id": 2, "session": "notebook-7", "code": "print(df.groupby('product').amount.sum())"}"""
SPEC_SESSION_3 = r"""{"id": 3, "session": "notebook-7", "close": true}"""
SPEC_FUNCTIONS = r"""{"id": "t1", "functions": ["search"], "code": "from pynox_host import search\nprint(search('pynox', limit=2))"}"""
SPEC_REPLY_RESULT = r"""{"reply": {"call_id": 7, "result": ["first hit", "second hit"]}}"""
SPEC_REPLY_ERROR = r"""{"reply": {"call_id": 7, "error": "backend unavailable"}}"""
SPEC_STATS = r"""{"id": "s1", "stats": true}"""


def ok(line: str | bytes) -> Any:
    result = parse_request(line.encode() if isinstance(line, str) else line)
    assert not isinstance(result, Refused), result.error
    return result


def refused(line: str | bytes) -> Refused:
    result = parse_request(line.encode() if isinstance(line, str) else line)
    assert isinstance(result, Refused), result
    return result


def test_spec_task_1() -> None:
    assert ok(SPEC_TASK_1) == JobRequest(
        id="task-1",
        code="import json\nprint(json.dumps({'ok': True}))",
        name="step.py",
        allow_write=("out",),
        fields=frozenset({"code", "name", "allow_write"}),
    )


def test_spec_task_2() -> None:
    assert ok(SPEC_TASK_2) == JobRequest(
        id="task-2",
        script="app.py",
        args=("one",),
        allow_read=("data",),
        package_dirs=(),
        env=(("KEY", "value"),),
        allow_network=False,
        timeout_ms=5000,
        memory_bytes=512 * 1024 * 1024,
        max_output=65536,
        fields=frozenset(
            {"script", "args", "allow_read", "package_dirs", "env", "allow_network",
             "timeout", "memory", "max_output"}
        ),
    )


def test_spec_session_lines() -> None:
    first = ok(SPEC_SESSION_1)
    assert (first.id, first.session, first.allow_read) == (1, "notebook-7", ("data",))
    assert first.setup_fields == ("allow_read",)
    second = ok(SPEC_SESSION_2)
    assert (second.id, second.session, second.setup_fields) == (2, "notebook-7", ())
    assert second.fields <= SESSION_STEP_FIELDS
    assert ok(SPEC_SESSION_3) == CloseSession(id=3, session="notebook-7")


def test_spec_functions_and_replies() -> None:
    job = ok(SPEC_FUNCTIONS)
    assert job.functions == ("search",) and job.id == "t1"
    assert ok(SPEC_REPLY_RESULT) == ReplyRequest(call_id=7, result=["first hit", "second hit"])
    assert ok(SPEC_REPLY_ERROR) == ReplyRequest(call_id=7, error="backend unavailable")
    assert ok(SPEC_STATS) == StatsRequest(id="s1")


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        ('{"id": 5, "code": ""}', JobRequest(id=5, code="", fields=frozenset({"code"}))),
        ('{"id": -5, "code": "x"}', JobRequest(id=-5, code="x", fields=frozenset({"code"}))),
        ('  {"code": "x", "id": "a"}  \r', JobRequest(id="a", code="x", fields=frozenset({"code"}))),
        ('{"id": 1, "code": "x", "close": false}', JobRequest(id=1, code="x", fields=frozenset({"code"}))),
        ('{"id": 1, "code": "x", "timeout": 5}', JobRequest(id=1, code="x", timeout_ms=5000, fields=frozenset({"code", "timeout"}))),
        ('{"id": 1, "code": "x", "timeout": "250ms"}', JobRequest(id=1, code="x", timeout_ms=250, fields=frozenset({"code", "timeout"}))),
        ('{"id": 1, "code": "x", "max_output": "64k"}', JobRequest(id=1, code="x", max_output=65536, fields=frozenset({"code", "max_output"}))),
        ('{"id": 1, "code": "x", "max_output": 0}', JobRequest(id=1, code="x", max_output=0, fields=frozenset({"code", "max_output"}))),
        ('{"id": 1, "code": "x", "max_file_size": "256m"}', JobRequest(id=1, code="x", max_file_size=256 << 20, fields=frozenset({"code", "max_file_size"}))),
        ('{"id": 1, "code": "x", "allow_network": true}', JobRequest(id=1, code="x", allow_network=True, fields=frozenset({"code", "allow_network"}))),
        ('{"id": 1, "code": "x", "profile": "analysis"}', JobRequest(id=1, code="x", profile="analysis", fields=frozenset({"code", "profile"}))),
        ('{"id": 1, "code": "x", "packages": ["pandas>=2.2"]}', JobRequest(id=1, code="x", packages=("pandas>=2.2",), fields=frozenset({"code", "packages"}))),
        ('{"id": 1, "code": "x", "args": ["-v", ""]}', JobRequest(id=1, code="x", args=("-v", ""), fields=frozenset({"code", "args"}))),
        ('{"id": 1, "code": "x", "env": {}}', JobRequest(id=1, code="x", env=(), fields=frozenset({"code", "env"}))),
        ('{"id": "\\u00e9", "code": "x"}', JobRequest(id="\u00e9", code="x", fields=frozenset({"code"}))),
        ('{"reply": {"call_id": 0, "result": null}}', ReplyRequest(call_id=0, result=None)),
        ('{"reply": {"call_id": 1, "result": {"a": [1, 2.5, "x", true]}}}', ReplyRequest(call_id=1, result={"a": [1, 2.5, "x", True]})),
        ('{"reply": {"call_id": 1, "error": ""}}', ReplyRequest(call_id=1, error="")),
        ('{"stats": true, "id": 9}', StatsRequest(id=9)),
        ('{"close": true, "session": "s", "id": 9}', CloseSession(id=9, session="s")),
    ],
)
def test_accepted(line: str, expected: object) -> None:
    assert ok(line) == expected


# (line, id echoed in the refusal, field named, text in the message)
REFUSALS: list[tuple[str | bytes, object, str | None, str]] = [
    # not an object, not JSON, not UTF-8
    ("[1, 2]", None, None, "must be a JSON object, got an array"),
    ('"id"', None, None, "got a string"),
    ("null", None, None, "got null"),
    ("42", None, None, "got a number"),
    ('{"id": "task-9", "code": ', "task-9", None, "not valid JSON"),
    ('{"id": 12, "code": "x"', 12, None, "not valid JSON"),
    ("{'id': 1}", None, None, "not valid JSON"),
    ('{"id": 1, "code": "x"} {"id": 2}', 1, None, "Extra data"),
    (b'{"id": 1, "code": "\xff"}', 1, None, "not valid UTF-8"),
    ('\ufeff{"id": 1, "code": "x"}', None, None, "not valid JSON"),
    ('{"id": 1, "code": "x", "timeout": NaN}', 1, None, "NaN is not JSON"),
    ('{"id": 1, "code": "x", "memory": Infinity}', 1, None, "Infinity is not JSON"),
    ('{"id": 1, "code": "x", "memory": 1e999}', 1, None, "out of range"),
    ('{"id": 1, "id": 2, "code": "x"}', 1, None, "duplicate key 'id'"),
    ('{"id": 1, "code": "x", "env": {"A": "1", "A": "2"}}', 1, None, "duplicate key 'A'"),
    # Deep nesting is valid JSON (a host function's reply may nest): parsed, then refused as any unknown field.
    ('{"id": 1, "code": "x", "x": ' + "[" * 100_000 + "]" * 100_000 + "}", 1, "x", "unknown field"),
    ('{"id": 1, "code": "x", "x": ' + "[" * 100_000 + "}", 1, None, "not valid JSON"),
    ('{"id": 1, "code": "x", "n": 1' + "0" * 5000 + "}", 1, None, "not valid JSON"),
    # ids
    ('{"code": "x"}', None, "id", "required"),
    ('{"id": null, "code": "x"}', None, "id", "got null"),
    ('{"id": true, "code": "x"}', None, "id", "got a boolean"),
    ('{"id": 1.0, "code": "x"}', None, "id", "got a number"),
    ('{"id": [1], "code": "x"}', None, "id", "got an array"),
    ('{"id": "", "code": "x"}', None, "id", "must not be empty"),
    ('{"id": "' + "x" * 257 + '", "code": "x"}', None, "id", "longer than 256"),
    ('{"id": 9223372036854775808, "code": "x"}', None, "id", "between"),
    ('{"id": "\\ud800", "code": "x"}', None, "id", "lone surrogate"),
    ('{"stats": true}', None, "id", "required"),
    ('{"session": "s", "close": true}', None, "id", "required"),
    # code and script
    ('{"id": 1}', 1, "code", "exactly one of code and script"),
    ('{"id": 1, "name": "a.py"}', 1, "code", "exactly one of code and script"),
    ('{"id": 1, "code": "x", "script": "a.py"}', 1, "script", "not both"),
    ('{"id": 1, "session": "s", "script": "a.py"}', 1, "script", "inline code, not script"),
    ('{"id": 1, "code": 5}', 1, "code", "expected a string, got a number"),
    ('{"id": 1, "code": null}', 1, "code", "got null"),
    ('{"id": 1, "code": "\\udc80"}', 1, "code", "lone surrogate"),
    ('{"id": 1, "script": ""}', 1, "script", "must not be empty"),
    ('{"id": 1, "script": "a\\u0000b"}', 1, "script", "NUL"),
    # unknown and misplaced fields
    ('{"id": 1, "code": "x", "cwd": "/"}', 1, "cwd", "unknown field"),
    ('{"id": 1, "code": "x", "preload": ["os"]}', 1, "preload", "unknown field"),
    ('{"id": 1, "code": "x", "Timeout": "5s"}', 1, "Timeout", "unknown field"),
    ('{"id": 1, "stats": true, "code": "x"}', 1, "code", "not allowed in a stats request"),
    ('{"id": 1, "stats": true, "extra": 1}', 1, "extra", "unknown field"),
    ('{"id": 1, "stats": false}', 1, "stats", "must be true"),
    ('{"id": 1, "stats": 1}', 1, "stats", "must be true"),
    ('{"id": 1, "session": "s", "close": true, "code": "x"}', 1, "code", "not allowed in a close request"),
    ('{"id": 1, "close": true}', 1, "session", "close needs the session"),
    ('{"id": 1, "session": "s", "close": "yes"}', 1, "close", "expected true or false"),
    ('{"id": 1, "reply": {"call_id": 1, "result": 1}}', 1, "id", "not allowed in a reply"),
    # field types
    ('{"id": 1, "code": "x", "name": ""}', 1, "name", "must not be empty"),
    ('{"id": 1, "code": "x", "name": "a\\nb"}', 1, "name", "line break"),
    ('{"id": 1, "code": "x", "name": "' + "n" * 256 + '"}', 1, "name", "longer than 255"),
    ('{"id": 1, "code": "x", "args": "one"}', 1, "args", "expected an array, got a string"),
    ('{"id": 1, "code": "x", "args": [1]}', 1, "args", "item 0: expected a string"),
    ('{"id": 1, "code": "x", "args": ["a", "b\\u0000"]}', 1, "args", "item 1: contains a NUL"),
    ('{"id": 1, "code": "x", "allow_read": "data"}', 1, "allow_read", "expected an array"),
    ('{"id": 1, "code": "x", "allow_read": [""]}', 1, "allow_read", "item 0: must not be empty"),
    ('{"id": 1, "code": "x", "allow_write": [null]}', 1, "allow_write", "got null"),
    ('{"id": 1, "code": "x", "allow_write": ["' + "p" * 4097 + '"]}', 1, "allow_write", "longer than 4096"),
    ('{"id": 1, "code": "x", "package_dirs": {}}', 1, "package_dirs", "expected an array"),
    ('{"id": 1, "code": "x", "env": []}', 1, "env", "expected an object"),
    ('{"id": 1, "code": "x", "env": {"A": 1}}', 1, "env", "'A': expected a string"),
    ('{"id": 1, "code": "x", "env": {"A=B": "1"}}', 1, "env", "not a variable name"),
    ('{"id": 1, "code": "x", "env": {"": "1"}}', 1, "env", "not a variable name"),
    ('{"id": 1, "code": "x", "env": {"A": "\\u0000"}}', 1, "env", "NUL"),
    ('{"id": 1, "code": "x", "allow_network": 1}', 1, "allow_network", "expected true, false or an array of destinations, got a number"),
    ('{"id": 1, "code": "x", "allow_network": "false"}', 1, "allow_network", "got a string"),
    ('{"id": 1, "code": "x", "timeout": "1.5s"}', 1, "timeout", "whole numbers"),
    ('{"id": 1, "code": "x", "timeout": "0s"}', 1, "timeout", "greater than zero"),
    ('{"id": 1, "code": "x", "timeout": -1}', 1, "timeout", "negative"),
    ('{"id": 1, "code": "x", "timeout": true}', 1, "timeout", "boolean"),
    ('{"id": 1, "code": "x", "timeout": 5.0}', 1, "timeout", "float"),
    # Past what any job may have: before, the worker's own timers failed it with OverflowError.
    ('{"id": 1, "code": "x", "timeout": "100000000h"}', 1, "timeout", "too large: at most 24h"),
    ('{"id": 1, "code": "x", "timeout": 86401}', 1, "timeout", "too large: at most 24h"),
    ('{"id": 1, "session": "s", "code": "x", "timeout": "1441m"}', 1, "timeout", "too large: at most 24h"),
    ('{"id": 1, "code": "x", "memory": "1.5g"}', 1, "memory", "whole numbers"),
    ('{"id": 1, "code": "x", "memory": 0}', 1, "memory", "greater than zero"),
    ('{"id": 1, "code": "x", "memory": "512 m"}', 1, "memory", "spaces"),
    ('{"id": 1, "code": "x", "max_output": -1}', 1, "max_output", "negative"),
    ('{"id": 1, "code": "x", "max_output": "17m"}', 1, "max_output", "too large: at most 16m"),
    ('{"id": 1, "code": "x", "max_output": 65536.0}', 1, "max_output", "float"),
    ('{"id": 1, "code": "x", "max_file_size": "9999999t"}', 1, "max_file_size", "too large"),
    ('{"id": 1, "code": "x", "profile": 3}', 1, "profile", "expected a string"),
    ('{"id": 1, "code": "x", "profile": ""}', 1, "profile", "must not be empty"),
    ('{"id": 1, "code": "x", "functions": "search"}', 1, "functions", "expected an array"),
    ('{"id": 1, "code": "x", "functions": ["not valid"]}', 1, "functions", "not a Python identifier"),
    ('{"id": 1, "code": "x", "functions": ["class"]}', 1, "functions", "not a Python identifier"),
    ('{"id": 1, "code": "x", "functions": ["\\u0430"]}', 1, "functions", "not a Python identifier"),
    ('{"id": 1, "code": "x", "functions": ["f", "f"]}', 1, "functions", "declared twice"),
    ('{"id": 1, "code": "x", "functions": ' + json.dumps([f"f{i}" for i in range(257)]) + "}", 1, "functions", "at most 256"),
    ('{"id": 1, "code": "x", "session": ""}', 1, "session", "must not be empty"),
    ('{"id": 1, "code": "x", "session": 7}', 1, "session", "expected a string"),
    ('{"id": 1, "code": "x", "packages": ["--index-url=http://evil"]}', 1, "packages", "starts with '-'"),
    ('{"id": 1, "code": "x", "packages": [" -e ."]}', 1, "packages", "starts with '-'"),
    ('{"id": 1, "code": "x", "packages": [""]}', 1, "packages", "must not be empty"),
    # replies
    ('{"reply": 7}', None, "reply", "expected an object, got a number"),
    ('{"reply": {"result": 1}}', None, "reply.call_id", "required"),
    ('{"reply": {"call_id": "7", "result": 1}}', None, "reply.call_id", "got a string"),
    ('{"reply": {"call_id": true, "result": 1}}', None, "reply.call_id", "got a boolean"),
    ('{"reply": {"call_id": -1, "result": 1}}', None, "reply.call_id", "from 0 to"),
    ('{"reply": {"call_id": 7.0, "result": 1}}', None, "reply.call_id", "got a number"),
    ('{"reply": {"call_id": 7}}', None, "reply", "exactly one of result and error"),
    ('{"reply": {"call_id": 7, "result": 1, "error": "e"}}', None, "reply", "exactly one"),
    ('{"reply": {"call_id": 7, "error": null}}', None, "reply.error", "got null"),
    ('{"reply": {"call_id": 7, "result": 1, "id": 3}}', None, "reply.id", "unknown field"),
    ('{"reply": {"call_id": 7, "result": "' + "r" * MAX_REPLY_BYTES + '"}}', None, "reply.result", "the limit is 1000000"),
    ('{"reply": {"call_id": 7, "error": "' + "e" * MAX_REPLY_BYTES + '"}}', None, "reply.error", "the limit is 1000000"),
    ('{"reply": {"call_id": 7, "result": 1}, "stats": true}', None, "stats", "not allowed in a reply"),
]


@pytest.mark.parametrize(("line", "rid", "field", "text"), REFUSALS)
def test_refused(line: str | bytes, rid: object, field: str | None, text: str) -> None:
    result = refused(line)
    assert result.id == rid
    assert isinstance(result.error, RequestError)
    assert result.error.field == field
    assert text in str(result.error)
    if field:
        assert str(result.error).startswith(f"{field}: ")


def test_reply_result_at_the_limit_is_accepted() -> None:
    payload = "r" * (MAX_REPLY_BYTES - 2)  # plus two quotes
    reply = ok('{"reply": {"call_id": 7, "result": "' + payload + '"}}')
    assert reply.result == payload


def test_setup_fields_name_what_a_later_step_may_not_carry() -> None:
    line = json.dumps({
        "id": 1, "session": "s", "code": "x", "name": "n", "args": [], "timeout": "1s",
        "max_output": 10, "allow_read": ["a"], "allow_write": ["b"], "package_dirs": [],
        "env": {}, "allow_network": False, "memory": "1m", "max_file_size": 1,
        "profile": "p", "functions": [], "packages": [],
    })
    job = ok(line)
    assert job.setup_fields == tuple(sorted(SESSION_SETUP_FIELDS))
    assert not SESSION_SETUP_FIELDS & SESSION_STEP_FIELDS


def test_env_dict() -> None:
    assert ok('{"id": 1, "code": "x", "env": {"A": "1", "B": ""}}').env_dict == {"A": "1", "B": ""}
    assert ok('{"id": 1, "code": "x"}').env_dict == {}


def test_requests_are_frozen() -> None:
    job = ok(SPEC_TASK_1)
    with pytest.raises(AttributeError):
        job.code = "evil"  # type: ignore[misc]


def test_str_lines_are_accepted() -> None:
    assert parse_request(SPEC_STATS) == StatsRequest(id="s1")
    assert isinstance(parse_request('{"id": 1, "code": "\udc80"}'), Refused)


def test_oversize_lines() -> None:
    result = refuse_oversize(OversizeLine(size=MAX_LINE_BYTES + 5, id="big"))
    assert result.id == "big" and result.error.field is None
    assert f"line of {MAX_LINE_BYTES + 5} bytes is longer than the {MAX_LINE_BYTES}-byte limit" in str(result.error)
    # A line handed to the parser directly is held to the same limit.
    direct = parse_request(b'{"id": 3, "code": "' + b"a" * MAX_LINE_BYTES + b'"}')
    assert isinstance(direct, Refused) and direct.id == 3 and "limit" in str(direct.error)


def test_parse_event() -> None:
    assert parse_event(Line(SPEC_STATS.encode())) == StatsRequest(id="s1")
    assert isinstance(parse_event(OversizeLine(size=MAX_LINE_BYTES + 1, id=None)), Refused)


# --------------------------------------------------------------------------- fuzz

json_scalars = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=20)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20,
)
FIELD_NAMES = [
    "id", "code", "script", "name", "args", "allow_read", "allow_write", "package_dirs", "env",
    "allow_network", "timeout", "memory", "max_output", "max_file_size", "profile", "functions",
    "session", "packages", "close", "stats", "reply", "call_id", "result", "error", "bogus",
    "files", "collect", "upload", "download", "list", "size", "offset", "data",
]
request_like = st.dictionaries(st.sampled_from(FIELD_NAMES), json_values, max_size=8)


def check_outcome(result: object) -> None:
    assert isinstance(result, Request | Refused)
    if isinstance(result, Refused):
        assert isinstance(result.error, RequestError)
        assert result.id is None or isinstance(result.id, str | int)
        if result.error.field is not None:
            assert str(result.error).startswith(result.error.field)


@settings(max_examples=fuzz_examples(300))
@given(st.binary(max_size=300))
def test_any_bytes_give_a_request_or_a_refusal(data: bytes) -> None:
    check_outcome(parse_request(data))


@settings(max_examples=fuzz_examples(300))
@given(json_values)
def test_any_json_gives_a_request_or_a_refusal(value: object) -> None:
    check_outcome(parse_request(json.dumps(value).encode()))


@settings(max_examples=fuzz_examples(500))
@given(request_like)
def test_any_request_shaped_object_gives_a_request_or_a_refusal(obj: dict[str, Any]) -> None:
    check_outcome(parse_request(json.dumps(obj).encode()))


@settings(max_examples=fuzz_examples(300))
@given(request_like.map(lambda o: {"reply": {k: v for k, v in o.items() if k in ("call_id", "result", "error", "bogus")}}))
def test_any_reply_shaped_object_gives_a_request_or_a_refusal(obj: dict[str, Any]) -> None:
    check_outcome(parse_request(json.dumps(obj).encode()))


paths = st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00\n\r"), min_size=1, max_size=10), max_size=3)
valid_jobs = st.fixed_dictionaries(
    {"id": st.integers(-(2**63) + 1, 2**63 - 1) | st.text(st.characters(blacklist_categories=("Cs",)), min_size=1, max_size=20),
     "code": st.text(st.characters(blacklist_categories=("Cs",)), max_size=50)},
    optional={
        "args": st.lists(st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=5), max_size=3),
        "allow_read": paths,
        "allow_write": paths,
        "env": st.dictionaries(st.from_regex(r"[A-Z_][A-Z0-9_]{0,5}", fullmatch=True), st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="\x00"), max_size=5), max_size=3),
        "allow_network": st.booleans(),
        "timeout": st.integers(1, MAX_TIMEOUT_MS // 1000),
        "memory": st.integers(1, 2**40),
        "max_output": st.integers(0, MAX_OUTPUT_BYTES),
        "session": st.from_regex(r"[a-z0-9-]{1,12}", fullmatch=True),
        "files": st.dictionaries(st.from_regex(r"[a-z]{1,8}(/[a-z]{1,8})?", fullmatch=True),
                                 st.binary(max_size=20).map(lambda data: base64.b64encode(data).decode()), max_size=3),
        "collect": st.lists(st.from_regex(r"[a-z*?]{1,8}", fullmatch=True), max_size=3, unique=True),
    },
)


@settings(max_examples=300)
@given(valid_jobs)
def test_valid_jobs_round_trip(obj: dict[str, Any]) -> None:
    job = ok(json.dumps(obj))
    assert job.id == obj["id"] and job.code == obj["code"]
    assert job.fields == frozenset(obj) - {"id"}
    assert job.args == tuple(obj.get("args", ()))
    assert job.allow_read == (tuple(obj["allow_read"]) if "allow_read" in obj else None)
    assert job.env_dict == obj.get("env", {})
    assert job.allow_network == obj.get("allow_network")
    assert job.timeout_ms == (obj["timeout"] * 1000 if "timeout" in obj else None)
    assert job.memory_bytes == obj.get("memory")
    assert job.session == obj.get("session")


def test_long_values_are_cut_in_messages() -> None:
    result = refused('{"id": 1, "code": "x", "timeout": "' + "9x" * 300_000 + '"}')
    assert result.error.field == "timeout"
    assert len(str(result.error)) < 200 and "(600000 characters)" in str(result.error)
    result = refused('{"id": 1, "code": "x", "functions": ["' + "-" * 100_000 + '"]}')
    assert len(str(result.error)) < 200


def test_a_deep_reply_is_parsed_without_recursion() -> None:
    depth = 100_000
    request = parse_request('{"reply": {"call_id": 3, "result": ' + "[" * depth + "]" * depth + "}}")
    assert isinstance(request, ReplyRequest) and request.call_id == 3
    value, levels = request.result, 1
    while value:
        (value,), levels = value, levels + 1
    assert levels == depth


# --------------------------------------------------------------------------- typed requests written back


def round_trip(request: Any) -> Any:
    return parse_request(encode_request(request_json(request)).rstrip(b"\n"))


@settings(max_examples=200)
@given(valid_jobs)
def test_every_job_the_parser_accepts_is_written_back_as_itself(obj: dict[str, Any]) -> None:
    parsed = parse_request(json.dumps(obj).encode())
    assert round_trip(parsed) == parsed


@pytest.mark.parametrize(
    "request_",
    [
        StatsRequest("s1"),
        CancelJob(2, "task-1"),
        CloseSession(3, "nb"),
        HibernateSession(4, "nb"),
        ForkSession(5, "nb", "nb-2"),
        ReplyRequest(7, result=["first hit"]),
        ReplyRequest(7, result=None),
        ReplyRequest(8, error="backend unavailable"),
        JobRequest(id="t", script="app.py", timeout_ms=1500, max_output=0, stream=True,
                   fields=frozenset({"script", "timeout", "max_output", "stream"})),
    ],
    ids=lambda request: type(request).__name__,
)
def test_every_kind_of_request_is_written_back_as_itself(request_: Any) -> None:
    assert round_trip(request_) == request_


def test_a_client_connection_sends_a_typed_request_and_expects_its_answer() -> None:
    connection = PoolConnection(Role.CLIENT)
    line = connection.send(JobRequest(id=1, code="print(1)", timeout_ms=250, args=("a",)))
    assert json.loads(line) == {"id": 1, "code": "print(1)", "args": ["a"], "timeout": "250ms"}
    assert parse_request(line.rstrip(b"\n")) == JobRequest(
        id=1, code="print(1)", args=("a",), timeout_ms=250, fields=frozenset({"code", "args", "timeout"})
    )
