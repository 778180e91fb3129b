"""Proto messages to readie values and back, on the serving side: validation without I/O.

A request from the wire becomes a :class:`~readie_policy.jobs.CodeJob` only
through :func:`code_job`, which refuses what no job needs with a
:class:`~readie_protocol.errors.RequestError` naming the field: negative or
absurd numbers, NUL characters (no path, argument or variable can hold one,
and ``compile`` refuses them in source), oversized strings and lists. Checks
that need the worker's state (the checkpoint exists, a grant fits a mount slot,
a path is an existing directory) stay with the worker. The calling side (a
job as its request, a worker's answer as its outcome) is :mod:`._client_wire`.
"""

from __future__ import annotations

import dataclasses
import posixpath
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from google.protobuf.message import Message

from ._files_wire import collect_patterns, collected_message, workspace_files
from ._network_wire import network_message
from ._proto.readie.v1 import worker_pb2 as pb
from ._status import DeadlineExpired
from readie_protocol.errors import ErrorType, RequestError, StepLost

from readie_policy.jobs import (
    DEFAULT_INLINE_NAME, Capacity, CodeJob, HostStats, JobOutcome, Step, StepOutcome, check_functions, validate_requirements,
)
from readie_policy.policy import NO_LIMITS, Limits, Profile, call_timeout, check_step, resolve_policy
from readie_protocol.requests import MAX_NAME_CHARS, MAX_OUTPUT_BYTES, MAX_PATH_CHARS, MAX_TIMEOUT_MS
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES

# Profile names in a config file are at most this long (config.py).
MAX_PROFILE_NAME = 64
# Checkpoint names are short identifiers from checkpoints.toml; the bound keeps
# the worker's "no checkpoint named ..." message short.
MAX_CHECKPOINT_NAME = 128
# Source text of one job. The executor compiles it inside the sandbox; a
# larger "script" is data, which belongs in a read grant, not in the request.
MAX_CODE_CHARS = 4 * 1024 * 1024
# Linux's default ARG_MAX budget for argv and the environment together, and its
# MAX_ARG_STRLEN for one string: what a script started from a shell could get.
MAX_ARGV_ENV_CHARS = 2 * 1024 * 1024
MAX_ARG_CHARS = 128 * 1024
MAX_ARGS = 4096
MAX_ENV_VARS = 1024
# Far above any mount plan (a few slots each); past it the request is garbage,
# below it the worker refuses with the real slot count.
MAX_GRANTS = 64
# More memory or file size than any worker has is a mistake, not a limit, and
# the executor adds its own baseline to memory_bytes, which must stay in rlim_t.
MAX_LIMIT_BYTES = 1 << 40
# A pickled call carries the function (by value, for code the sandbox lacks)
# and its arguments, data frames included; 64 MiB is generous for that and
# small enough to hold a few in memory at once on these 24 GiB machines.
MAX_CALL_PAYLOAD_BYTES = 64 * 1024 * 1024
# A job whose caller's deadline comes before its own timeout gets the deadline
# less this: time to kill its sandbox (~0.1 s) and send the structured
# TimeoutError, partial output and all, before the caller stops listening.
ANSWER_MARGIN_MS = 1000
DEFAULT_CWD = "/tmp"


