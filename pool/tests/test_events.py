"""Outgoing objects: the spec's examples rebuilt field for field, in the spec's key order."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from readie_worker.errors import (
    PoolWorkerError,
    RequestError,
    SandboxSetupError,
)
from readie_pool._events import (
    EXIT_NOT_RUN,
    EXIT_TIMEOUT,
    PROTOCOL_VERSION,
    ErrorInfo,
    Outcome,
    RuntimeInfo,
    Stats,
    job_log_line,
    policy_info,
    signal_exit,
)
from readie_policy.jobs import CodeJob
from readie_protocol.results import Result
from readie_pool._results import error_result, refused_result
from readie_protocol.requests import Refused, parse_request
from readie_protocol.events import CallEvent, ClosedEvent, ReadyEvent
from readie_protocol.wire import encode_line

def result_line(result: Result) -> dict[str, Any]:
    return result.to_json()


def ready_event(**fields: Any) -> dict[str, Any]:
    return ReadyEvent.pool(**fields).to_json()


# The spec's examples, verbatim, with "pynox" read as "readie" where the spec says so.
SPEC_READY = """{"event": "ready", "workers": 2, "runtime": "pynox", "preloaded_modules": [], "package_dirs": [],
 "config": "/etc/pynox/prod.toml", "profiles": ["analysis", "fetch"]}"""
SPEC_RESULT = """{"id": "task-1", "exit": 0, "stdout": "{\\"ok\\": true}\\n", "stderr": "", "error": null,
 "stdout_truncated": false, "stderr_truncated": false,
 "duration_ms": 4, "duration_us": 4001, "queue_us": 120,
 "runtime": {"name": "pynox", "python": "3.11.17", "mode": "pool", "preloaded_modules": []},
 "policy": {"allow_read": [], "allow_write": ["/abs/out"], "network": "deny", "subprocesses": "deny",
            "timeout_ms": 5000, "memory_bytes": 536870912, "backend": "landlock+seccomp"}}"""
SPEC_STATS = """{"id": "s1", "event": "stats", "uptime_ms": 81234, "workers": 4, "sessions_active": 2,
 "jobs": 1520, "ok": 1391, "failed": 97, "timeouts": 12, "signals": 0,
 "request_errors": 20, "worker_errors": 0, "duration_ms_total": 20511, "queue_us_total": 98120,
 "errors": {"PermissionError": 41, "NameError": 30, "TimeoutError": 12, "RequestError": 20}}"""
SPEC_LOG = """{"ts_ms": 1792310000123, "event": "job", "id": "tool-42", "session": null, "step": null,
 "exit": 1, "error": "PermissionError", "message": "[Errno 13] Permission denied: '/etc/passwd'",
 "duration_ms": 4, "queue_us": 85, "network": "deny", "truncated": false}"""
SPEC_CALL = """{"event": "call", "id": "t1", "call_id": 7, "function": "search", "args": ["pynox"], "kwargs": {"limit": 2}}"""


def spec(text: str) -> dict[str, Any]:
    return json.loads(text.replace('"pynox"', '"readie"').replace("/etc/pynox/", "/etc/readie/"))


def assert_same(actual: dict[str, Any], expected: dict[str, Any]) -> None:
    """Equal, and with the keys in the same order (dict == ignores order)."""
    assert actual == expected
    assert list(actual) == list(expected)
    for key, value in actual.items():
        if isinstance(value, dict):
            assert list(value) == list(expected[key]), key


def test_spec_ready_event_plus_protocol() -> None:
    event = ready_event(
        workers=2,
        preloaded_modules=[],
        package_dirs=[],
        config=Path("/etc/readie/prod.toml"),
        profiles=("analysis", "fetch"),
    )
    assert_same(event, {**spec(SPEC_READY), "protocol": PROTOCOL_VERSION})
    assert PROTOCOL_VERSION == 1


def test_ready_event_without_config() -> None:
    event = ready_event(workers=1, preloaded_modules=("pandas",), package_dirs=[Path("/srv/site")])
    assert (event["config"], event["profiles"], event["package_dirs"]) == (None, [], ["/srv/site"])
    assert event["preloaded_modules"] == ["pandas"]


SPEC_RESULT_VALUE = Result(
    id="task-1",
    exit=0,
    stdout='{"ok": true}\n',
    duration_ms=4,
    duration_us=4001,
    queue_us=120,
    runtime=RuntimeInfo.pool("3.11.17"),
    policy=policy_info(CodeJob("base", "", allow_write=("/abs/out",), timeout_ms=5000, memory_bytes=536870912), "landlock+seccomp"),
)


def test_spec_result() -> None:
    assert_same(result_line(SPEC_RESULT_VALUE), spec(SPEC_RESULT))


def test_spec_result_default_backend_is_gvisor() -> None:
    policy = policy_info(CodeJob("base", "")).to_json()
    assert policy["backend"] == "gvisor"
    assert (policy["network"], policy["subprocesses"], policy["memory_bytes"]) == ("deny", "deny", None)
    assert policy_info(CodeJob("base", "", network=True)).network == "allow"


def test_spec_stats() -> None:
    stats = Stats()
    outcomes = [
        (Outcome.OK, 0, None, 1391),
        (Outcome.FAILED, 1, "PermissionError", 41),
        (Outcome.FAILED, 1, "NameError", 30),
        (Outcome.FAILED, 3, None, 26),  # sys.exit(3): failed, no exception
        (Outcome.TIMEOUT, EXIT_TIMEOUT, "TimeoutError", 12),
        (Outcome.REQUEST_ERROR, EXIT_NOT_RUN, "RequestError", 20),
    ]
    for outcome, exit, error, count in outcomes:
        for n in range(count):
            info = None if error is None else ErrorInfo(type=error, message="m")
            # The first job carries all the time, so the totals come out exact.
            first = outcome is Outcome.OK and n == 0
            result = Result(id=n, exit=exit, error=info, duration_us=20_511_999 if first else 0, queue_us=98_120 if first else 0)
            assert result.outcome is outcome
            stats.record(result)
    stats.session_started()
    stats.session_started()
    snapshot = stats.snapshot("s1", uptime_ms=81234, workers=4).to_json()
    # The spec's fields, in its order; then readie's extra host-function and hibernation counters.
    extra = {key: snapshot.pop(key) for key in ("host", "sessions_hibernated", "session_images")}
    assert_same(snapshot, spec(SPEC_STATS))
    assert extra == {
        "host": {"calls": 0, "replies": 0, "late_replies": 0, "refused_frames": 0},
        "sessions_hibernated": 0,
        "session_images": {"hibernations": 0, "hibernation_ms_total": 0, "resumes": 0, "resume_ms_total": 0,
                           "forks": 0, "fork_ms_total": 0},
    }


def test_stats_jobs_is_the_sum_of_disjoint_outcomes() -> None:
    stats = Stats()
    stats.record(error_result(1, PoolWorkerError("crashed")))
    stats.record(error_result(2, SandboxSetupError("no mount")))
    stats.record(Result(id=3, exit=EXIT_NOT_RUN, error=ErrorInfo("SignalError", "killed by SIGKILL")))
    stats.record(Result(id=4, exit=1, error=ErrorInfo("TimeoutError", "raised by the code")))
    snap = stats.snapshot(5, uptime_ms=0, workers=1).to_json()
    assert (snap["jobs"], snap["worker_errors"], snap["signals"], snap["failed"], snap["timeouts"]) == (4, 2, 1, 1, 0)
    # A TimeoutError the code raised is a failure, not a pool timeout.
    assert snap["errors"] == {"PoolWorkerError": 1, "SandboxSetupError": 1, "SignalError": 1, "TimeoutError": 1}


def test_stats_snapshot_is_a_copy() -> None:
    stats = Stats()
    snap = stats.snapshot(1, 0, 1).to_json()
    snap["errors"]["X"] = 1
    assert stats.snapshot(1, 0, 1).to_json()["errors"] == {}


def test_sessions_active_cannot_go_negative() -> None:
    stats = Stats()
    stats.session_started()
    stats.session_ended()
    with pytest.raises(RuntimeError):
        stats.session_ended()


@given(st.lists(st.sampled_from(list(Outcome)), max_size=50))
def test_stats_counters_add_up(outcomes: list[Outcome]) -> None:
    error_for = {
        Outcome.OK: None,
        Outcome.FAILED: ErrorInfo("ValueError", ""),
        Outcome.TIMEOUT: ErrorInfo("TimeoutError", ""),
        Outcome.SIGNAL: ErrorInfo("SignalError", ""),
        Outcome.REQUEST_ERROR: ErrorInfo("RequestError", ""),
        Outcome.WORKER_ERROR: ErrorInfo("PoolWorkerError", ""),
    }
    exit_for = {Outcome.OK: 0, Outcome.FAILED: 1, Outcome.TIMEOUT: EXIT_TIMEOUT}
    stats = Stats()
    for outcome in outcomes:
        result = Result(id=1, exit=exit_for.get(outcome, EXIT_NOT_RUN), error=error_for[outcome], duration_us=1500)
        assert result.outcome is outcome
        stats.record(result)
    snap = stats.snapshot(1, 0, 1).to_json()
    counters = ("ok", "failed", "timeouts", "signals", "request_errors", "worker_errors")
    assert snap["jobs"] == len(outcomes) == sum(snap[c] for c in counters)
    assert sum(snap["errors"].values()) == len(outcomes) - snap["ok"]
    assert snap["duration_ms_total"] == 1500 * len(outcomes) // 1000


def test_spec_log_line() -> None:
    result = Result(
        id="tool-42",
        exit=1,
        stdout="secret output never logged",
        error=ErrorInfo(type="PermissionError", message="[Errno 13] Permission denied: '/etc/passwd'", file="t.py", line=1),
        duration_ms=4,
        duration_us=4999,
        queue_us=85,
        policy=policy_info(CodeJob("base", "")),
    )
    line = job_log_line(result, ts_ms=1792310000123)
    assert_same(line, spec(SPEC_LOG))
    assert "secret" not in json.dumps(line)


def test_log_line_for_a_session_step_and_a_refusal() -> None:
    step = Result(id=2, exit=0, stdout_truncated=False, stderr_truncated=True,
                  policy=policy_info(CodeJob("base", "", network=True)), session="notebook-7", step=2)
    line = job_log_line(step, ts_ms=1)
    assert (line["session"], line["step"], line["network"], line["truncated"], line["error"]) == (
        "notebook-7", 2, "allow", True, None,
    )
    refusal = refused_result(Refused(None, RequestError("unknown field", "cwd")))
    line = job_log_line(refusal, ts_ms=1)
    assert (line["id"], line["exit"], line["error"], line["message"], line["network"]) == (
        None, -1, "RequestError", "cwd: unknown field", None,
    )


def test_refusal_result_line() -> None:
    refusal = parse_request(b'{"id": "task-9", "code": "x", "timeout": "1.5s"}')
    assert isinstance(refusal, Refused)
    runtime = RuntimeInfo.pool("3.11.7", ("pandas",))
    line = result_line(refused_result(refusal, runtime))
    assert_same(line, {
        "id": "task-9",
        "exit": -1,
        "stdout": "",
        "stderr": "",
        "error": {
            "type": "RequestError",
            "message": "timeout: '1.5s' is not a duration: whole numbers only (write e.g. '1500ms')",
            "file": None,
            "line": None,
        },
        "stdout_truncated": False,
        "stderr_truncated": False,
        "duration_ms": 0,
        "duration_us": 0,
        "queue_us": 0,
        "runtime": {"name": "readie", "python": "3.11.7", "mode": "pool", "preloaded_modules": ["pandas"]},
        "policy": None,
    })


def test_worker_errors() -> None:
    result = error_result("j", SandboxSetupError("runsc restore failed"), queue_us=7, session="s", step=3)
    assert (result.outcome, result.exit, result.error) == (
        Outcome.WORKER_ERROR, EXIT_NOT_RUN, ErrorInfo("SandboxSetupError", "runsc restore failed"),
    )
    line = result_line(result)
    assert list(line)[-3:] == ["session", "step", "session_ended"]
    assert (line["session"], line["step"], line["session_ended"], line["queue_us"]) == ("s", 3, True, 7)
    assert error_result("j", PoolWorkerError("x")).error.type == "PoolWorkerError"
    assert error_result("j", RequestError("busy", None), session="s").session_ended is False


def test_error_hint_only_when_present() -> None:
    plain = ErrorInfo("NameError", "name 'x' is not defined", "step.py", 1).to_json()
    assert list(plain) == ["type", "message", "file", "line"]
    hinted = ErrorInfo("PermissionError", "denied", "step.py", 2, hint="add the path to allow_write").to_json()
    assert list(hinted) == ["type", "message", "file", "line", "hint"]


def test_session_results_carry_session_fields() -> None:
    result = Result(id=2, exit=EXIT_TIMEOUT, error=ErrorInfo("TimeoutError", "5000 ms"),
                    session="notebook-7", step=2, session_ended=True)
    line = result_line(result)
    assert (line["session"], line["step"], line["session_ended"]) == ("notebook-7", 2, True)
    assert "session" not in result_line(SPEC_RESULT_VALUE)


@pytest.mark.parametrize(
    ("exit", "error", "outcome"),
    [
        (0, None, Outcome.OK),
        (1, None, Outcome.FAILED),
        (0, ErrorInfo("ValueError", ""), Outcome.FAILED),
        (1, ErrorInfo("TimeoutError", "raised by the code"), Outcome.FAILED),
        (EXIT_TIMEOUT, None, Outcome.FAILED),  # sys.exit(124)
        (EXIT_TIMEOUT, ErrorInfo("TimeoutError", ""), Outcome.TIMEOUT),
        (1, ErrorInfo("RequestError", ""), Outcome.FAILED),  # the code's own class of that name
        (EXIT_NOT_RUN, ErrorInfo("RequestError", ""), Outcome.REQUEST_ERROR),
        (EXIT_NOT_RUN, ErrorInfo("SignalError", ""), Outcome.SIGNAL),
        (EXIT_NOT_RUN, ErrorInfo("PoolWorkerError", ""), Outcome.WORKER_ERROR),
        (EXIT_NOT_RUN, ErrorInfo("SandboxSetupError", ""), Outcome.WORKER_ERROR),
        (signal_exit(9), ErrorInfo("MemoryError", ""), Outcome.FAILED),  # the memory backstop
    ],
)
def test_the_outcome_is_read_from_exit_and_error(exit: int, error: ErrorInfo | None, outcome: Outcome) -> None:
    assert Result(id=1, exit=exit, error=error).outcome is outcome


def test_exit_codes() -> None:
    assert (EXIT_NOT_RUN, EXIT_TIMEOUT, signal_exit(9), signal_exit(11)) == (-1, 124, 137, 139)


def test_spec_call_event_and_close() -> None:
    assert_same(CallEvent("t1", 7, "search", ["readie"], {"limit": 2}).to_json(), spec(SPEC_CALL))
    assert_same(ClosedEvent(3, "notebook-7").to_json(), {"id": 3, "session": "notebook-7", "closed": True})


# --------------------------------------------------------------------------- encoding


def test_encode_line() -> None:
    data = encode_line(result_line(SPEC_RESULT_VALUE))
    assert data.endswith(b"\n") and data.count(b"\n") == 1
    assert json.loads(data) == result_line(SPEC_RESULT_VALUE)
    assert encode_line({"s": "caf\u00e9\n"}) == '{"s": "caf\u00e9\\n"}\n'.encode()


def test_encode_line_survives_lone_surrogates() -> None:
    data = encode_line({"stdout": "bad \udcff byte"})
    assert data == b'{"stdout": "bad \\udcff byte"}\n'


def test_encode_line_refuses_nan() -> None:
    with pytest.raises(ValueError):
        encode_line({"x": float("nan")})


@given(st.text(), st.text())
def test_any_output_encodes_to_one_line(stdout: str, stderr: str) -> None:
    result = Result(id="x", exit=0, stdout=stdout, stderr=stderr)
    data = encode_line(result_line(result))
    assert data.count(b"\n") == 1 and data.endswith(b"\n")
    assert json.loads(data)["stdout"] == stdout
