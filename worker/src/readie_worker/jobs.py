"""Code jobs on the worker side: grants onto mount slots, the call, the hostile result.

A job runs in a sandbox through ``readie_executor.jobs.run_job``, pickled here
as a reference (the trusted side pickles; it never unpickles). The answer is
JSON that the job itself could have forged, so it goes through
:func:`parse_job_result` before anything reads it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import cloudpickle

from readie_executor.jobs import run_job

from ._job_result import JobError, JobResult, JobResultInvalid, max_result_bytes, parse_job_result
from .bundle import MountPlan
from .errors import PoolWorkerError, RequestError
from .sandbox import ExecutorTimeout, Sandbox

# What every job's environment starts from; the request's env goes on top.
# Nothing of the worker's own environment is ever copied in.
BASE_JOB_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8"}
# The pool spec's default cap on captured stdout and stderr, each.
DEFAULT_MAX_OUTPUT = 1024 * 1024
DEFAULT_TIMEOUT_MS = 30_000
MEMORY_BACKSTOP_HINT = (
    "the whole sandbox exceeded the worker's memory backstop (cgroup); "
    "set a lower 'memory' limit so the job gets a MemoryError instead"
)


@dataclass(frozen=True)
class CodeJob:
    """One job as the worker runs it: validated, paths absolute, limits resolved."""

    checkpoint: str
    code: str
    name: str = "<string>"
    args: tuple[str, ...] = ()
    env: Mapping[str, str] = field(default_factory=dict)
    cwd: str = "/tmp"
    allow_read: tuple[str, ...] = ()
    allow_write: tuple[str, ...] = ()
    package_dirs: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()  # requirements, installed on the worker host and mounted
    network: bool = False
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    memory_bytes: int | None = None
    max_output: int = DEFAULT_MAX_OUTPUT
    max_file_size: int | None = None
    # Host functions the code may call through readie_host (the sessions and
    # host functions issue); empty means readie_host offers nothing.
    functions: tuple[str, ...] = ()

    @property
    def needs_own_mounts(self) -> bool:
        """Grants and packages are mount sources, fixed at restore: no warm sandbox has them."""
        return bool(self.allow_read or self.allow_write or self.package_dirs or self.packages)


@dataclass(frozen=True)
class MountedGrants:
    sources: Mapping[PurePosixPath, Path]
    links: tuple[Mapping[str, object], ...]


@dataclass(frozen=True)
class JobOutcome:
    """What a job came to: its own result, or the worker's account of why there is none."""

    exit: int | None  # None when the job did not end on its own (timeout, crash, refusal)
    stdout: str
    stderr: str
    stdout_truncated: bool
    stderr_truncated: bool
    error: JobError | None
    duration_us: int  # the worker's clock around the call, not the job's claim
    python: str
    preloaded_modules: tuple[str, ...]
    sandbox_id: str | None
    backend: str

    @classmethod
    def failure(cls, error_type: str, message: str, duration_us: int, backend: str,
                sandbox_id: str | None = None, hint: str | None = None) -> JobOutcome:
        return cls(None, "", "", False, False, JobError(error_type, message, None, None, hint),
                   duration_us, "", (), sandbox_id, backend)


def mount_grants(job: CodeJob, plan: MountPlan) -> MountedGrants:
    """Map grants and package dirs onto the slots planned at capture, or refuse naming the limit."""
    sources: dict[PurePosixPath, Path] = {}
    links: list[Mapping[str, object]] = []
    for field_name, paths, slots, slot_of, writable in (
        ("allow_read", job.allow_read, plan.read_slots, plan.read_slot, False),
        ("allow_write", job.allow_write, plan.write_slots, plan.write_slot, True),
        ("package_dirs", job.package_dirs, plan.package_slots, plan.package_slot, False),
    ):
        if len(paths) > slots:
            raise RequestError(
                f"{len(paths)} paths asked for, but sandboxes have {slots} such slots "
                f"(planned at capture: [mounts] in checkpoints.toml)",
                field=field_name,
            )
        for index, raw in enumerate(paths):
            host = Path(raw)
            if not host.is_absolute():
                raise RequestError(f"{raw!r} is not an absolute path", field=field_name)
            if not host.is_dir():
                raise RequestError(f"{raw!r} is not an existing directory", field=field_name)
            slot = slot_of(index)
            sources[slot] = host
            if field_name != "package_dirs":  # packages are on sys.path already; grants appear at their host path
                links.append({"path": str(host), "target": str(slot), "writable": writable})
    return MountedGrants(sources, tuple(links))


def job_request(job: CodeJob, links: tuple[Mapping[str, object], ...], session: bool = False) -> bytes:
    """The pickled call: a reference to the trusted runner, and plain data.

    ``session``: run in the sandbox's persistent ``__main__`` (a notebook
    step) instead of a fresh namespace.
    """
    spec = {
        "code": job.code,
        "name": job.name,
        "args": list(job.args),
        "env": {**BASE_JOB_ENV, **job.env},
        "cwd": job.cwd,
        "links": [dict(link) for link in links],
        "limits": {
            "memory_bytes": job.memory_bytes,
            "max_file_size": job.max_file_size,
            "max_output": job.max_output,
            "subprocesses": False,
        },
        "session": session,
    }
    return cloudpickle.dumps({"func": run_job, "args": (spec,), "kwargs": {}})


def run_in_sandbox(sandbox: Sandbox, job: CodeJob, links: tuple[Mapping[str, object], ...]) -> JobOutcome:
    """Run ``job`` in ``sandbox`` until it answers or its deadline passes.

    The caller destroys the sandbox afterwards: a timed-out or crashed one is
    never reused, and by default neither is a healthy one.
    """
    backend = f"gvisor:{sandbox.launcher.name}" if sandbox.launcher.isolated else sandbox.launcher.name
    request = job_request(job, links)
    started = time.monotonic()
    try:
        raw = sandbox.call(request, timeout=job.timeout_ms / 1000, max_response=max_result_bytes(job.max_output))
    except ExecutorTimeout:
        sandbox.destroy()  # the deadline kills the sandbox, whatever the job is doing
        return JobOutcome.failure(
            "TimeoutError", f"job exceeded its timeout of {job.timeout_ms} ms", _since(started), backend, sandbox.id
        )
    except PoolWorkerError as exc:
        if sandbox.oom_killed():
            return JobOutcome.failure(
                "MemoryError",
                "the sandbox ran out of memory and was killed",
                _since(started),
                backend,
                sandbox.id,
                hint=MEMORY_BACKSTOP_HINT,
            )
        return JobOutcome.failure("PoolWorkerError", f"the sandbox failed under the job: {exc}", _since(started), backend, sandbox.id)
    elapsed = _since(started)
    try:
        result = parse_job_result(raw, job.max_output)
    except JobResultInvalid as exc:
        return JobOutcome.failure("PoolWorkerError", f"the sandbox answered with an invalid result: {exc}", elapsed, backend, sandbox.id)
    return _from_result(result, elapsed, backend, sandbox.id)


def _from_result(result: JobResult, duration_us: int, backend: str, sandbox_id: str) -> JobOutcome:
    return JobOutcome(
        exit=result.exit,
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
    )


def _since(started: float) -> int:
    return int((time.monotonic() - started) * 1_000_000)
