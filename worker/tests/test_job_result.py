"""parse_job_result: hostile bytes in, a rebuilt SandboxAnswer or JobResultInvalid out, nothing else.

Vectors are literal bytes written by hand, not produced by the runner, so a
bug shared by both sides cannot hide; one test at the end feeds a real
run_job result through as a contract check.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_executor.jobs import bounds
from readie_protocol.events import ErrorInfo, Value
from readie_worker._job_result import (
    INVALID_ERROR_TYPE,
    SandboxAnswer,
    JobResultInvalid,
    max_result_bytes,
    parse_job_result,
)

from conftest import fuzz_examples

MAX_OUTPUT = 1000

VALID = (
    b'{"exit":1,"system_exit":false,"timed_out":false,"stdout":"hi\\n","stderr":"Traceback...\\n","stdout_truncated":false,'
    b'"stderr_truncated":false,"error":{"type":"PermissionError",'
    b'"message":"[Errno 13] Permission denied: \'/etc/x\'","file":"step.py","line":2,'
    b'"hint":"This job may write only beneath: /srv/work."},"duration_us":1234,'
    b'"preloaded_modules":["numpy","pandas.core"],"python":"3.11.2","policy_notes":["a note"],'
    b'"value":{"text":"Frame(2)","truncated":false,"data":{"text/html":"<table/>"},"omitted":["image/png"]}}'
)
EXPECTED = SandboxAnswer(
    exit=1,
    system_exit=False,
    timed_out=False,
    stdout="hi\n",
    stderr="Traceback...\n",
    stdout_truncated=False,
    stderr_truncated=False,
    error=ErrorInfo(
        type="PermissionError",
        message="[Errno 13] Permission denied: '/etc/x'",
        file="step.py",
        line=2,
        hint="This job may write only beneath: /srv/work.",
    ),
    duration_us=1234,
    preloaded_modules=("numpy", "pandas.core"),
    python="3.11.2",
    policy_notes=("a note",),
    value=Value("Frame(2)", False, {"text/html": "<table/>"}, ("image/png",)),
)


def valid_document() -> dict[str, Any]:
    return json.loads(VALID)


def encode(document: dict[str, Any]) -> bytes:
    return json.dumps(document).encode()


def with_fields(**changes: Any) -> bytes:
    document = valid_document()
    document.update(changes)
    return encode(document)


def with_error_fields(**changes: Any) -> bytes:
    document = valid_document()
    document["error"].update(changes)
    return encode(document)


def test_valid_result_is_rebuilt() -> None:
    assert parse_job_result(VALID, MAX_OUTPUT) == EXPECTED


def test_runner_phases_are_optional_and_kept_in_their_order() -> None:
    assert parse_job_result(VALID, MAX_OUTPUT).phases is None
    phases = parse_job_result(with_fields(phases={"encode": 3, "code": 2, "request": 1}), MAX_OUTPUT).phases
    assert list(phases.items()) == [("request", 1), ("code", 2), ("encode", 3)]


def test_success_without_error() -> None:
    result = parse_job_result(with_fields(exit=0, error=None), MAX_OUTPUT)
    assert result.error is None and result.exit == 0


def test_extra_fields_are_dropped() -> None:
    document = valid_document()
    document["__class__"] = "os.system"
    document["error"]["traceback_frames"] = [1, 2, 3]
    result = parse_job_result(encode(document), MAX_OUTPUT)
    assert result == EXPECTED


@pytest.mark.parametrize(
    "field",
    [
        "exit",
        "system_exit",
        "timed_out",
        "stdout",
        "stderr",
        "stdout_truncated",
        "stderr_truncated",
        "error",
        "duration_us",
        "preloaded_modules",
        "python",
        "policy_notes",
    ],
)
def test_missing_field_is_named(field: str) -> None:
    document = valid_document()
    del document[field]
    with pytest.raises(JobResultInvalid, match=f"lacks {field}$"):
        parse_job_result(encode(document), MAX_OUTPUT)


@pytest.mark.parametrize("field", ["type", "message", "file", "line"])
def test_missing_error_field_is_named(field: str) -> None:
    document = valid_document()
    del document["error"][field]
    with pytest.raises(JobResultInvalid, match=f"lacks error.{field}$"):
        parse_job_result(encode(document), MAX_OUTPUT)


@pytest.mark.parametrize(
    ("raw", "field"),
    [
        (with_fields(exit="0"), "exit"),
        (with_fields(exit=True), "exit"),
        (with_fields(exit=1.0), "exit"),
        (with_fields(system_exit=1), "system_exit"),
        (with_fields(timed_out="yes"), "timed_out"),
        (with_fields(stdout=None), "stdout"),
        (with_fields(stderr=["x"]), "stderr"),
        (with_fields(stdout_truncated=0), "stdout_truncated"),
        (with_fields(stderr_truncated="false"), "stderr_truncated"),
        (with_fields(error=[]), "error"),
        (with_fields(error="ValueError"), "error"),
        (with_fields(duration_us=1.5), "duration_us"),
        (with_fields(preloaded_modules="numpy"), "preloaded_modules"),
        (with_fields(preloaded_modules=[1]), "preloaded_modules"),
        (with_fields(policy_notes={"a": 1}), "policy_notes"),
        (with_fields(policy_notes=[None]), "policy_notes"),
        (with_fields(python=3.11), "python"),
        (with_error_fields(type=None), "error.type"),
        (with_error_fields(message=7), "error.message"),
        (with_error_fields(file=False), "error.file"),
        (with_error_fields(line="2"), "error.line"),
        (with_error_fields(hint=["/srv"]), "error.hint"),
        (with_fields(phases=[1, 2]), "phases"),
        (with_fields(phases={"code": 1, "os.system": 2}), "phases"),
        (with_fields(phases={"code": -1}), "phases"),
        (with_fields(phases={"code": 1.5}), "phases"),
        (with_fields(phases={"code": 10**19}), "phases"),
        (with_fields(phases={"code": True}), "phases"),
    ],
)
def test_wrong_types_are_refused_naming_the_field(raw: bytes, field: str) -> None:
    with pytest.raises(JobResultInvalid, match=rf"^{field}(\[\d+\])? "):
        parse_job_result(raw, MAX_OUTPUT)


@pytest.mark.parametrize(
    "raw",
    [
        with_fields(exit=-1),
        with_fields(exit=256),
        with_fields(duration_us=-5),
        with_fields(duration_us=10**19),
        with_error_fields(line=-1),
        with_error_fields(line=2**31),
    ],
)
def test_integers_out_of_range(raw: bytes) -> None:
    with pytest.raises(JobResultInvalid, match="must be between"):
        parse_job_result(raw, MAX_OUTPUT)


@pytest.mark.parametrize(
    ("literal", "complaint"),
    [
        (b"1" * 25, "integer of 25 digits"),
        (b"-" + b"9" * 4000, "integer of 4001 digits"),
        (b"NaN", "NaN"),
        (b"Infinity", "Infinity"),
        (b"-Infinity", "-Infinity"),
        (b"1e999", "out of range"),
    ],
)
def test_numbers_json_or_python_would_mangle(literal: bytes, complaint: str) -> None:
    raw = VALID.replace(b'"duration_us":1234', b'"duration_us":' + literal)
    with pytest.raises(JobResultInvalid, match=complaint):
        parse_job_result(raw, MAX_OUTPUT)


@pytest.mark.parametrize(
    "raw",
    [
        VALID.replace(b'"exit":1,', b'"exit":1,"exit":0,'),
        VALID.replace(b'"line":2,', b'"line":2,"line":99,'),
        b'{"a":1,"a":1}',
    ],
)
def test_duplicate_keys_are_refused(raw: bytes) -> None:
    with pytest.raises(JobResultInvalid, match="repeats the key"):
        parse_job_result(raw, MAX_OUTPUT)


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        (b"", "empty"),
        (VALID[: len(VALID) // 2], "not valid JSON"),
        (b"\x80\x04\x95", "not UTF-8"),  # the start of a pickle
        (VALID.replace(b"hi", b"h\xffi"), "not UTF-8"),
        (b"\xef\xbb\xbf" + VALID, "not valid JSON"),  # a UTF-8 byte order mark
        (VALID.decode().encode("utf-16"), "not UTF-8"),
        (b"garbage", "not valid JSON"),
        (b"[1, 2]", "must be a JSON object, got a list"),
        (b"null", "must be a JSON object, got null"),
        (b"{" + b'"x":' * 10, "not valid JSON"),
        (b'{"x":' + b"[" * 20_000 + b"]" * 20_000 + b"}", "nested too deeply"),
    ],
)
def test_garbage_is_refused_with_a_clear_message(raw: bytes, complaint: str) -> None:
    with pytest.raises(JobResultInvalid, match=complaint):
        parse_job_result(raw, MAX_OUTPUT)


def test_size_is_checked_before_parsing() -> None:
    budget = max_result_bytes(MAX_OUTPUT)
    padded = VALID + b" " * (budget - len(VALID))
    assert parse_job_result(padded, MAX_OUTPUT) == EXPECTED  # at the budget: accepted
    with pytest.raises(JobResultInvalid, match=rf"is {budget + 1} bytes; at most {budget}"):
        parse_job_result(padded + b" ", MAX_OUTPUT)
    with pytest.raises(JobResultInvalid, match="bytes; at most"):
        parse_job_result(b"[" * (budget + 1), MAX_OUTPUT)  # refused unread, not a RecursionError


def test_budget_grows_with_max_output() -> None:
    fixed = 64 * 1024 + bounds.MAX_VALUE_TEXT + bounds.MAX_DISPLAY_BYTES  # the rest, and a value
    assert max_result_bytes(0) == fixed
    assert max_result_bytes(MAX_OUTPUT) == 2 * MAX_OUTPUT + fixed
    with pytest.raises(ValueError):
        max_result_bytes(-1)
    with pytest.raises(ValueError):
        parse_job_result(VALID, 2**40)


def test_strings_are_recapped() -> None:
    long_output = "x" * (MAX_OUTPUT + 10)
    document = valid_document()
    document.update(stdout=long_output, stderr=long_output, stdout_truncated=False)
    document["error"]["message"] = "m" * 5000
    result = parse_job_result(encode(document), MAX_OUTPUT)
    assert result.stdout == result.stderr == "x" * MAX_OUTPUT
    assert result.stdout_truncated and result.stderr_truncated
    assert result.error is not None and result.error.message == "m" * 4096


def test_lone_surrogates_are_replaced() -> None:
    raw = VALID.replace(b'"hi\\n"', b'"a\\ud800b\\ud83d\\ude00"')
    result = parse_job_result(raw, MAX_OUTPUT)
    assert result.stdout == "a?b\U0001f600"
    result.stdout.encode("utf-8")  # encodable


@pytest.mark.parametrize(
    "error_type",
    ["not an identifier", "rm -rf /", "", "1Error", "E" * 101, "Error\n", "<lambda>"],
)
def test_error_type_must_look_like_a_class_name(error_type: str) -> None:
    result = parse_job_result(with_error_fields(type=error_type), MAX_OUTPUT)
    assert result.error is not None and result.error.type == INVALID_ERROR_TYPE
    assert result.error.hint is None  # the hint belongs to PermissionError only


def test_hint_is_kept_only_for_permission_and_memory_errors() -> None:
    for error_type, kept in [
        ("PermissionError", True),
        ("MemoryError", True),
        ("ValueError", False),
    ]:
        result = parse_job_result(with_error_fields(type=error_type, hint="a hint"), MAX_OUTPUT)
        assert result.error is not None and result.error.hint == ("a hint" if kept else None)
    document = valid_document()
    del document["error"]["hint"]
    result = parse_job_result(encode(document), MAX_OUTPUT)
    assert result.error is not None and result.error.hint is None


def test_error_file_and_line_may_be_null() -> None:
    result = parse_job_result(with_error_fields(file=None, line=None), MAX_OUTPUT)
    assert result.error is not None and (result.error.file, result.error.line) == (None, None)


@pytest.mark.parametrize(
    "raw",
    [
        with_fields(python="evil"),
        with_fields(python="3.11.2; rm -rf /"),
        with_fields(preloaded_modules=["os; rm"]),
        with_fields(preloaded_modules=["numpy"] * 257),
        with_fields(preloaded_modules=["m" * 101]),
        with_fields(policy_notes=["note"] * 17),
    ],
)
def test_metadata_that_cannot_be_honest_is_refused(raw: bytes) -> None:
    with pytest.raises(JobResultInvalid):
        parse_job_result(raw, MAX_OUTPUT)


def test_results_are_frozen() -> None:
    result = parse_job_result(VALID, MAX_OUTPUT)
    with pytest.raises(AttributeError):
        result.exit = 0  # type: ignore[misc]


# -- properties ---------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4)
    ),
    max_leaves=12,
)


def _parse_or_refuse(raw: bytes) -> None:
    try:
        result = parse_job_result(raw, MAX_OUTPUT)
    except JobResultInvalid:
        return
    assert isinstance(result, SandboxAnswer)
    assert len(result.stdout) <= MAX_OUTPUT and len(result.stderr) <= MAX_OUTPUT


@settings(max_examples=fuzz_examples(300))
@given(st.binary(max_size=2000))
def test_any_bytes_give_a_result_or_job_result_invalid(raw: bytes) -> None:
    _parse_or_refuse(raw)


@settings(max_examples=fuzz_examples(300))
@given(st.dictionaries(st.sampled_from(sorted(valid_document())), json_values, max_size=12))
def test_any_fields_give_a_result_or_job_result_invalid(changes: dict[str, Any]) -> None:
    document = valid_document()
    document.update(changes)
    _parse_or_refuse(json.dumps(document).encode())


@settings(max_examples=fuzz_examples(300))
@given(st.integers(min_value=0, max_value=len(VALID)), st.binary(min_size=1, max_size=8))
def test_spliced_valid_results_give_a_result_or_job_result_invalid(
    position: int, splice: bytes
) -> None:
    _parse_or_refuse(VALID[:position] + splice + VALID[position:])


# -- contract with the runner ------------------------------------------------------


def test_a_real_run_job_result_parses() -> None:
    child = (
        "import os\n"
        "from readie_executor.jobs import dedicate_stdio, run_job\n"
        "result = os.fdopen(os.dup(1), 'wb')\n"
        "dedicate_stdio()\n"
        "job = {'code': 'print(1)\\nopen(\"/etc/nope\", \"w\")', 'name': 'step.py',\n"
        "       'limits': {'max_output': 1000, 'memory_bytes': None, 'max_file_size': None,\n"
        "                  'subprocesses': False}}\n"
        "result.write(run_job(job))\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", child], capture_output=True, timeout=30, check=True
    )
    result = parse_job_result(done.stdout, MAX_OUTPUT)
    assert (result.exit, result.stdout) == (1, "1\n")
    assert result.error is not None and result.error.type == "PermissionError"
    assert result.error.hint is not None and (result.error.file, result.error.line) == (
        "step.py",
        2,
    )


@pytest.mark.parametrize(
    ("value", "why"),
    [
        ({"text": "x", "truncated": False, "data": {}}, "must be null or an object"),
        ({"text": "x", "truncated": False, "data": {}, "omitted": [], "extra": 1}, "must be null or an object"),
        ({"text": 1, "truncated": False, "data": {}, "omitted": []}, "value.text must be a string"),
        ({"text": "x", "truncated": False, "data": {"text/x-evil": "a"}, "omitted": []}, "display types"),
        ({"text": "x", "truncated": False, "data": {"text/html": 1}, "omitted": []}, "at most"),
        ({"text": "x", "truncated": False, "data": {"text/html": "a" * (bounds.MAX_DISPLAY_BYTES + 1)}, "omitted": []},
         "at most"),
        ({"text": "x", "truncated": False, "data": {}, "omitted": ["text/x-evil"]}, "not an acceptable entry"),
        ({"text": "x", "truncated": "no", "data": {}, "omitted": []}, "true or false"),
    ],
)
def test_a_forged_value_is_refused(value, why):
    document = valid_document()
    document["value"] = value
    with pytest.raises(JobResultInvalid, match=why):
        parse_job_result(json.dumps(document).encode(), 1024 * 1024)


def test_a_value_text_past_its_cap_is_cut_and_says_so():
    document = valid_document()
    document["value"] = {"text": "v" * (bounds.MAX_VALUE_TEXT + 5), "truncated": False, "data": {}, "omitted": []}
    value = parse_job_result(json.dumps(document).encode(), 1024 * 1024).value
    assert value is not None and len(value.text) == bounds.MAX_VALUE_TEXT and value.truncated
