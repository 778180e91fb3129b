"""Code jobs on the worker side: grants onto mount slots, the call, the hostile result.

A job runs in a sandbox through ``readie_executor.jobs.run_job``, pickled here
as a reference (the trusted side pickles; it never unpickles). The answer is
JSON that the job itself could have forged, so it goes through
:func:`parse_job_result` before anything reads it.

While it runs, a job that declared host functions may call them: each call
frame is validated by :mod:`._host_frames` and handed to the ``host``
callback given to :func:`run_in_sandbox` (decision 8).
"""

from __future__ import annotations

import dataclasses
import pickle
import time
from collections.abc import Callable, Mapping
from typing import TypeVar

import structlog

from readie_executor.jobs import DEFAULT_INLINE_NAME, EXIT_NOT_STARTED, run_job

from ._host_frames import (
    MAX_CALL_FRAME_BYTES,
    MAX_REFUSED_FRAMES,
    HostCall,
    HostConversation,
    HostReply,
    HostStats,
    TooManyRefusedFrames,
    check_functions,
)

from ._output_frames import (
    MIN_FORWARD_INTERVAL_S,
    SMALL_FRAME_BURST,
    SMALL_FRAMES_PER_S,
    OutputChunk,
    OutputRelay,
    OutputSink,
    max_output_events,
)

from ._grant_fs import ListedGrants
from ._host_answer import HostAnswer
from ._workspace import collect, spec_files
from ._job_result import SandboxAnswer, JobResultInvalid, max_result_bytes, parse_job_result
from readie_protocol.cancel import NEVER, Cancellation
from .errors import ErrorType, PoolWorkerError, RequestError, SandboxSetupError
from readie_policy.jobs import CodeJob, HostFunction, JobOutcome, Step, ask_host
from readie_protocol.events import ErrorInfo
from readie_protocol.workspace import Collected
from .sandbox import ExecutorTimeout, Sandbox
from .written import written_since

__all__ = [
    "DEFAULT_INLINE_NAME",
    "CodeJob",
    "HostCall",
    "HostFunction",
    "HostReply",
    "HostStats",
    "JobOutcome",
    "OutputChunk",
    "OutputSink",
    "Step",
    "MAX_REFUSED_FRAMES",
    "MIN_FORWARD_INTERVAL_S",
    "SMALL_FRAMES_PER_S",
    "SMALL_FRAME_BURST",
    "answered",
    "ask_host",
    "max_output_events",
    "check_functions",
    "runner_call",
    "run_in_sandbox",
]

log = structlog.get_logger("readie.worker")

_Answer = TypeVar("_Answer")

# Files count: /tmp, /dev/shm and everything written outside the grants live
# in the sandbox's memory, under the same cgroup as its allocations.
# After a job's timeout its code is stopped inside the sandbox (SIGALRM) and
# answers with what it printed; C code that never yields to Python gets this
# long before the sandbox is killed instead.
TIMEOUT_GRACE_S = 0.5
CANCELLED_MESSAGE = "the call was cancelled (or its deadline passed): the job was stopped"
MEMORY_BACKSTOP_HINT = (
    "the sandbox's memory, files it wrote to /tmp or anywhere outside its write grants "
    "included, exceeded {limit}; write large files to a write grant, or keep allocations "
    "under 'memory' to get a MemoryError the code can catch"
)


def runner_call(
    job: CodeJob, links: tuple[Mapping[str, object], ...], session: bool = False, stream: bool = False,
    nameserver: str | None = None,
) -> bytes:
    """The pickled call: a reference to the trusted runner, and the job's spec (plain data,
    :meth:`CodeJob.spec`); ``nameserver``: a networked sandbox's resolver (its gateway)."""
    spec = job.spec(links, session=session, stream=stream)
    if job.files:  # written into the workspace before the code runs (decision 31)
        spec["files"] = spec_files(job)
    if nameserver is not None:
        spec["nameserver"] = nameserver
    # The standard pickler: the runner goes by reference and the spec is plain data, so its bytes are
    # what cloudpickle writes (which the executor loads), without cloudpickle's per-object Python hook
    # (~60 us of a settled step, measured).
    return pickle.dumps({"func": run_job, "args": (spec,), "kwargs": {}}, protocol=pickle.HIGHEST_PROTOCOL)


