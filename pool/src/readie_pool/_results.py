"""Every result line the engine writes, built in one place as the one
:class:`~readie_protocol.results.Result` that goes to the client: a worker's
:class:`JobOutcome` (:func:`job_result`), or readie's refusal or failure
(:func:`error_result`, :func:`refused_result`).

The worker reports what happened; the pool protocol wants an integer
``exit`` and an error type from its list, which is also the stats counter the
job adds to (:attr:`Result.outcome` reads it back; ``readie_protocol.results``
says what ``exit`` holds). The rules, in order:

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

What ``collect`` brought back (decision 31) is the outcome's, checked by the
worker against the job's limits before it got here: the result carries its
files, and what matched but was left out. So is what the egress policy refused a networked
job (decision 35), checked by whoever read it from the wire: the result carries it as it is.

``runtime`` and ``policy`` come from the pool (the job it built), not from the outcome: the
outcome's ``python`` and ``preloaded_modules`` are what the job's process
claimed, and the job could have forged them. ``backend`` is the worker's.

A forged answer (the job writes its own result JSON) can claim any exit from 0
to 255 with any error, and so the runner's "not started" too: it may make its
own line read as a timeout (exit 124, TimeoutError) or as refused before its
code ran (exit -1 with RequestError or SandboxSetupError, its own message), and
be counted as one, nothing more: a job can only misreport itself.
"""

from __future__ import annotations

import signal

from readie_executor.jobs import EXIT_NOT_STARTED
from readie_worker.jobs import JobOutcome
from readie_worker.sessions import StepOutcome

from readie_worker.errors import ErrorType, ReadieError, error_type
from readie_protocol.errors import StepLost
from readie_protocol.requests import Refused
from readie_protocol.results import EXIT_NOT_RUN, EXIT_TIMEOUT, ErrorInfo, Result, RuntimeInfo
from ._events import DEFAULT_BACKEND, policy_info, signal_exit
from readie_policy.jobs import CodeJob
from readie_protocol.wire import RequestId

__all__ = ["EXIT_NOT_STARTED", "MEMORY_BACKSTOP_EXIT", "error_result", "job_result", "refused_result", "step_result"]

#: A sandbox killed by the memory backstop: the kernel's OOM killer sends SIGKILL.
MEMORY_BACKSTOP_EXIT = signal_exit(signal.SIGKILL)
MEMORY_ERROR = "MemoryError"

# Error types the runner reports for a job it did not start.
_NOT_STARTED = frozenset({ErrorType.REQUEST, ErrorType.SANDBOX_SETUP})


def job_result(
    id: RequestId,
    outcome: JobOutcome,
    *,
    runtime: RuntimeInfo,
    job: CodeJob,
    queue_us: int,
    session: str | None = None,
    step: int | None = None,
    session_ended: bool = False,
    resumed_ms: float | None = None,
    resumed_from_step: int | None = None,
    session_key: str | None = None,
) -> Result:
    """The result line for a job (or a session's step) the backend ran, or tried to; ``session_key``
    is given for a session's first step only (decision 32)."""
    exit_code, error = _classify(outcome)
    duration_us = max(0, outcome.duration_us)
    collected = outcome.collected
    return Result(
        id=id,
        exit=exit_code,
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        error=error,
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        duration_ms=duration_us // 1000,  # the spec's 4001 us is 4 ms
        duration_us=duration_us,
        queue_us=queue_us,
        runtime=runtime,
        policy=policy_info(job, outcome.backend),
        session=session,
        step=step,
        session_ended=session_ended,
        resumed_ms=None if resumed_ms is None else round(resumed_ms),
        value=outcome.value,
        files=outcome.files,
        files_truncated=outcome.files_truncated,
        collected=None if collected is None else collected.files,
        left_out=() if collected is None else collected.left_out,
        left_out_more=0 if collected is None else collected.left_out_more,
        session_key=session_key,
        resumed_from_step=resumed_from_step,
        network=outcome.network,
    )


def error_result(
    id: RequestId | None,
    error: ReadieError,
    *,
    runtime: RuntimeInfo | None = None,
    job: CodeJob | None = None,
    queue_us: int = 0,
    session: str | None = None,
    step: int | None = None,
    session_ended: bool | None = None,
) -> Result:
    """A job that readie refused or failed: RequestError, SandboxSetupError, PoolWorkerError.

    ``job`` is what the line reports as its policy, unless ``error`` refuses the
    request: a refused job was granted nothing. In a session, a worker error ends
    it unless ``session_ended`` says otherwise (a hibernation refused for the
    worker's image bounds leaves it as it was). A :class:`StepLost` (decision 32: the step's
    worker was lost while it ran) is a PoolWorkerError marked ``lost``, and ends nothing: the
    session goes on from its last stored state.
    """
    kind = error_type(error)
    granted = None if kind is ErrorType.REQUEST else job
    lost = isinstance(error, StepLost)
    if lost:
        session_ended = False
    elif session_ended is None:  # a worker failure takes the session's process with it
        session_ended = session is not None and kind is not ErrorType.REQUEST
    return Result(
        id=id,
        exit=EXIT_NOT_RUN,
        error=ErrorInfo(type=kind, message=str(error)),
        queue_us=queue_us,
        runtime=runtime,
        policy=None if granted is None else policy_info(granted, DEFAULT_BACKEND),
        session=session,
        step=step,
        session_ended=session_ended,
        lost=lost,
    )


def refused_result(refusal: Refused, runtime: RuntimeInfo | None = None) -> Result:
    """The result line answering a refused request."""
    return error_result(refusal.id, refusal.error, runtime=runtime)


def step_result(
    id: RequestId, outcome: StepOutcome, *, runtime: RuntimeInfo, job: CodeJob, queue_us: int, session: str,
    session_key: str | None = None,
) -> Result:
    """The result line for a session's step (:func:`job_result` with the step's fields)."""
    return job_result(
        id, outcome.outcome, runtime=runtime, job=job, queue_us=queue_us, session=session, step=outcome.step,
        session_ended=outcome.session_ended, resumed_ms=outcome.resumed_ms,
        resumed_from_step=outcome.resumed_from_step, session_key=session_key,
    )


def _classify(outcome: JobOutcome) -> tuple[int, ErrorInfo | None]:
    info = outcome.error  # already the result line's ErrorInfo
    if outcome.exit is None:
        return _without_exit(info)
    if info is not None and outcome.exit == EXIT_NOT_STARTED and info.type in _NOT_STARTED:
        # file/line point at nothing: the job's code never ran.
        return EXIT_NOT_RUN, ErrorInfo(info.type, info.message)
    return outcome.exit, info


def _without_exit(info: ErrorInfo | None) -> tuple[int, ErrorInfo | None]:
    kind = None if info is None else info.type
    if info is not None:
        if kind == ErrorType.TIMEOUT:
            return EXIT_TIMEOUT, info
        if kind == MEMORY_ERROR:
            return MEMORY_BACKSTOP_EXIT, info
        if kind in (ErrorType.SIGNAL, ErrorType.POOL_WORKER, ErrorType.SANDBOX_SETUP, ErrorType.REQUEST):
            return EXIT_NOT_RUN, info
    what = "no error" if info is None else f"{info.type}: {info.message}"
    message = f"the job ended without an exit status ({what})"
    return EXIT_NOT_RUN, ErrorInfo(ErrorType.POOL_WORKER, message)