def code_job(
    request: pb.RunJobRequest,
    time_remaining_s: float | None,
    limits: Limits = NO_LIMITS,
    profiles: Mapping[str, Profile] | None = None,
) -> CodeJob:
    """The job ``request`` asks for under the server's ceiling, or a RequestError naming the
    first bad field (as the proto names it).

    ``limits`` and ``profiles`` are that ceiling: a server passes
    ``Config.network_limits``, which grants nothing unless its operator said
    so. Paths are checked lexically here; the worker opens them without
    following symlinks (``grants.py``). ``time_remaining_s`` is what is left
    of the caller's gRPC deadline (None without one): the job's timeout is
    never longer, less :data:`ANSWER_MARGIN_MS`.
    """
    args = _args(tuple(request.args))
    env = _env(dict(request.env), budget=MAX_ARGV_ENV_CHARS - sum(len(arg) + 1 for arg in args))
    asked = _AskedPolicy(
        profile=_text("profile", request.profile, MAX_PROFILE_NAME) if request.HasField("profile") else None,
        allow_read=_paths("allow_read", request.allow_read),
        allow_write=_paths("allow_write", request.allow_write),
        package_dirs=_paths("package_dirs", request.package_dirs),
        env=tuple(env.items()) or None,
        allow_network=_network(request),
        timeout_ms=_optional_int(request, "timeout_ms", 1, MAX_TIMEOUT_MS),
        memory_bytes=_optional_int(request, "memory_bytes", 1, MAX_LIMIT_BYTES),
        max_output=_optional_int(request, "max_output", 0, MAX_OUTPUT_BYTES),
        max_file_size=_optional_int(request, "max_file_size", 1, MAX_LIMIT_BYTES),
        packages=validate_requirements(tuple(request.packages)) or None,
    )
    policy = resolve_policy(asked, cwd="/", limits=limits, profiles=profiles, resolve=None)
    # Checked in the order they always were: a request with two bad fields names the same one.
    checkpoint = checkpoint_name(request.checkpoint)
    code = _text("code", request.code, MAX_CODE_CHARS)
    name = _text("name", request.name, MAX_NAME_CHARS) or DEFAULT_INLINE_NAME
    cwd = _absolute("cwd", request.cwd) if request.HasField("cwd") else DEFAULT_CWD
    timeout_ms = cut_to_deadline(policy.timeout_ms, time_remaining_s)
    job = CodeJob.under(
        dataclasses.replace(policy, timeout_ms=timeout_ms),
        checkpoint=checkpoint,
        code=code,
        name=name,
        args=args,
        cwd=cwd,
        packages=asked.packages or (),
        functions=_functions(tuple(request.functions)),
        report_files=request.report_files,
    )
    # What the caller lets come back, never more than the job allows already (decision 31).
    return dataclasses.replace(
        job,
        files=workspace_files("files", request.files),
        collect=collect_patterns("collect", request.collect),
        collect_bytes=_lowered(request, "collect_bytes", job.collect_bytes, MAX_COLLECTED_BYTES),
        collect_files=_lowered(request, "collect_files", job.collect_files, MAX_COLLECTED_FILES),
        transfer_bytes=_lowered(request, "transfer_bytes", job.transfer_bytes, MAX_TRANSFER_BYTES),
    )


class Ceiling(NamedTuple):
    """What a server lets requests ask for: ``code_job``'s last two arguments."""

    limits: Limits
    profiles: Mapping[str, Profile]


@dataclass(frozen=True, slots=True)
class _AskedPolicy:
    """What a RunJobRequest asks of the ceiling, in the shape ``policy.resolve_policy`` reads;
    None: not asked. A request over gRPC names no script: it sends code."""

    profile: str | None
    allow_read: tuple[str, ...] | None
    allow_write: tuple[str, ...] | None
    package_dirs: tuple[str, ...] | None
    env: tuple[tuple[str, str], ...] | None
    allow_network: bool | tuple[str, ...] | None
    timeout_ms: int | None
    memory_bytes: int | None
    max_output: int | None
    max_file_size: int | None
    packages: tuple[str, ...] | None
    script: None = None


def session_step(message: pb.SessionStep, limits: Limits = NO_LIMITS) -> Step:
    """The step ``message`` asks for within the server's ceiling, or a RequestError naming the
    first bad field (``step.timeout_ms``: the step's, not the job's)."""
    try:
        step = Step(
            code=_text("code", message.code, MAX_CODE_CHARS),
            name=_text("name", message.name, MAX_NAME_CHARS) or DEFAULT_INLINE_NAME,
            args=_args(tuple(message.args)),
            timeout_ms=_optional_int(message, "timeout_ms", 1, MAX_TIMEOUT_MS),
            max_output=_optional_int(message, "max_output", 0, MAX_OUTPUT_BYTES),
            report_files=message.report_files,
            files=workspace_files("files", message.files),
            collect=collect_patterns("collect", message.collect),
        )
        check_step(step.timeout_ms, step.max_output, limits)
    except RequestError as exc:  # named as the step's field, not the session's
        raise RequestError(exc.reason, field=f"step.{exc.field}") from None
    return step