def run_in_sandbox(
    sandbox: Sandbox,
    job: CodeJob,
    links: tuple[Mapping[str, object], ...],
    host: HostFunction | None = None,
    *,
    session: bool = False,
    cancel: Cancellation = NEVER,
    output: OutputSink | None = None,
) -> JobOutcome:
    """Run ``job`` in ``sandbox`` until it answers, its deadline passes or ``cancel`` is set.

    ``host`` answers the calls the job makes to its declared ``functions``,
    on this thread; the time it takes counts against the job's timeout. A
    job that declares functions needs one (RequestError otherwise).
    ``output`` takes the job's output as it is written, on this thread, all
    of it before this returns (decision 16).
    ``session``: run as a step in the sandbox's persistent ``__main__``. A
    cancel interrupts the exchange at once (the job then counts as failed
    under the worker, and the sandbox is not trusted again).
    ``job.report_files``: the outcome lists what the job wrote to the write
    grants the sandbox has mounted (``sandbox.write_grants``; ``written.py``).
    ``job.files`` are written into its workspace before its code runs, and
    ``job.collect``'s matches are read after it answered (``_workspace.py``):
    the outcome's ``collected``, empty when there was no answer to read them
    after (a timeout, a crash: the sandbox is gone). A sandbox that answers
    the collect out of bounds fails the job with a worker error.

    The caller destroys the sandbox afterwards: a timed-out or crashed one is
    never reused, and by default neither is a healthy one.
    """
    check_functions(job.functions)
    if job.functions and host is None:
        raise RequestError(
            f"{len(job.functions)} host functions declared, but nothing here answers them",
            field="functions",
        )
    outcome = _reported(sandbox, job, links, host, session, cancel, output)
    if sandbox.network is not None:  # what its egress policy refused, the job's (or the step's) own
        try:
            outcome = dataclasses.replace(outcome, network=sandbox.network.report())
        except SandboxSetupError as exc:  # the job ran all the same: its result stands, unreported
            log.error("egress refusals not read", sandbox=sandbox.id, error=str(exc))
    return outcome


def _reported(
    sandbox: Sandbox, job: CodeJob, links: tuple[Mapping[str, object], ...], host: HostFunction | None,
    session: bool, cancel: Cancellation, output: OutputSink | None,
) -> JobOutcome:
    """The job's outcome, with what it wrote to its write grants when it asked (``report_files``)."""
    if not job.report_files:
        return _run(sandbox, job, links, host, session, cancel, output)
    # Held by descriptor for both listings, and checked to be what the sandbox has mounted
    # (decision 24): never a walk of whatever the grant's path leads to by then.
    with ListedGrants(sandbox.write_grants) as grants:
        before = grants.listing()
        outcome = _run(sandbox, job, links, host, session, cancel, output)
        after = grants.listing()
    changed = sorted({*before.changed, *after.changed})
    if changed:
        log.warning("write grants moved or replaced while held: not listed", sandbox=sandbox.id, grants=changed)
    files, cut = written_since(before, after)
    return dataclasses.replace(outcome, files=files, files_truncated=cut)


def _run(
    sandbox: Sandbox,
    job: CodeJob,
    links: tuple[Mapping[str, object], ...],
    host: HostFunction | None,
    session: bool,
    cancel: Cancellation,
    output: OutputSink | None,
) -> JobOutcome:
    backend = f"gvisor:{sandbox.launcher.name}" if sandbox.launcher.isolated else sandbox.launcher.name
    preparing = time.monotonic()
    nameserver = None if sandbox.network is None else str(sandbox.network.gateway)
    request = runner_call(job, links, session=session, stream=output is not None, nameserver=nameserver)
    # Even without functions: a frame the job writes by hand is refused, not taken for its result.
    conversation = HostConversation(job.functions)
    relay = None if output is None else OutputRelay(output, job.max_output)
    started = time.monotonic()
    answer = HostAnswer(conversation, host or _no_host, started + job.timeout_ms / 1000, relay, sandbox.send_now)
    # Call frames may be larger than a small job's whole result.
    limit = max(max_result_bytes(job.max_output), MAX_CALL_FRAME_BYTES)
    try:
        with cancel.stopping(sandbox.interrupt):
            # The job stops itself at its timeout and answers with its output so far;
            # the grace is for that answer, and then the sandbox is killed regardless.
            raw = sandbox.exchange(request, timeout=job.timeout_ms / 1000 + TIMEOUT_GRACE_S, max_response=limit, answer=answer)
    except PoolWorkerError as exc:
        outcome = _broken_exchange(exc, sandbox, job, backend, _since(started))
    else:
        answered = time.monotonic()
        elapsed = _since(started)
        try:
            result = parse_job_result(raw, job.max_output)
        except JobResultInvalid as exc:
            message = f"the sandbox answered with an invalid result: {exc}"
            outcome = JobOutcome.failure(ErrorType.POOL_WORKER, message, elapsed, backend, sandbox.id)
        else:
            if result.timed_out:  # the deadline kills the sandbox, whatever else the job left running
                sandbox.destroy()
            outcome = _from_result(result, elapsed, backend, sandbox.id)
            worker_us = {"request": started - preparing, "exchange": answered - started, "validate": time.monotonic() - answered}
            outcome = dataclasses.replace(outcome, worker_us={key: int(s * 1_000_000) for key, s in worker_us.items()})
            if job.collect and not sandbox.destroyed:
                outcome = _collected(sandbox, job, outcome, cancel)
    if relay is not None:
        relay.finish()  # what it held back is output too, and goes out ahead of the result
    if job.collect and outcome.collected is None:  # no answer to collect after: nothing came back
        outcome = dataclasses.replace(outcome, collected=Collected())
    return dataclasses.replace(outcome, host=conversation.stats)


