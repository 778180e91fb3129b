"""The published schema against the code: what the pool accepts, the schema accepts; what it writes, the schema describes."""

from __future__ import annotations

import json
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_protocol.events import (
    CallEvent,
    CancelledEvent,
    ClosedEvent,
    ErrorInfo,
    PolicyInfo,
    ReadyEvent,
    Result,
    RuntimeInfo,
    StatsEvent,
)
from readie_protocol.requests import JOB_FIELDS, JobRequest, Refused, parse_request
from readie_protocol.schema import SCHEMA_DIALECT, event_schemas, protocol_schema, request_schema

VALIDATOR = jsonschema.Draft202012Validator


def valid(schema: dict[str, Any], obj: Any) -> bool:
    return VALIDATOR({"$schema": SCHEMA_DIALECT, **schema}).is_valid(obj)


def test_the_schema_is_a_json_schema() -> None:
    VALIDATOR.check_schema(protocol_schema())


SPEC_REQUESTS = [
    {"id": "task-1", "code": "import json\nprint(json.dumps({'ok': True}))", "name": "step.py", "allow_write": ["out"]},
    {"id": "task-2", "script": "app.py", "args": ["one"], "allow_read": ["data"], "package_dirs": [],
     "env": {"KEY": "value"}, "allow_network": False, "timeout": "5s", "memory": "512m", "max_output": 65536},
    {"id": 1, "session": "notebook-7", "code": "import pandas as pd", "allow_read": ["data"]},
    {"id": "s1", "stats": True},
    {"id": 9, "session": "notebook-7", "close": True},
    {"reply": {"call_id": 1, "result": {"hits": ["a"]}}},
    {"reply": {"call_id": 2, "error": "no such page"}},
    {"id": 3, "code": "x", "close": False, "timeout": 30, "memory": "1G"},
    {"id": "c1", "cancel": "task-1"},
]


@pytest.mark.parametrize("request_line", SPEC_REQUESTS)
def test_the_specs_requests_are_valid_and_the_pool_accepts_them(request_line: dict[str, Any]) -> None:
    assert valid(request_schema(), request_line)
    assert not isinstance(parse_request(json.dumps(request_line)), Refused)


@pytest.mark.parametrize(
    "request_line",
    [
        {"code": "x"},  # no id
        {"id": 1},  # neither code nor script
        {"id": 1, "code": "x", "script": "y"},  # both
        {"id": 1, "code": "x", "colour": "red"},  # unknown field
        {"id": 1, "code": "x", "timeout": "soon"},
        {"id": 1, "code": "x", "timeout": 1.5},
        {"id": True, "code": "x"},
        {"id": "", "code": "x"},
        {"id": 1, "stats": False},
        {"reply": {"call_id": 1}},
        {"reply": {"call_id": 1, "result": 1, "error": "x"}},
        {"reply": {"call_id": 2**64, "result": 1}},
        {"id": 1, "code": "x", "timeout": 0},
        {"id": 1, "code": "x", "memory": "0m"},
        {"id": 1, "code": "x", "timeout": 2**62},  # seconds: over the limit once in ms
        {"id": 1, "session": "nb", "script": "a.py"},
    ],
)
def test_lines_the_pool_refuses_for_their_shape_are_invalid(request_line: dict[str, Any]) -> None:
    assert isinstance(parse_request(json.dumps(request_line)), Refused)
    assert not valid(request_schema(), request_line)


def mostly(good: list[Any], bad: list[Any]) -> st.SearchStrategy[Any]:
    """Good values four times as often as bad ones, so many lines get past the parser."""
    return st.sampled_from(good * 4 + bad)


FIELD_VALUES = {
    "name": mostly(["x.py"], ["", "n" * 256, "a\nb"]),
    "args": st.lists(st.text(max_size=5), max_size=3),
    "allow_read": st.lists(mostly(["data", "/srv"], [""]), max_size=2),
    "env": st.dictionaries(mostly(["A", "B"], ["B=", ""]), st.text(max_size=3), max_size=2),
    "allow_network": mostly([True, False], [0, "yes"]),
    "timeout": mostly([1, "5s", "250ms", "5S", "1H"], [0, "1.5s", "-1", "10x", 2**64, True]),
    "memory": mostly([1, "512m", "1G"], [0, "1.5g", -5]),
    "max_output": mostly([0, 65536, "64k"], ["64q"]),
    "functions": st.lists(mostly(["search", "ok_1"], ["class", "__x", "1x"]), max_size=2, unique=True),
    "session": mostly(["nb"], ["", "s" * 257]),
    "packages": st.lists(mostly(["pandas==2.2"], ["-e x", ""]), max_size=2),
    "profile": mostly(["fetch"], [""]),
    "files": mostly([{"data/a.csv": "YSxiCg=="}, {}], [{"../a": ""}, {"a": "!"}, {"a": 1}, ["a"]]),
    "collect": st.lists(mostly(["out/*.png", "**/*.csv"], ["", "/abs", "a/../.."]), max_size=3),
}


@settings(max_examples=300)
@given(st.fixed_dictionaries({"id": st.one_of(st.integers(-5, 5), st.text(max_size=3)), "code": st.text(max_size=20)},
                             optional=FIELD_VALUES))
def test_whatever_the_pool_accepts_the_schema_accepts(request_line: dict[str, Any]) -> None:
    parsed = parse_request(json.dumps(request_line))
    if isinstance(parsed, JobRequest):
        assert valid(request_schema(), request_line), request_line


def test_every_field_in_the_table_is_in_the_schema_with_its_meaning() -> None:
    job = request_schema()["oneOf"][0]["properties"]
    assert set(job) == {"id", "close", *(field.name for field in JOB_FIELDS)}
    assert all(job[field.name]["description"] for field in JOB_FIELDS)


RUNTIME = RuntimeInfo.pool("3.11.2", ("pandas",))
POLICY = PolicyInfo(("/data",), (), "deny", "deny", 5000, None, "gvisor")


def result(**fields: Any) -> Result:
    values: dict[str, Any] = dict(
        id="t1", exit=0, stdout="hi\n", stderr="", error=None, stdout_truncated=False, stderr_truncated=False,
        duration_ms=4, duration_us=4001, queue_us=12, runtime=RUNTIME, policy=POLICY,
    )
    return Result(**{**values, **fields})


@pytest.mark.parametrize(
    ("name", "event"),
    [
        ("ready", ReadyEvent.pool(workers=2, preloaded_modules=["pandas"], config="/etc/readie.toml")),
        ("result", result()),
        ("result", result(exit=-1, error=ErrorInfo("RequestError", "allow_write: nope", hint="granted: none"),
                          runtime=None, policy=None, id=None)),
        ("result", result(error=ErrorInfo("ValueError", "boom", "<string>", 1), exit=1,
                          session="nb", step=2, session_ended=False)),
        ("stats", StatsEvent("s", {"uptime_ms": 5, "workers": 2, "jobs": 3, "errors": {"ValueError": 1}})),
        ("closed", ClosedEvent(9, "nb")),
        ("cancelled", CancelledEvent("c1", "task-1", found=False)),
        ("call", CallEvent("t1", 7, "search", ["readie", 10**30], {"limit": 2})),
    ],
)
def test_what_the_pool_writes_is_described(name: str, event: Any) -> None:
    assert valid(event_schemas()[name], json.loads(json.dumps(event.to_json())))


def test_a_result_without_a_field_the_spec_shows_is_invalid() -> None:
    line = result().to_json()
    del line["exit"]
    assert not valid(event_schemas()["result"], line)
    assert not valid(event_schemas()["result"], {**result().to_json(), "exit": "0"})
