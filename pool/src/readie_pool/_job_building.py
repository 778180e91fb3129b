"""From a parsed request to the :class:`CodeJob` a backend runs: policy, script, cwd, limits.

Everything here decides what a job is granted, before it waits for a slot,
and raises :class:`RequestError` for what the request may not have. The
engine (``_engine``) and the session driver (``_session_driver``) both build
their first job here, so a job and a session's first step are granted alike.
"""

from __future__ import annotations

import asyncio
import importlib.util
from pathlib import Path

from readie_worker.errors import RequestError
from readie_worker.jobs import DEFAULT_INLINE_NAME, CodeJob, Step
from readie_worker.paths import PathRefused, read_no_follow
from readie_policy.policy import Policy, check_step, resolve_policy, resolve_script

from readie_protocol.requests import MAX_NAME_CHARS, JobRequest
from ._setup import PoolSetup

__all__ = [
    "FALLBACK_CWD",
    "MAX_SCRIPT_BYTES",
    "code_job",
    "code_job_now",
    "job_cwd",
    "later_step",
    "read_script",
    "request_policy",
]

#: A script is read whole into the pool and sent as the job's code; every
#: queued job may hold one. 16 MiB is far beyond hand-written code and keeps
#: a queue of 2 x workers bounded. (Inline code is bounded by the 1 MiB line.)
MAX_SCRIPT_BYTES = 16 * 1024 * 1024
#: Working directory of a job that cannot see the pool's (see :func:`job_cwd`):
#: the sandbox's own /tmp, which is also the job's HOME.
FALLBACK_CWD = "/tmp"


def request_policy(setup: PoolSetup, request: JobRequest) -> Policy:
    """The policy ``request`` runs under: its fields, its profile and the operator's ceiling."""
    return resolve_policy(
        request,
        cwd=setup.cwd,
        limits=setup.config.limits,
        profiles=setup.config.profile_map,
        protected=setup.package_dirs,
    )


def script_name(written: str) -> str:
    """A script job's name: the path the request wrote, as python3 shows the path it was given.

    A name is at most ``MAX_NAME_CHARS`` on every path (a router's gRPC parser holds a job's name
    to it), and a path may be longer: such a path is named by its end, the part a traceback needs.
    """
    if len(written) <= MAX_NAME_CHARS:
        return written
    return "…" + written[-(MAX_NAME_CHARS - 1):]


async def code_job(setup: PoolSetup, request: JobRequest) -> CodeJob:
    """The job for ``request`` under its policy (:func:`request_policy`), one value from here to the
    worker and to the result line's ``policy``; a script is read here, without following links."""
    policy = request_policy(setup, request)
    script = resolve_script(request, cwd=setup.cwd, limits=setup.config.limits)
    if script is not None:
        code = await asyncio.to_thread(read_script, script, str(request.script))
        return _job(setup, request, policy, code, request.name or script_name(str(request.script)))
    return _job(setup, request, policy, request.code or "", request.name or DEFAULT_INLINE_NAME)


def code_job_now(setup: PoolSetup, request: JobRequest) -> CodeJob | None:
    """:func:`code_job` without waiting, for a request with inline code; None for one naming a script
    (read off the loop: :func:`code_job`)."""
    if request.script is not None:
        return None
    return _job(setup, request, request_policy(setup, request), request.code or "", request.name or DEFAULT_INLINE_NAME)


def later_step(setup: PoolSetup, session_job: CodeJob, request: JobRequest) -> tuple[Step, CodeJob]:
    """A session's later step from ``request`` (checked against the pool's limits), and the job it
    runs and its result reports: the session's job (``session_job``) with the step's fields."""
    check_step(request.timeout_ms, request.max_output, setup.config.limits)
    step = Step(
        code=request.code or "",
        name=request.name or DEFAULT_INLINE_NAME,
        args=request.args,
        # As the request set them: the session's job fills the rest (CodeJob.step).
        timeout_ms=request.timeout_ms,
        max_output=request.max_output,
        report_files=request.report_files,
        files=request.files,
        collect=request.collect,
    )
    return step, session_job.step(step)


def _job(setup: PoolSetup, request: JobRequest, policy: Policy, code: str, name: str) -> CodeJob:
    return CodeJob.under(
        policy,
        checkpoint=setup.checkpoint,
        code=code,
        name=name,
        args=request.args,
        cwd=job_cwd(setup.cwd, policy),
        packages=request.packages or (),
        functions=request.functions or (),
        report_files=request.report_files,
        files=request.files,
        collect=request.collect,
        pool_package_dirs=setup.package_dirs,
    )


def job_cwd(cwd: Path, policy: Policy) -> str:
    """The pool's working directory when the job can see it, else :data:`FALLBACK_CWD`.

    Inside the sandbox a grant appears at its host path, and the directories
    above it are created on the way (empty but for the grant). So the pool's
    directory exists there exactly when a grant lies beneath it (or it lies
    beneath a grant), and then relative paths in the code mean what the
    request's relative grants meant. A job with no grant there sees nothing
    of the pool's directory anyway.
    """
    for grant in (*policy.allow_read, *policy.allow_write):
        if grant.is_relative_to(cwd) or cwd.is_relative_to(grant):
            return str(cwd)
    return FALLBACK_CWD


def read_script(path: Path, shown: str) -> str:
    """The source of a script the pool runs, or RequestError naming ``script`` and quoting
    ``shown`` (the path as the request wrote it).

    Opened without following a symlink anywhere along the path and read from
    that descriptor (``readie_worker.paths``), so a job that swaps the file
    for a link after the check cannot make the pool read another file; a
    FIFO or a device is refused before it is opened for reading. Decoded as
    python3 would (a BOM or a coding cookie, else UTF-8).
    """
    try:
        source = read_no_follow(str(path), MAX_SCRIPT_BYTES)
    except PathRefused as refused:
        raise RequestError(f"{shown!r} {refused.reason}", "script") from None
    try:
        return importlib.util.decode_source(source)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise RequestError(f"{shown!r} is not readable as Python source: {exc}", "script") from None

