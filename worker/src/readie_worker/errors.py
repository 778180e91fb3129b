"""The worker's errors: readie's families (``readie_protocol.errors``) and the worker's own subclasses.

The families, the error types results name and the table between them are
``readie_protocol``'s, re-exported here so worker code has one place to
import from. The gRPC status mapping is the other edge, in
``readie_rpc._status``. A failure of the host under the worker (a socket, a
file, a runsc process) becomes one of these through :func:`host_failure`,
or through a table of its own given to :func:`mapped_errors` where one call
fails in several ways (a sandbox's exchange).

What a client reads carries no host facts: no host path, command line or
host process id (issue 27). readie's own errors are built without them; the
facts a failure comes with (runsc's command line and stderr, a sandbox's
last words, an OSError's file name) go to the worker's log through
:func:`log_host_facts`, next to the ids :func:`bound_ids` put in the log
context, and the client's error names those ids instead. :func:`for_client`
is what a client may read of any exception.
"""

from __future__ import annotations

import contextlib
import functools
import subprocess
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from typing import ParamSpec, TypeVar

import structlog
from readie_protocol.errors import (
    MAX_SHOWN_CHARS,
    Cancelled,
    ConfigError,
    ErrorMap,
    ErrorType,
    ExecutorTimeout,
    PoolWorkerError,
    ReadieError,
    RequestError,
    SandboxSetupError,
    UnitError,
    error_type,
    family_of,
    internal_error,
    mapped_errors,
    shown,
)

__all__ = [
    "MAX_SHOWN_CHARS",
    "Cancelled",
    "CheckpointUnusable",
    "ConfigError",
    "ErrorMap",
    "ErrorType",
    "ExecutorTimeout",
    "ManifestError",
    "PoolWorkerError",
    "ReadieError",
    "RequestError",
    "SandboxSetupError",
    "UnitError",
    "bound_ids",
    "error_type",
    "family_of",
    "for_client",
    "host_failure",
    "internal_error",
    "log_host_facts",
    "logged_under_its_id",
    "mapped_errors",
    "shown",
]


log = structlog.get_logger("readie.worker")

# Keys of the log context that name what a client asked for, and how its error names them.
_CLIENT_IDS = (("session", "session"), ("job_id", "job"))
_P = ParamSpec("_P")
_R = TypeVar("_R")


def logged_under_its_id(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method`` of a session (anything with an ``id``), run with the session's id (and a step's
    ``job_id``) in the log context: what fails under it is logged next to them, and a client's
    error names them."""

    @functools.wraps(method)
    def bound(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        session_id = getattr(args[0], "id")
        job_id = kwargs.get("job_id")
        with bound_ids(session=session_id, job_id=job_id if isinstance(job_id, str) else None):
            return method(*args, **kwargs)

    return bound


@contextlib.contextmanager
def bound_ids(*, session: str | None = None, job_id: str | None = None) -> Iterator[None]:
    """Bind the session's or job's id (None: none known) to this thread's log context: every
    line logged under it carries them, and :func:`log_host_facts` names them to the client.

    Put back by their tokens: structlog's ``bound_contextvars`` first copies and walks the whole
    context to save what it replaces, on every job and step. Tokens go back in the context that
    set them: use it around synchronous code in one thread (a ``with``), never across an await
    or a generator's yield."""
    ids = {key: value for key, value in (("session", session), ("job_id", job_id)) if value is not None}
    tokens = structlog.contextvars.bind_contextvars(**ids)
    try:
        yield
    finally:
        structlog.contextvars.reset_contextvars(**tokens)


def log_host_facts(event: str, *, level: str = "warning", **facts: object) -> str:
    """Log ``facts`` only the host's operator may read (host paths, command lines, pids, a host
    process's output) as ``event``, with the ids bound to this context; return what a client's
    error says instead: where those lines are."""
    getattr(log, level)(event, **facts)
    context = structlog.contextvars.get_contextvars()
    named = " and ".join(f"{label} {context[key]}" for key, label in _CLIENT_IDS if context.get(key))
    return "the worker's log has the details" + (f" under {named}" if named else "")


def for_client(exc: BaseException) -> str:
    """What a client may read of ``exc``: a readie error's own message (built without host
    facts); of anything else its kind only (an OSError's text names host files), the rest logged."""
    if isinstance(exc, ReadieError):
        return str(exc)
    kind = exc.strerror if isinstance(exc, OSError) and exc.strerror else type(exc).__name__
    return f"{kind}; {log_host_facts('host error', error=f'{type(exc).__name__}: {exc}')}"


def host_failure(
    family: type[ReadieError],
    what: str,
    caught: type[Exception] | tuple[type[Exception], ...] = OSError,
) -> AbstractContextManager[None]:
    """Run the body; raise a failure of the host under it (an OSError: a socket, a file, a
    process that would not start) as ``family`` saying ``what`` failed and the host's reason."""
    return mapped_errors({caught: lambda exc: family(f"{what}: {host_reason(exc)}")})


def host_reason(exc: BaseException) -> str:
    """What a client may read of a host failure: its text, but of an OSError about a file (a
    host path) or a command that timed out (its command line) only the kind."""
    if isinstance(exc, OSError) and exc.filename is not None and exc.strerror:
        return exc.strerror
    if isinstance(exc, subprocess.TimeoutExpired):
        return f"timed out after {exc.timeout:g} s"
    return str(exc)


class ManifestError(SandboxSetupError):
    """The checkpoint manifest cannot be trusted as a whole."""


class CheckpointUnusable(SandboxSetupError):
    """One checkpoint of an otherwise good manifest cannot be used (missing or corrupt image)."""
