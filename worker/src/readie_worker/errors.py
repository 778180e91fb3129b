"""The worker's errors: readie's families (``readie_protocol.errors``) and the worker's own subclasses.

The families, the error types results name and the table between them are
``readie_protocol``'s, re-exported here so worker code has one place to
import from. The gRPC status mapping is the other edge, in ``_status``.

What a client reads carries no host facts: no host path, command line or
host process id (issue 27). readie's own errors are built without them; the
facts a failure comes with (runsc's command line and stderr, a sandbox's
last words, an OSError's file name) go to the worker's log through
:func:`log_host_facts`, next to the ids :func:`bound_ids` put in the log
context, and the client's error names those ids instead. :func:`for_client`
is what a client may read of any exception.
"""

from __future__ import annotations

from contextlib import AbstractContextManager

import structlog
from readie_protocol.errors import (
    MAX_SHOWN_CHARS,
    Cancelled,
    ConfigError,
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
    shown,
)

__all__ = [
    "MAX_SHOWN_CHARS",
    "Cancelled",
    "CheckpointUnusable",
    "ConfigError",
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
    "internal_error",
    "log_host_facts",
    "shown",
]


log = structlog.get_logger("readie.worker")

# Keys of the log context that name what a client asked for, and how its error names them.
_CLIENT_IDS = (("session", "session"), ("job_id", "job"))


def bound_ids(*, session: str | None = None, job_id: str | None = None) -> AbstractContextManager[object]:
    """Bind the session's or job's id (None: none known) to this thread's log context: every
    line logged under it carries them, and :func:`log_host_facts` names them to the client."""
    ids = {key: value for key, value in (("session", session), ("job_id", job_id)) if value is not None}
    return structlog.contextvars.bound_contextvars(**ids)


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


class ManifestError(SandboxSetupError):
    """The checkpoint manifest cannot be trusted as a whole."""


class CheckpointUnusable(SandboxSetupError):
    """One checkpoint of an otherwise good manifest cannot be used (missing or corrupt image)."""