def _collected(sandbox: Sandbox, job: CodeJob, outcome: JobOutcome, cancel: Cancellation) -> JobOutcome:
    """``outcome`` with what ``job.collect`` matched; a broken or lying answer fails the job (and,
    with no exit status, ends its session: the sandbox is not trusted again)."""
    try:
        return dataclasses.replace(outcome, collected=collect(sandbox, job, cancel))
    except PoolWorkerError as exc:
        error = ErrorInfo(ErrorType.POOL_WORKER, f"the job ran, but its files could not be collected: {exc}", None, None)
        return dataclasses.replace(outcome, exit=None, error=error, collected=Collected())


def _broken_exchange(exc: PoolWorkerError, sandbox: Sandbox, job: CodeJob, backend: str, duration_us: int) -> JobOutcome:
    """What a job came to when its exchange with the sandbox ended without an answer."""
    if sandbox.interrupted:  # cancelled: the caller is gone, but the log line still tells
        return JobOutcome.failure(ErrorType.POOL_WORKER, CANCELLED_MESSAGE, duration_us, backend, sandbox.id)
    if isinstance(exc, ExecutorTimeout):
        sandbox.destroy()  # the deadline kills the sandbox, whatever the job is doing
        return JobOutcome.failure(ErrorType.TIMEOUT, f"job exceeded its timeout of {job.timeout_ms} ms", duration_us, backend, sandbox.id)
    if isinstance(exc, TooManyRefusedFrames):
        return JobOutcome.failure(ErrorType.POOL_WORKER, f"the job was ended: {exc}", duration_us, backend, sandbox.id)
    if sandbox.oom_killed():
        limit = sandbox.memory_limit_bytes
        hint = MEMORY_BACKSTOP_HINT.format(
            limit="the worker's memory backstop" if limit is None else f"its limit of {limit // 2**20} MiB"
        )
        return JobOutcome.failure(
            "MemoryError", "the sandbox ran out of memory and was killed", duration_us, backend, sandbox.id, hint=hint
        )
    return JobOutcome.failure(ErrorType.POOL_WORKER, f"the sandbox failed under the job: {exc}", duration_us, backend, sandbox.id)


def _no_host(call: HostCall) -> HostReply:
    # Unreachable: without a host no function is declared, so every call is refused first.
    return HostReply(error=f"{call.function}: no host answers calls for this job")


def _from_result(result: SandboxAnswer, duration_us: int, backend: str, sandbox_id: str) -> JobOutcome:
    return JobOutcome(
        # Stopped at its deadline, it did not end on its own: a timeout, as if the
        # worker had killed it, but with the output it wrote.
        exit=None if result.timed_out else result.exit,
        stdout=result.stdout,
        stderr=result.stderr,
        stdout_truncated=result.stdout_truncated,
        stderr_truncated=result.stderr_truncated,
        error=result.error,
        duration_us=duration_us,
        python=result.python,
        preloaded_modules=result.preloaded_modules,
        sandbox_id=sandbox_id,
        backend=backend,
        system_exit=result.system_exit,
        code_us=result.duration_us,
        runner_us=result.phases,
        value=result.value,
    )


def _since(started: float) -> int:
    return int((time.monotonic() - started) * 1_000_000)


def call_step(
    sandbox: Sandbox,
    job: CodeJob,
    links: tuple[Mapping[str, object], ...],
    host: HostFunction | None = None,
    cancel: Cancellation = NEVER,
    output: OutputSink | None = None,
) -> tuple[JobOutcome, bool]:
    """Run one session step in ``sandbox``: its outcome, and whether it ends the session.

    A step ends the session when it did not end on its own (timeout, crash,
    an invalid answer: no exit status), when its code raised SystemExit, or
    when the runner could not set it up. The sandbox is destroyed by the
    session's end, not here (``run_in_sandbox`` destroys it at a timeout).
    """
    outcome = run_in_sandbox(sandbox, job, links, host, session=True, cancel=cancel, output=output)
    setup_failed = (
        outcome.exit == EXIT_NOT_STARTED
        and outcome.error is not None
        and outcome.error.type == ErrorType.SANDBOX_SETUP
    )
    return outcome, outcome.exit is None or outcome.system_exit or setup_failed


def answered(then: Callable[[_Answer], None] | None, outcome: _Answer) -> _Answer:
    """``outcome``, handed to ``then`` first: a caller's early answer (``Worker.run_job``'s ``then``)."""
    if then is not None:
        then(outcome)
    return outcome
