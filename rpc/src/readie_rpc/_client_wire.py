"""What a router (or any client of a worker) sends a worker and reads back: the other
direction of :mod:`._convert`, validation without I/O.

A job or step becomes its request message here; a worker's answer becomes an
outcome only through :func:`job_outcome`, which holds a network peer's answer
to what an honest worker sends (the sandbox's own bounds, and what the job
asked for) before anyone reads it.
"""

from __future__ import annotations

import dataclasses

from readie_executor.jobs import bounds

from ._convert import code_job
from ._files_wire import collected_from_message, file_messages
from ._network_wire import network_from_message
from ._proto.readie.v1 import worker_pb2 as pb
from ._session_wire import milliseconds
from readie_policy.jobs import CodeJob, HostStats, JobOutcome, Step, StepOutcome
from readie_protocol.errors import PoolWorkerError, RequestError
from readie_protocol.events import ErrorInfo, FileInfo, Value
from readie_protocol.requests import MAX_LISTED_FILES, MAX_PATH_CHARS

__all__ = ["attached_setup", "job_outcome", "run_job_request", "session_step_message", "setup_message", "step_outcome"]


def run_job_request(job: CodeJob, *, stream_output: bool = False) -> pb.RunJobRequest:
    request = pb.RunJobRequest(
        stream_output=stream_output,
        report_files=job.report_files,
        checkpoint=job.checkpoint,
        code=job.code,
        name=job.name,
        args=job.args,
        env=dict(job.env),
        cwd=job.cwd,
        allow_read=job.allow_read,
        allow_write=job.allow_write,
        package_dirs=job.package_dirs,
        network=job.network,
        network_destinations=[str(d) for d in job.egress.destinations] if job.egress is not None else [],
        timeout_ms=job.timeout_ms,
        max_output=job.max_output,
        packages=job.packages,
        functions=job.functions,
        files=file_messages(job.files),
        collect=job.collect,
        collect_bytes=job.collect_bytes,
        collect_files=job.collect_files,
        transfer_bytes=job.transfer_bytes,
    )
    if job.memory_bytes is not None:
        request.memory_bytes = job.memory_bytes
    if job.max_file_size is not None:
        request.max_file_size = job.max_file_size
    return request


def setup_message(job: CodeJob) -> pb.RunJobRequest:
    """A session's setup for ``SessionAttached.setup``: its job without the first step's code
    and files (what an attaching side needs of it is its limits, grants and host functions)."""
    return run_job_request(dataclasses.replace(job, code="", files=()))


def attached_setup(attached: pb.SessionAttached) -> CodeJob:
    """The job of a session attached by key, as its worker holds it (``SessionAttached.setup``),
    checked as a request is: PoolWorkerError for none, or for one no worker holds."""
    if not attached.HasField("setup"):
        raise PoolWorkerError("the worker attached a session without saying its setup")
    try:
        return code_job(attached.setup, None)
    except RequestError as exc:
        raise PoolWorkerError(f"the worker attached a session with a setup no worker holds ({exc})") from None


def session_step_message(step: Step) -> pb.SessionStep:
    message = pb.SessionStep(
        code=step.code,
        name=step.name,
        args=step.args,
        report_files=step.report_files,
        files=file_messages(step.files),
        collect=step.collect,
    )
    if step.timeout_ms is not None:
        message.timeout_ms = step.timeout_ms
    if step.max_output is not None:
        message.max_output = step.max_output
    return message


def step_outcome(response: pb.RunJobResponse, job: CodeJob) -> StepOutcome:
    """A session step's outcome from its response (``job``: the step as its session runs it):
    the outcome, its number, whether it ended the session."""
    resumed_ms = milliseconds(response.resumed_ms, "resumed_ms") if response.HasField("resumed_ms") else None
    resumed_from = response.resumed_from_step if response.HasField("resumed_from_step") else None
    if resumed_from is not None and resumed_from >= response.step:
        raise PoolWorkerError(f"the worker said step {response.step} resumed from step {resumed_from}, not an earlier one")
    return StepOutcome(job_outcome(response, job), response.step, response.session_ended, resumed_ms, resumed_from)


