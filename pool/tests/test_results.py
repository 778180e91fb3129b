"""A worker's JobOutcome mapped to the pool's result: exit codes, counters, error types."""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import pytest
from readie_pool._events import (
    EXIT_NOT_RUN,
    EXIT_TIMEOUT,
    Outcome,
    RuntimeInfo,
)
from readie_protocol.results import Result
from readie_policy.jobs import CodeJob
from readie_pool._results import MEMORY_BACKSTOP_EXIT, job_result
from readie_pool.testing import ok_outcome
from readie_protocol.events import ErrorInfo, NetworkReport, RefusedConnection, parse_result
from readie_protocol.wire import encode_line
from readie_worker.jobs import JobOutcome


def result_line(result: Result) -> dict[str, Any]:
    return result.to_json()

RUNTIME = RuntimeInfo.pool("3.11.2", ("numpy",))
JOB = CodeJob("base", "print(1)", allow_write=("/abs/out",), timeout_ms=5000, memory_bytes=512 * 1024**2)


def error(
    type_: str,
    message: str = "m",
    file: str | None = None,
    line: int | None = None,
    hint: str | None = None,
) -> ErrorInfo:
    return ErrorInfo(type_, message, file, line, hint)


def mapped(outcome: JobOutcome):
    return job_result("t", outcome, runtime=RUNTIME, job=JOB, queue_us=7)


@pytest.mark.parametrize(
    ("exit", "err", "outcome", "exit_code", "error_type"),
    [
        (0, None, Outcome.OK, 0, None),
        (3, None, Outcome.FAILED, 3, None),  # sys.exit(3)
        (1, error("ValueError"), Outcome.FAILED, 1, "ValueError"),
        # the job's own exception class named like a pool error is still the job's failure
        (1, error("RequestError"), Outcome.FAILED, 1, "RequestError"),
        (1, error("SandboxSetupError"), Outcome.FAILED, 1, "SandboxSetupError"),
        # the in-sandbox runner refused or could not set up the job: exit 2, code never ran
        (2, error("RequestError"), Outcome.REQUEST_ERROR, EXIT_NOT_RUN, "RequestError"),
        (2, error("SandboxSetupError"), Outcome.WORKER_ERROR, EXIT_NOT_RUN, "SandboxSetupError"),
        (None, error("TimeoutError"), Outcome.TIMEOUT, EXIT_TIMEOUT, "TimeoutError"),
        (None, error("MemoryError", hint="h"), Outcome.FAILED, MEMORY_BACKSTOP_EXIT, "MemoryError"),
        (None, error("PoolWorkerError"), Outcome.WORKER_ERROR, EXIT_NOT_RUN, "PoolWorkerError"),
        (None, error("SandboxSetupError"), Outcome.WORKER_ERROR, EXIT_NOT_RUN, "SandboxSetupError"),
        (None, error("SignalError"), Outcome.SIGNAL, EXIT_NOT_RUN, "SignalError"),
        (None, error("RequestError"), Outcome.REQUEST_ERROR, EXIT_NOT_RUN, "RequestError"),
        (None, error("ValueError"), Outcome.WORKER_ERROR, EXIT_NOT_RUN, "PoolWorkerError"),
        (None, None, Outcome.WORKER_ERROR, EXIT_NOT_RUN, "PoolWorkerError"),
    ],
)
def test_outcomes_map_to_exit_counter_and_type(exit, err, outcome, exit_code, error_type):
    result = mapped(ok_outcome(exit=exit, error=err))
    assert (result.outcome, result.exit) == (outcome, exit_code)
    assert (None if result.error is None else result.error.type) == error_type


def test_memory_backstop_is_137_and_keeps_the_hint():
    result = mapped(ok_outcome(exit=None, error=error("MemoryError", hint="lower 'memory'")))
    assert MEMORY_BACKSTOP_EXIT == 137
    assert result.error.hint == "lower 'memory'"


def test_duration_ms_rounds_down():
    assert mapped(ok_outcome(duration_us=999)).duration_ms == 0
    assert (mapped(ok_outcome(duration_us=4001)).duration_ms, mapped(ok_outcome(duration_us=-5)).duration_us) == (4, 0)


def test_unknown_type_without_exit_names_what_the_worker_said():
    result = mapped(ok_outcome(exit=None, error=error("Weird", "no idea")))
    assert result.error.message == "the job ended without an exit status (Weird: no idea)"


def test_every_field_of_the_line_comes_from_outcome_pool_and_policy():
    outcome = JobOutcome(
        exit=1,
        stdout="out",
        stderr="Traceback...",
        stdout_truncated=True,
        stderr_truncated=False,
        error=ErrorInfo("PermissionError", "denied", "step.py", 3, "granted: /abs/out"),
        duration_us=4001,
        python="9.9.9",  # the job's claim; the pool reports its own
        preloaded_modules=("forged",),
        sandbox_id="sb",
        backend="gvisor:runsc-restore",
    )
    line = result_line(mapped(outcome))
    assert line == {
        "id": "t",
        "exit": 1,
        "stdout": "out",
        "stderr": "Traceback...",
        "error": {
            "type": "PermissionError",
            "message": "denied",
            "file": "step.py",
            "line": 3,
            "hint": "granted: /abs/out",
        },
        "stdout_truncated": True,
        "stderr_truncated": False,
        "duration_ms": 4,
        "duration_us": 4001,
        "queue_us": 7,
        "runtime": {
            "name": "readie",
            "python": "3.11.2",
            "mode": "pool",
            "preloaded_modules": ["numpy"],
        },
        "policy": {
            "allow_read": [],
            "allow_write": ["/abs/out"],
            "network": "deny",
            "subprocesses": "deny",
            "timeout_ms": 5000,
            "memory_bytes": 536870912,
            "backend": "gvisor:runsc-restore",
        },
    }


def test_runner_refusal_drops_file_and_line():
    result = mapped(ok_outcome(exit=2, error=error("RequestError", "bad", "x.py", 1)))
    assert (result.error.file, result.error.line) == (None, None)


def test_a_networked_job_s_line_says_what_the_egress_policy_refused_and_a_client_reads_it():
    report = NetworkReport(
        refused_connections=3,
        refused=(RefusedConnection("169.254.169.254", 80, 2), RefusedConnection("203.0.113.9", 8000, 1)),
        refused_lookups=1,
        refused_names=("denied.test.example",),
    )
    result = mapped(dataclasses.replace(ok_outcome(exit=1, error=error("ConnectionRefusedError")), network=report))
    line = json.loads(encode_line(result.to_json()))
    assert line["network"] == {
        "refused_connections": 3,
        "refused": [{"address": "169.254.169.254", "port": 80, "count": 2},
                    {"address": "203.0.113.9", "port": 8000, "count": 1}],
        "refused_lookups": 1,
        "refused_names": ["denied.test.example"],
        "allowed_connections": 0,
    }
    assert parse_result(line) == result and parse_result(line).network == report


def test_a_line_without_the_network_has_no_network_key():
    line = json.loads(encode_line(mapped(ok_outcome()).to_json()))
    assert "network" not in line and parse_result(line).network is None