def call_payload(request: pb.ExecuteRequest) -> bytes:
    if not request.payload:
        raise RequestError("empty; it must be a pickled call", field="payload")
    if len(request.payload) > MAX_CALL_PAYLOAD_BYTES:
        raise RequestError(f"{len(request.payload)} bytes; at most {MAX_CALL_PAYLOAD_BYTES} are allowed", field="payload")
    return request.payload


def checkpoint_name(name: str) -> str:
    if not name:
        raise RequestError("required", field="checkpoint")
    return _text("checkpoint", name, MAX_CHECKPOINT_NAME)


def timeout_ms(request: pb.ExecuteRequest, time_remaining_s: float | None, limits: Limits = NO_LIMITS) -> int:
    """A call's timeout: the requested one within the ceiling (or the default), cut to what the
    caller's deadline leaves less :data:`ANSWER_MARGIN_MS`, so that a deadline ends the call
    with its own TimeoutError."""
    timeout = call_timeout(_optional_int(request, "timeout_ms", 1, MAX_TIMEOUT_MS), limits)
    return cut_to_deadline(timeout, time_remaining_s)


def cut_to_deadline(timeout: int, time_remaining_s: float | None) -> int:
    if time_remaining_s is None:
        return timeout
    left_ms = int(time_remaining_s * 1000) - ANSWER_MARGIN_MS
    if left_ms < 1:
        raise DeadlineExpired(
            f"the call's deadline leaves no time to run anything and answer ({ANSWER_MARGIN_MS} ms are kept for the answer)"
        )
    return min(timeout, left_ms)


def run_job_response(
    outcome: JobOutcome, step: StepOutcome | None = None, session_id: str | None = None, *, session_key: str | None = None
) -> pb.RunJobResponse:
    """The response for a job, or for a session's step (``step`` and ``session_id`` set;
    ``session_key`` on its first result, decision 32)."""
    response = pb.RunJobResponse(
        stdout=outcome.stdout,
        stderr=outcome.stderr,
        stdout_truncated=outcome.stdout_truncated,
        stderr_truncated=outcome.stderr_truncated,
        duration_us=outcome.duration_us,
        python=outcome.python,
        preloaded_modules=outcome.preloaded_modules,
        backend=outcome.backend,
        system_exit=outcome.system_exit,
    )
    if outcome.host is not None:
        response.host.CopyFrom(_stats_message(outcome.host))
    if step is not None:
        response.step = step.step
        response.session_ended = step.session_ended
        if step.resumed_ms is not None:
            response.resumed_ms = step.resumed_ms
        if step.resumed_from_step is not None:
            response.resumed_from_step = step.resumed_from_step
    if session_id is not None:
        response.session_id = session_id
    if session_key:
        response.session_key = session_key
    if outcome.exit is not None:
        response.exit = outcome.exit
    if outcome.sandbox_id is not None:
        response.sandbox_id = outcome.sandbox_id
    if outcome.error is not None:
        error = outcome.error
        response.error.type = error.type
        response.error.message = error.message
        if error.file is not None:
            response.error.file = error.file
        if error.line is not None:
            response.error.line = error.line
        if error.hint is not None:
            response.error.hint = error.hint
    if outcome.files is not None:
        written = [pb.WrittenFile(path=file.path, size=file.size) for file in outcome.files]
        response.files.CopyFrom(pb.WrittenFiles(files=written, truncated=outcome.files_truncated))
    if outcome.value is not None:
        value = outcome.value
        response.value.CopyFrom(
            pb.JobValue(text=value.text, truncated=value.truncated, data=dict(value.data), omitted=value.omitted)
        )
    if outcome.collected is not None:
        response.collected.CopyFrom(collected_message(outcome.collected))
    if outcome.network is not None:
        response.network.CopyFrom(network_message(outcome.network))
    return response


def lost_step_response(lost: StepLost, step: int, session_id: str) -> pb.RunJobResponse:
    """The result of step number ``step``, lost with the worker running it (decision 32): a
    PoolWorkerError marked ``lost``; the session is not ended, and the step is never run again."""
    outcome = JobOutcome.failure(ErrorType.POOL_WORKER, str(lost), 0, "")
    response = run_job_response(outcome, StepOutcome(outcome, step, False), session_id)
    response.lost = True
    return response


