"""Parsing what the pool writes: the spec's own example lines, and lines built by the pool's code."""

from __future__ import annotations

import json
from typing import Any

import pytest
import readie
from readie import ErrorInfo, PolicyInfo, ReadyEvent, Result, RuntimeInfo
from readie_protocol import PROTOCOL_VERSION
from readie_protocol.events import parse_ready, parse_result, parse_stats
from readie_pool.sans_io import PoolWorkerError as RouterPoolWorkerError
from readie_pool.sans_io import RequestError as RouterRequestError
from readie_pool.sans_io import ErrorInfo as RouterErrorInfo
from readie_pool.sans_io import error_result, policy_info
from readie_pool.sans_io import RuntimeInfo as RouterRuntimeInfo
from readie_policy.jobs import CodeJob


def result_line(result: Result) -> dict[str, Any]:
    return result.to_json()


def ready_event(**fields: Any) -> dict[str, Any]:
    return ReadyEvent.pool(**fields).to_json()

# Verbatim from the pool protocol spec (pool-protocol.txt, "Results"), joined into one line.
SPEC_RESULT = (
    '{"id": "task-1", "exit": 0, "stdout": "{\\"ok\\": true}\\n", "stderr": "", "error": null,'
    ' "stdout_truncated": false, "stderr_truncated": false,'
    ' "duration_ms": 4, "duration_us": 4001, "queue_us": 120,'
    ' "runtime": {"name": "pynox", "python": "3.11.17", "mode": "pool", "preloaded_modules": []},'
    ' "policy": {"allow_read": [], "allow_write": ["/abs/out"], "network": "deny", "subprocesses": "deny",'
    ' "timeout_ms": 5000, "memory_bytes": 536870912, "backend": "landlock+seccomp"}}'
)
# The spec's ready event ("Starting"): no protocol field, which means version 1.
SPEC_READY = (
    '{"event": "ready", "workers": 2, "runtime": "pynox", "preloaded_modules": [], "package_dirs": [],'
    ' "config": "/etc/pynox/prod.toml", "profiles": ["analysis", "fetch"]}'
)
SPEC_STATS = (
    '{"id": "s1", "event": "stats", "uptime_ms": 81234, "workers": 4, "sessions_active": 2,'
    ' "jobs": 1520, "ok": 1391, "failed": 97, "timeouts": 12, "signals": 0,'
    ' "request_errors": 20, "worker_errors": 0, "duration_ms_total": 20511, "queue_us_total": 98120,'
    ' "errors": {"PermissionError": 41, "NameError": 30, "TimeoutError": 12, "RequestError": 20}}'
)


def test_the_specs_result_line():
    result = parse_result(json.loads(SPEC_RESULT))
    assert result == Result(
        id="task-1", exit=0, stdout='{"ok": true}\n', stderr="", error=None,
        stdout_truncated=False, stderr_truncated=False, duration_ms=4, duration_us=4001, queue_us=120,
        runtime=RuntimeInfo(name="pynox", python="3.11.17", mode="pool", preloaded_modules=()),
        policy=PolicyInfo(allow_read=(), allow_write=("/abs/out",), network="deny", subprocesses="deny",
                          timeout_ms=5000, memory_bytes=536870912, backend="landlock+seccomp"),
    )
    assert result.ok and not result.truncated
    assert result.raise_for_error() is result
    with pytest.raises(AttributeError):
        result.exit = 1  # type: ignore[misc]


def test_the_specs_ready_and_stats_events():
    assert parse_ready(json.loads(SPEC_READY)) == ReadyEvent(
        workers=2, runtime="pynox", preloaded_modules=(), package_dirs=(), config="/etc/pynox/prod.toml",
        profiles=("analysis", "fetch"), protocol=1,
    )
    stats = json.loads(SPEC_STATS)
    assert parse_stats(stats).to_json() == stats


