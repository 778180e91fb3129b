"""What the pool reports: results, stats, job logs.

The lines themselves are ``readie_protocol.events`` values, written through
the pool's :class:`~readie_protocol.connection.PoolConnection` and parsed
back into the same values by a client; :class:`JobResult` is the engine's account of a job,
which also says which outcome counter it belongs to, so :class:`Stats`
never guesses from strings, and :meth:`JobResult.to_wire` is its line.

``exit`` is always an integer, so a client testing ``exit == 0`` (or a shell
habit, ``if exit:``) never mistakes a job that did not run for a success:

* the code ran and exited: its exit status (0; 1 for an uncaught exception;
  ``n`` for ``sys.exit(n)``);
* killed by a signal: 128 + the signal number, as a shell reports it;
* killed at its timeout: 124, as ``timeout(1)`` reports it;
* never ran, or no status was observed (RequestError, SandboxSetupError,
  PoolWorkerError): -1, which no process can exit with.

A refused request still gets a full result line: empty output, zero
durations, ``policy`` null (none was resolved), ``runtime`` the pool's when
the caller passes it. Session results add ``session``, ``step`` and
``session_ended`` after the spec's fields; other results do not carry them.
The ready event adds ``protocol`` (:data:`PROTOCOL_VERSION`) so clients can
refuse a pool that speaks a version they do not.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from readie_protocol.events import RUNTIME_NAME, ErrorInfo, PolicyInfo, Result, RuntimeInfo, StatsEvent, Value, FileInfo
from readie_protocol.wire import PROTOCOL_VERSION, RequestId
from readie_worker.errors import ErrorType, ReadieError, error_type
from readie_policy.policy import Policy

from readie_protocol.requests import Refused

__all__ = [
    "DEFAULT_BACKEND",
    "EXIT_NOT_RUN",
    "EXIT_TIMEOUT",
    "PROTOCOL_VERSION",
    "RUNTIME_NAME",
    "ErrorInfo",
    "JobResult",
    "Outcome",
    "RuntimeInfo",
    "Stats",
    "job_log_line",
    "policy_info",
    "signal_exit",
]

#: The sandbox that enforces a policy, reported in every result's policy.
DEFAULT_BACKEND = "gvisor"

#: ``exit`` of a job that never ran or whose status was never observed.
EXIT_NOT_RUN = -1
#: ``exit`` of a job killed at its timeout, as ``timeout(1)`` reports it.
EXIT_TIMEOUT = 124


def signal_exit(signum: int) -> int:
    """``exit`` of a job killed by ``signum``, as a shell reports it."""
    return 128 + signum


class Outcome(enum.Enum):
    """Which stats counter a finished job adds to; the counters are disjoint."""

    OK = "ok"
    FAILED = "failed"  # the job's Python code raised or exited non-zero
    TIMEOUT = "timeouts"
    SIGNAL = "signals"
    REQUEST_ERROR = "request_errors"
    WORKER_ERROR = "worker_errors"  # PoolWorkerError and SandboxSetupError


# The error type each non-Python outcome must carry.
_OUTCOME_TYPES: dict[Outcome, frozenset[str]] = {
    Outcome.TIMEOUT: frozenset({ErrorType.TIMEOUT}),
    Outcome.SIGNAL: frozenset({ErrorType.SIGNAL}),
    Outcome.REQUEST_ERROR: frozenset({ErrorType.REQUEST}),
    Outcome.WORKER_ERROR: frozenset({ErrorType.POOL_WORKER, ErrorType.SANDBOX_SETUP}),
}


@dataclass(frozen=True, slots=True)
class JobResult:
    """One finished job (or refused request), as the pool reports it."""

    id: RequestId | None
    outcome: Outcome
    exit: int
    stdout: str = ""
    stderr: str = ""
    error: ErrorInfo | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_us: int = 0
    queue_us: int = 0
    runtime: RuntimeInfo | None = None
    policy: Policy | None = None
    backend: str = DEFAULT_BACKEND
    session: str | None = None
    step: int | None = None
    session_ended: bool = False
    value: Value | None = None
    files: tuple[FileInfo, ...] | None = None
    files_truncated: bool = False
    resumed_ms: int | None = None  # the step restored its hibernated session first

    def __post_init__(self) -> None:
        # Wrong combinations are bugs in the caller; refusing them here keeps
        # the stats counters and the wire consistent with each other.
        if self.outcome is Outcome.OK:
            if self.exit != 0 or self.error is not None:
                raise ValueError("an OK result has exit 0 and no error")
        elif self.outcome is Outcome.FAILED:
            if self.exit == 0 and self.error is None:
                raise ValueError("a FAILED result has an error or a non-zero exit")
        elif self.error is None or self.error.type not in _OUTCOME_TYPES[self.outcome]:
            allowed = " or ".join(sorted(_OUTCOME_TYPES[self.outcome]))
            raise ValueError(f"a {self.outcome.name} result carries an error of type {allowed}")
        if self.duration_us < 0 or self.queue_us < 0:
            raise ValueError("durations cannot be negative")

    @property
    def duration_ms(self) -> int:
        # Derived, so the two never disagree (the spec's 4001 us is 4 ms).
        return self.duration_us // 1000

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def to_wire(self) -> Result:
        """The result line this stands for, as a client reads it back."""
        return Result(
            id=self.id,
            exit=self.exit,
            stdout=self.stdout,
            stderr=self.stderr,
            error=self.error,
            stdout_truncated=self.stdout_truncated,
            stderr_truncated=self.stderr_truncated,
            duration_ms=self.duration_ms,
            duration_us=self.duration_us,
            queue_us=self.queue_us,
            runtime=self.runtime,
            policy=None if self.policy is None else policy_info(self.policy, self.backend),
            session=self.session,
            step=self.step,
            session_ended=self.session_ended,
            value=self.value,
            files=self.files,
            files_truncated=self.files_truncated,
            resumed_ms=self.resumed_ms,
        )

    @classmethod
    def refused(cls, refusal: Refused, runtime: RuntimeInfo | None = None) -> JobResult:
        """The result line answering a refused request."""
        return cls.from_error(refusal.id, refusal.error, runtime=runtime)

    @classmethod
    def from_error(
        cls,
        id: RequestId | None,
        error: ReadieError,
        *,
        runtime: RuntimeInfo | None = None,
        policy: Policy | None = None,
        queue_us: int = 0,
        session: str | None = None,
        step: int | None = None,
        session_ended: bool | None = None,
    ) -> JobResult:
        """A job that readie refused or failed: RequestError, SandboxSetupError, PoolWorkerError.

        In a session, a worker error ends it unless ``session_ended`` says otherwise (a
        hibernation refused for the worker's image bounds leaves it as it was).
        """
        kind = error_type(error)
        outcome = Outcome.REQUEST_ERROR if kind is ErrorType.REQUEST else Outcome.WORKER_ERROR
        return cls(
            id=id,
            outcome=outcome,
            exit=EXIT_NOT_RUN,
            error=ErrorInfo(type=kind, message=str(error)),
            queue_us=queue_us,
            runtime=runtime,
            policy=policy,
            session=session,
            step=step,
            # A worker failure takes the session's process with it.
            session_ended=(session is not None and outcome is Outcome.WORKER_ERROR) if session_ended is None else session_ended,
        )


# --------------------------------------------------------------------------- builders


def policy_info(policy: Policy, backend: str = DEFAULT_BACKEND) -> PolicyInfo:
    """What a result line says about the policy a job ran under."""
    return PolicyInfo(
        allow_read=tuple(str(p) for p in policy.allow_read),
        allow_write=tuple(str(p) for p in policy.allow_write),
        network="allow" if policy.network else "deny",
        subprocesses="allow" if policy.subprocesses else "deny",
        timeout_ms=policy.timeout_ms,
        memory_bytes=policy.memory_bytes,
        backend=backend,
    )


def job_log_line(result: JobResult, ts_ms: int) -> dict[str, Any]:
    """The ``--log=json`` line: identifiers, outcome and timing, never captured output."""
    return {
        "ts_ms": ts_ms,
        "event": "job",
        "id": result.id,
        "session": result.session,
        "step": result.step,
        "exit": result.exit,
        "error": None if result.error is None else result.error.type,
        "message": None if result.error is None else result.error.message,
        "duration_ms": result.duration_ms,
        "queue_us": result.queue_us,
        # null when no policy was resolved: a refused request had no network to deny.
        "network": None
        if result.policy is None
        else ("allow" if result.policy.network else "deny"),
        "truncated": result.truncated,
    }


# --------------------------------------------------------------------------- stats


class Stats:
    """The pool's counters, as the spec's stats event reports them.

    ``jobs`` counts every result the pool wrote (refusals included), and is
    the sum of the six outcome counters. ``errors`` counts results by error
    type, in the order types were first seen. ``host`` (after the spec's
    fields) counts host-function traffic: call events written, replies that
    reached their call, late or unknown replies (each also a RequestError
    result), and frames the worker refused from sandboxes (junk and forged
    calls, which never reach the client).
    """

    def __init__(self) -> None:
        self.jobs = 0
        self.counts = dict.fromkeys(Outcome, 0)
        self.duration_us_total = 0
        self.queue_us_total = 0
        self.errors: dict[str, int] = {}
        self.sessions_active = 0
        # Hibernations, resumes and forks: how many, and their milliseconds in all.
        self.session_images = {operation: [0, 0] for operation in ("hibernations", "resumes", "forks")}
        self.host_calls = 0
        self.host_replies = 0
        self.late_replies = 0
        self.host_frames_refused = 0

    def record(self, result: JobResult) -> None:
        self.jobs += 1
        self.counts[result.outcome] += 1
        self.duration_us_total += result.duration_us
        self.queue_us_total += result.queue_us
        if result.error is not None:
            self.errors[result.error.type] = self.errors.get(result.error.type, 0) + 1

    def session_started(self) -> None:
        self.sessions_active += 1

    def session_ended(self) -> None:
        if self.sessions_active == 0:
            raise RuntimeError("session_ended() without a session")
        self.sessions_active -= 1

    def session_image(self, operation: str, ms: float) -> None:
        """A hibernation, resume or fork that took ``ms``."""
        counted = self.session_images[operation]
        counted[0] += 1
        counted[1] += round(ms)

    def snapshot(self, id: RequestId, uptime_ms: int, workers: int, sessions_hibernated: int = 0) -> StatsEvent:
        """The stats event answering ``{"id": id, "stats": true}``."""
        return StatsEvent(id, {
            "uptime_ms": uptime_ms,
            "workers": workers,
            "sessions_active": self.sessions_active,
            "jobs": self.jobs,
            **{outcome.value: self.counts[outcome] for outcome in Outcome},
            # Total microseconds, rounded down once, rather than a sum of rounded values.
            "duration_ms_total": self.duration_us_total // 1000,
            "queue_us_total": self.queue_us_total,
            "errors": dict(self.errors),
            "host": {
                "calls": self.host_calls,
                "replies": self.host_replies,
                "late_replies": self.late_replies,
                "refused_frames": self.host_frames_refused,
            },
            # readie's, after the spec's fields: sessions on disk now, and what hibernating cost.
            "sessions_hibernated": sessions_hibernated,
            "session_images": {
                key: value for operation, (count, ms) in self.session_images.items()
                for key, value in ((operation, count), (f"{operation[:-1]}_ms_total", ms))
            },
        })