def _stats_message(stats: HostStats) -> pb.HostStats:
    return pb.HostStats(
        calls=stats.calls,
        replies=stats.replies,
        junk=stats.junk,
        forged=stats.forged,
        host_errors=stats.host_errors,
        wait_us=stats.wait_us,
    )


def capacity_response(capacity: Capacity, worker_name: str, protocol: int) -> pb.CapacityResponse:
    return pb.CapacityResponse(
        slots=capacity.slots,
        busy=capacity.busy,
        draining=capacity.draining,
        isolated=capacity.isolated,
        pools={name: pb.PoolState(ready=pool["ready"], target=pool["target"]) for name, pool in capacity.warm.items()},
        worker_name=worker_name,
        protocol=protocol,
        sessions=capacity.sessions,
        max_sessions=capacity.max_sessions,
        problem=capacity.problem,
    )


def _text(field: str, value: str, limit: int) -> str:
    if len(value) > limit:
        raise RequestError(f"{len(value)} characters long; at most {limit} are allowed", field=field)
    if "\0" in value:
        raise RequestError("contains a NUL character", field=field)
    return value


def _args(args: tuple[str, ...]) -> tuple[str, ...]:
    if len(args) > MAX_ARGS:
        raise RequestError(f"{len(args)} entries; at most {MAX_ARGS} are allowed", field="args")
    for index, arg in enumerate(args):
        _text(f"args[{index}]", arg, MAX_ARG_CHARS)
    if sum(len(arg) + 1 for arg in args) > MAX_ARGV_ENV_CHARS:
        raise RequestError(f"add up to more than {MAX_ARGV_ENV_CHARS} characters", field="args")
    return args


def _env(env: Mapping[str, str], budget: int) -> dict[str, str]:
    if len(env) > MAX_ENV_VARS:
        raise RequestError(f"{len(env)} variables; at most {MAX_ENV_VARS} are allowed", field="env")
    for key, value in env.items():
        if not key or "=" in key or "\0" in key:
            raise RequestError(f"invalid variable name: {key[:100]!r}", field="env")
        _text(f"env[{key[:100]!r}]", value, MAX_ARG_CHARS)
    if sum(len(key) + len(value) + 2 for key, value in env.items()) > budget:
        raise RequestError(f"args and env add up to more than {MAX_ARGV_ENV_CHARS} characters", field="env")
    return env


def _functions(functions: tuple[str, ...]) -> tuple[str, ...]:
    check_functions(functions)  # bounded count, valid names, no repeats
    return functions


def _absolute(field: str, path: str) -> str:
    _text(field, path, MAX_PATH_CHARS)
    if not posixpath.isabs(path):
        raise RequestError(f"{path[:200]!r} is not an absolute path", field=field)
    return path


def _paths(field: str, paths: Iterable[str]) -> tuple[str, ...] | None:
    """Absolute paths, or None for none: the ceiling checks them next, the worker opens them (grants.py)."""
    paths = tuple(paths)
    if len(paths) > MAX_GRANTS:
        raise RequestError(f"{len(paths)} paths; at most {MAX_GRANTS} are allowed", field=field)
    return tuple(_absolute(field, path) for path in paths) or None


def _network(request: pb.RunJobRequest) -> bool | tuple[str, ...] | None:
    """``network`` and its destinations as a request's ``allow_network``: True without any (what the
    ceiling allows, as for a client older than the destinations); the policy parses and bounds them."""
    destinations = tuple(request.network_destinations)
    if not request.network:
        if destinations:
            raise RequestError("destinations without network = true", field="network_destinations")
        return None
    return destinations or True


def _lowered(message: Message, field: str, allowed: int, most: int) -> int:
    """What ``allowed`` becomes when the request asks for less; a limit past ``most`` is refused."""
    asked = _optional_int(message, field, 0, most)
    return allowed if asked is None else min(allowed, asked)


def _optional_int(message: Message, field: str, low: int, high: int) -> int | None:
    if not message.HasField(field):
        return None
    value: int = getattr(message, field)
    if not low <= value <= high:
        raise RequestError(f"must be between {low} and {high}, got {value}", field=field)
    return value
