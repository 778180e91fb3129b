"""What the pool reports beside the result lines: stats, job logs, a result's policy.

The lines themselves are ``readie_protocol.events`` values, written through
the pool's :class:`~readie_protocol.connection.PoolConnection` and parsed
back into the same values by a client. A job's result is one
:class:`~readie_protocol.results.Result` from the engine to the client
(built in ``_results``); :class:`Stats` counts it by its
:attr:`~readie_protocol.results.Result.outcome`, so it never guesses from
strings. ``readie_protocol.results`` says what ``exit`` holds.

A refused request still gets a full result line: empty output, zero
durations, ``policy`` null (none was resolved), ``runtime`` the pool's when
the caller passes it. Session results add ``session``, ``step`` and
``session_ended`` after the spec's fields; other results do not carry them.
The ready event adds ``protocol`` (:data:`PROTOCOL_VERSION`) so clients can
refuse a pool that speaks a version they do not.
"""

from __future__ import annotations

from typing import Any

from readie_protocol.events import RUNTIME_NAME, ErrorInfo, PolicyInfo, RuntimeInfo, StatsEvent
from readie_protocol.results import EXIT_NOT_RUN, EXIT_TIMEOUT, Outcome, Result
from readie_protocol.wire import PROTOCOL_VERSION, RequestId
from readie_policy.jobs import JOB_SUBPROCESSES, CodeJob

__all__ = [
    "DEFAULT_BACKEND",
    "EXIT_NOT_RUN",
    "EXIT_TIMEOUT",
    "PROTOCOL_VERSION",
    "RUNTIME_NAME",
    "ErrorInfo",
    "Outcome",
    "RuntimeInfo",
    "Stats",
    "job_log_line",
    "policy_info",
    "signal_exit",
]

#: The sandbox that enforces a policy, reported in every result's policy.
DEFAULT_BACKEND = "gvisor"


def signal_exit(signum: int) -> int:
    """``exit`` of a job killed by ``signum``, as a shell reports it."""
    return 128 + signum


# --------------------------------------------------------------------------- builders


def policy_info(job: CodeJob, backend: str = DEFAULT_BACKEND) -> PolicyInfo:
    """What a result line says about the policy a job ran under: the job's own grants and limits."""
    return PolicyInfo(
        allow_read=job.allow_read,
        allow_write=job.allow_write,
        network="allow" if job.network else "deny",
        subprocesses="allow" if JOB_SUBPROCESSES else "deny",
        timeout_ms=job.timeout_ms,
        memory_bytes=job.memory_bytes,
        backend=backend,
    )


def job_log_line(result: Result, ts_ms: int) -> dict[str, Any]:
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
        "network": None if result.policy is None else result.policy.network,
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

    def record(self, result: Result) -> None:
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
