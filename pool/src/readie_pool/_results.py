"""A worker's :class:`JobOutcome` turned into the pool's :class:`JobResult`, in one place.

The worker reports what happened; the pool protocol wants an integer
``exit``, an error type from its list and the stats counter the job adds to
(see ``_events`` for the exit conventions). The rules, in order:

* the job did not end on its own (``exit`` None):

  - ``TimeoutError``: killed at its deadline, exit 124, counted as a timeout;
  - ``MemoryError``: the sandbox hit the worker's cgroup backstop and was
    killed, exit 137 (128 + SIGKILL, what a shell shows for an OOM kill),
    counted as failed: the job's own code asked for the memory, and the
    error keeps the worker's hint;
  - ``SignalError``: a signal the worker did not attribute, exit -1;
  - ``PoolWorkerError`` and ``SandboxSetupError``: exit -1, a worker error;
  - ``RequestError``: exit -1, a request error;
  - any other type: reported as ``PoolWorkerError`` naming it, since a job
    without an exit status and without one of the types above means the
    worker failed to say what happened;

* the in-sandbox runner refused or could not set up the job before its
  code started: exit 2 (the runner's "not started") with ``RequestError``
  or ``SandboxSetupError``. Exit 2 matters: the job's own code can raise an
  exception class of that name, but that ends with exit 1 and is the job's
  failure like any other exception;
* otherwise the code ran: exit 0 without an error is ok, anything else
  failed, and ``exit`` is the job's own status.

``runtime`` and ``policy`` come from the pool, not from the outcome: the
outcome's ``python`` and ``preloaded_modules`` are what the job's process
claimed, and the job could have forged them. ``backend`` is the worker's.
"""

from __future__ import annotations

import signal

from readie_executor.jobs import EXIT_NOT_STARTED
from readie_worker.jobs import JobOutcome

from readie_worker.errors import ErrorType
from ._events import (
    EXIT_NOT_RUN,
    EXIT_TIMEOUT,
    ErrorInfo,
    JobResult,
    Outcome,
    RuntimeInfo,
    signal_exit,
)
from readie_policy.policy import Policy
from readie_protocol.wire import RequestId

__all__ = ["EXIT_NOT_STARTED", "MEMORY_BACKSTOP_EXIT", "job_result"]

#: A sandbox killed by the memory backstop: the kernel's OOM killer sends SIGKILL.
MEMORY_BACKSTOP_EXIT = signal_exit(signal.SIGKILL)
MEMORY_ERROR = "MemoryError"

# Error types the runner reports for a job it did not start, and their counter.
_NOT_STARTED: dict[str, Outcome] = {
    ErrorType.REQUEST: Outcome.REQUEST_ERROR,
    ErrorType.SANDBOX_SETUP: Outcome.WORKER_ERROR,
}


def job_result(
    id: RequestId,
    outcome: JobOutcome,
    *,
    runtime: RuntimeInfo,
    policy: Policy,
    queue_us: int,
    session: str | None = None,
    step: int | None = None,
    session_ended: bool = False,
    resumed_ms: float | None = None,
) -> JobResult:
    """The result line's value for a job (or a session's step) the backend ran, or tried to."""
    status, exit_code, error = _classify(outcome)
    return JobResult(
        id=id,
        outcome=status,
        exit=exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        error=error,
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        duration_us=max(0, outcome.duration_us),
        queue_us=queue_us,
        runtime=runtime,
        policy=policy,
        backend=outcome.backend,
        session=session,
        step=step,
        session_ended=session_ended,
        resumed_ms=None if resumed_ms is None else round(resumed_ms),
        value=outcome.value,
        files=outcome.files,
        files_truncated=outcome.files_truncated,
    )


def _classify(outcome: JobOutcome) -> tuple[Outcome, int, ErrorInfo | None]:
    info = outcome.error  # already the result line's ErrorInfo
    if outcome.exit is None:
        return _without_exit(info)
    if info is not None and outcome.exit == EXIT_NOT_STARTED and info.type in _NOT_STARTED:
        # file/line point at nothing: the job's code never ran.
        return _NOT_STARTED[info.type], EXIT_NOT_RUN, ErrorInfo(info.type, info.message)
    if info is None and outcome.exit == 0:
        return Outcome.OK, 0, None
    return Outcome.FAILED, outcome.exit, info


def _without_exit(info: ErrorInfo | None) -> tuple[Outcome, int, ErrorInfo | None]:
    kind = None if info is None else info.type
    if info is not None:
        if kind == ErrorType.TIMEOUT:
            return Outcome.TIMEOUT, EXIT_TIMEOUT, info
        if kind == MEMORY_ERROR:
            return Outcome.FAILED, MEMORY_BACKSTOP_EXIT, info
        if kind == ErrorType.SIGNAL:
            return Outcome.SIGNAL, EXIT_NOT_RUN, info
        if kind in (ErrorType.POOL_WORKER, ErrorType.SANDBOX_SETUP):
            return Outcome.WORKER_ERROR, EXIT_NOT_RUN, info
        if kind == ErrorType.REQUEST:
            return Outcome.REQUEST_ERROR, EXIT_NOT_RUN, info
    what = "no error" if info is None else f"{info.type}: {info.message}"
    message = f"the job ended without an exit status ({what})"
    return Outcome.WORKER_ERROR, EXIT_NOT_RUN, ErrorInfo(ErrorType.POOL_WORKER, message)