def job_outcome(response: pb.RunJobResponse, job: CodeJob) -> JobOutcome:
    """A worker's answer to ``job`` as an outcome; PoolWorkerError for one past what a sandbox
    can write, or past what the job asked for.

    An honest worker's answer keeps the sandbox's own bounds (the runner
    caps each field by its encoded size, so by characters too); a router or
    a pool must not pass on more than that, whatever a broken or hostile
    worker sends, since everything after (a result line, a client's reader)
    is sized by them. Collected files come back only when the job asked to
    collect, within the bytes and files it let come back; a network report only
    for a job with the network, within its bounds (readie_protocol.network).
    """
    _check_bounds(response)
    collected = None
    if response.HasField("collected"):
        if not job.collect:
            raise PoolWorkerError("the worker answered collected files to a job that asked for none")
        collected = collected_from_message(response.collected, max_files=job.collect_files, max_bytes=job.collect_bytes)
    network = network_from_message(response.network, networked=job.network) if response.HasField("network") else None
    error = None
    if response.HasField("error"):
        e = response.error
        error = ErrorInfo(
            type=e.type,
            message=e.message,
            file=e.file if e.HasField("file") else None,
            line=e.line if e.HasField("line") else None,
            hint=e.hint if e.HasField("hint") else None,
        )
    return JobOutcome(
        exit=response.exit if response.HasField("exit") else None,
        stdout=response.stdout,
        stderr=response.stderr,
        stdout_truncated=response.stdout_truncated,
        stderr_truncated=response.stderr_truncated,
        error=error,
        duration_us=response.duration_us,
        python=response.python,
        preloaded_modules=tuple(response.preloaded_modules),
        sandbox_id=response.sandbox_id if response.HasField("sandbox_id") else None,
        backend=response.backend,
        system_exit=response.system_exit,
        host=_stats(response.host) if response.HasField("host") else None,
        value=_value(response.value) if response.HasField("value") else None,
        files=_written(response.files) if response.HasField("files") else None,
        files_truncated=response.files.truncated,
        collected=collected,
        network=network,
    )


# The text fields of an answer and the most characters an honest sandbox writes in each.
_ANSWER_BOUNDS = (
    ("stdout", bounds.MAX_OUTPUT_LIMIT),
    ("stderr", bounds.MAX_OUTPUT_LIMIT),
    ("python", bounds.MAX_PYTHON_VERSION),
)
_ERROR_BOUNDS = (
    ("type", bounds.MAX_ERROR_TYPE),
    ("message", bounds.MAX_ERROR_MESSAGE),
    ("file", bounds.MAX_FILE_NAME),
    ("hint", bounds.MAX_HINT),
)


def _check_bounds(response: pb.RunJobResponse) -> None:
    fields = [(name, getattr(response, name), limit) for name, limit in _ANSWER_BOUNDS]
    fields += [(f"error.{name}", getattr(response.error, name), limit) for name, limit in _ERROR_BOUNDS]
    for name, value, limit in fields:
        if len(value) > limit:
            raise PoolWorkerError(f"the worker answered a {name} of {len(value)} characters, over the sandbox's {limit}")
    if len(response.preloaded_modules) > bounds.MAX_PRELOADED_MODULES or any(
        len(module) > bounds.MAX_MODULE_NAME for module in response.preloaded_modules
    ):
        raise PoolWorkerError("the worker answered more preloaded modules than a sandbox reports")


def _value(message: pb.JobValue) -> Value:
    """A worker's value, held to the sandbox's own caps (a worker is a network peer)."""
    omitted = tuple(message.omitted)
    if (
        len(message.text) > bounds.MAX_VALUE_TEXT
        or not set(message.data) <= bounds.DISPLAY_TYPES
        or sum(map(len, message.data.values())) > bounds.MAX_DISPLAY_BYTES
        or len(omitted) > len(bounds.DISPLAY_TYPES)
        or not set(omitted) <= bounds.DISPLAY_TYPES
    ):
        raise PoolWorkerError("the worker answered a value a sandbox does not write")
    data = {mime: message.data[mime] for mime in sorted(message.data)}
    return Value(message.text, message.truncated, data, omitted)


def _written(message: pb.WrittenFiles) -> tuple[FileInfo, ...]:
    """A worker's list of written files, held to the worker's own bounds (a worker is a network peer)."""
    if len(message.files) > MAX_LISTED_FILES or any(
        len(file.path) > MAX_PATH_CHARS or not file.path.startswith("/") or file.size < 0 for file in message.files
    ):
        raise PoolWorkerError("the worker answered a list of written files no worker writes")
    return tuple(FileInfo(file.path, file.size) for file in message.files)


def _stats(message: pb.HostStats) -> HostStats:
    return HostStats(
        calls=message.calls,
        replies=message.replies,
        junk=message.junk,
        forged=message.forged,
        host_errors=message.host_errors,
        wait_us=max(0, message.wait_us),
    )