def test_what_the_pool_writes_for_every_outcome_parses_back():
    runtime = RouterRuntimeInfo.pool("3.11.2", ("pandas",))
    job = CodeJob("base", "", allow_write=("/w",), timeout_ms=5000, memory_bytes=None)
    policy = policy_info(job)
    cases = [
        Result(id=1, exit=0, stdout="hi\n", duration_ms=4, duration_us=4001, runtime=runtime, policy=policy),
        Result(id="f", exit=1, stderr="Traceback...",
               error=RouterErrorInfo("PermissionError", "[Errno 13] denied", "<string>", 3, "granted: /w"),
               runtime=runtime, policy=policy, stderr_truncated=True),
        Result(id=3, exit=124, error=RouterErrorInfo("TimeoutError", "over 5000 ms"), runtime=runtime, policy=policy),
        error_result(4, RouterRequestError("not beneath the limits", "allow_read"), runtime=runtime),
        error_result(5, RouterPoolWorkerError("sandbox died"), runtime=runtime, job=job),
        Result(id=6, exit=0, session="nb", step=2, runtime=runtime, policy=policy),
    ]
    parsed = [parse_result(json.loads(json.dumps(result_line(case)))) for case in cases]
    ok, failed, timeout, refused, worker, step = parsed
    assert ok.ok and ok.duration_ms == 4 and ok.policy.allow_write == ("/w",) and ok.policy.memory_bytes is None
    assert ok.runtime == RuntimeInfo("readie", "3.11.2", "pool", ("pandas",))
    assert failed.error == ErrorInfo("PermissionError", "[Errno 13] denied", "<string>", 3, "granted: /w")
    assert failed.truncated and not failed.ok
    with pytest.raises(readie.JobError, match=r"PermissionError: \[Errno 13\] denied \(<string>, line 3\)"):
        failed.raise_for_error()
    assert timeout.exit == 124
    with pytest.raises(readie.JobError, match="TimeoutError"):
        timeout.raise_for_error()
    assert refused.exit == -1 and refused.policy is None
    with pytest.raises(readie.RequestError, match="allow_read: not beneath the limits") as raised:
        refused.raise_for_error()
    assert raised.value.result is refused
    with pytest.raises(readie.PoolWorkerError, match="sandbox died"):
        worker.raise_for_error()
    assert (step.session, step.step, step.session_ended) == ("nb", 2, False)
    assert ok.session is None and ok.step is None


def test_the_ready_event_the_pool_writes_and_its_version():
    event = ready_event(workers=3, preloaded_modules=["pandas"], profiles=["fetch"])
    assert parse_ready(json.loads(json.dumps(event))) == ReadyEvent(
        workers=3, runtime="readie", preloaded_modules=("pandas",), package_dirs=(), config=None,
        profiles=("fetch",), protocol=PROTOCOL_VERSION,
    )
    with pytest.raises(readie.VersionMismatch, match="version 2, this client speaks version 1"):
        parse_ready({**event, "protocol": 2})


def test_unknown_fields_are_ignored_and_wrong_types_break_the_protocol():
    line = json.loads(SPEC_RESULT)
    assert parse_result({**line, "new_field": [1]}) == parse_result(line)
    for key, value in [("exit", True), ("exit", "0"), ("stdout", None), ("duration_us", 1.5), ("policy", [])]:
        with pytest.raises(readie.PoolError, match=f"broke the protocol: a result.*{key}"):
            parse_result({**line, key: value})
    without = dict(line)
    del without["queue_us"]
    with pytest.raises(readie.PoolError, match="lacks 'queue_us'"):
        parse_result(without)
    with pytest.raises(readie.PoolError, match="a result's error: line has the wrong type"):
        parse_result({**line, "error": {"type": "X", "message": "m", "line": "3"}})
    with pytest.raises(readie.PoolError, match="first line is not the ready event"):
        parse_ready(line)
    with pytest.raises(readie.PoolError, match="not a JSON object"):
        parse_result([line])


def test_a_client_reads_what_the_network_policy_refused_and_a_model_is_told():
    report = readie.NetworkReport(
        refused_connections=3,
        refused=(readie.RefusedConnection("169.254.169.254", 80, 2), readie.RefusedConnection("2001:db8::1", 443, 1)),
        refused_lookups=1,
        refused_names=("denied.test.example",),
    )
    line = {**json.loads(SPEC_RESULT), "exit": 1, "error": {"type": "ConnectionRefusedError", "message": "refused",
                                                             "file": None, "line": None}}
    result = parse_result({**line, "network": report.to_json()})
    assert result.network == report
    assert parse_result(line).network is None
    told = readie.format_result(result)
    assert told.endswith("[Network policy: 3 connections refused (169.254.169.254:80, [2001:db8::1]:443); "
                         "1 name lookup refused (denied.test.example). These destinations are not allowed.]")
    assert "Network policy" not in readie.format_result(parse_result(line))
    quiet = parse_result({**line, "network": readie.NetworkReport().to_json()})
    assert "Network policy" not in readie.format_result(quiet)
