"""readie's error families and the error types results name: one hierarchy for every layer.

Both ends of every wire raise these classes: the worker and the pool engine
refuse and fail with them, the client raises them again from a result line
or a status. A result's ``error.type`` is either the job's Python exception
class or one of readie's own :class:`ErrorType` values; the table between
the families and those types is here, once: :func:`error_type` for the side
that reports an error and :func:`family_of` for the side that raises it
again. Layers add subclasses of their own (the client's ``RemoteError``),
never a second family; the three here are the ones more than one program
raises and the client catches: a bad configuration file
(:class:`ConfigError`, read by every command and by ``readie mcp``), an
executor that did not answer in time (:class:`ExecutorTimeout`, which a
remote call's status carries back) and work its caller gave up on
(:class:`Cancelled`, raised by the worker and mapped to a status by the
gRPC layer).

Where a layer meets a library that fails in its own terms (a socket, runsc,
gRPC), :func:`mapped_errors` turns those failures into these classes, from
a table written once per boundary (decision 0028).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from enum import StrEnum
from typing import Any

__all__ = [
    "MAX_SHOWN_CHARS",
    "Cancelled",
    "ConfigError",
    "ErrorMap",
    "ErrorType",
    "ExecutorTimeout",
    "NotStarted",
    "PoolError",
    "PoolWorkerError",
    "ReadieError",
    "RequestError",
    "SandboxSetupError",
    "StepLost",
    "UnitError",
    "VersionMismatch",
    "error_type",
    "family_of",
    "internal_error",
    "mapped_errors",
    "shown",
]


class ReadieError(Exception):
    """Base of every error readie raises on purpose."""


class RequestError(ReadieError):
    """A request was refused before anything ran.

    ``field`` names the request field at fault when there is one (dotted for
    nested values, e.g. ``reply.call_id``); the message then starts with it,
    so a client that only shows the message still learns which field.
    ``result`` is the result line that carried the refusal, when one did (a
    client raising it again from a pool's answer: a
    :class:`readie_protocol.results.Result`); None when raised at once. It is
    typed loosely because the result module is above this one: a result
    raises these errors again, so this module cannot name it.
    """

    def __init__(self, message: str, field: str | None = None, *, result: Any = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message
        self.result = result


class SandboxSetupError(ReadieError):
    """A sandbox could not be made ready: restore, cold start, mounts, socket."""


class PoolWorkerError(ReadieError):
    """The worker (or the sandbox under a job) failed in a way that is not the job's doing."""


class ExecutorTimeout(PoolWorkerError):
    """The executor did not answer within the call's deadline."""


class NotStarted(SandboxSetupError):
    """Refused before any of the work ran (decision 32): a draining server or worker. Unlike a
    failure that may have run, it can be sent again as it is (``WorkerClient`` does, to its next
    address), and a session step refused so leaves its session as it was."""


class StepLost(PoolWorkerError):
    """The worker running a session's step was lost while it ran (decision 32): the step may have
    run in part, so it is never run again; the session is not ended, and its next step resumes
    from the last state the store holds. On the wire: PoolWorkerError with ``"lost": true``."""


class Cancelled(PoolWorkerError):
    """The caller gave up (a cancelled call, a passed deadline) before the work could start."""


def internal_error(exc: BaseException) -> PoolWorkerError:
    """What a client reads of a bug: its type only, since its text could hold anything (host
    paths among it); the caller logs the traceback."""
    return PoolWorkerError(f"internal error ({type(exc).__name__})")


class PoolError(ReadieError):
    """The ``readie pool`` process failed: it did not start, it exited, or it broke the protocol.

    A client's message ends with the last lines the pool wrote on stderr.
    """


class VersionMismatch(ReadieError):
    """The two ends of a wire speak different versions; the message names both."""


class ConfigError(ReadieError):
    """A TOML configuration (``readie.toml``) is unusable; names the file, the key and the reason."""

    def __init__(self, path: str, key: str | None, reason: str) -> None:
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.key = key
        self.reason = reason


class UnitError(ReadieError, ValueError):
    """A size or duration could not be parsed; callers re-raise it naming the field or key."""


class ErrorType(StrEnum):
    """The error types that are readie's own, not a Python exception of the job.

    The values are the pool protocol's and the in-sandbox JSON's ``error.type``
    strings (the executor writes the same names with the standard library
    only; a test holds them to this set). ``TimeoutError`` is also a Python
    builtin: a job's own TimeoutError is told apart by the result's outcome.
    """

    REQUEST = "RequestError"
    TIMEOUT = "TimeoutError"
    SIGNAL = "SignalError"
    SANDBOX_SETUP = "SandboxSetupError"
    POOL_WORKER = "PoolWorkerError"


# Most specific first; the first isinstance match wins.
_TYPE_OF_FAMILY: tuple[tuple[type[BaseException], ErrorType], ...] = (
    (RequestError, ErrorType.REQUEST),
    (UnitError, ErrorType.REQUEST),
    (SandboxSetupError, ErrorType.SANDBOX_SETUP),
    (PoolWorkerError, ErrorType.POOL_WORKER),
)

# The families a client raises again for a result's error type; the others
# (a timeout, a signal, the job's exceptions) are the job's outcome.
_FAMILY_OF_TYPE: dict[str, type[ReadieError]] = {
    ErrorType.REQUEST: RequestError,
    ErrorType.SANDBOX_SETUP: SandboxSetupError,
    ErrorType.POOL_WORKER: PoolWorkerError,
}


def error_type(exc: BaseException) -> ErrorType:
    """The result ``error.type`` for an error readie raised.

    Anything not in the table (``ConfigError`` at run time, an unexpected bug)
    is ``PoolWorkerError``: the job failed because of the pool, not because of
    the request or the job's own code.
    """
    for cls, kind in _TYPE_OF_FAMILY:
        if isinstance(exc, cls):
            return kind
    return ErrorType.POOL_WORKER


def family_of(kind: str) -> type[ReadieError] | None:
    """The exception family a result's ``error.type`` stands for; None for the job's own errors."""
    return _FAMILY_OF_TYPE.get(kind)


#: Error messages quote the value at fault, cut to this many characters: a
#: megabyte-long "timeout" must not come back as a megabyte-long error.
MAX_SHOWN_CHARS = 64


def shown(text: str) -> str:
    """``text`` quoted for an error message, cut to :data:`MAX_SHOWN_CHARS`."""
    if len(text) <= MAX_SHOWN_CHARS:
        return repr(text)
    return repr(text[:MAX_SHOWN_CHARS]) + f"... ({len(text)} characters)"


#: A boundary's failures and the readie error each one is: an exception type
#: (or a tuple of them) to what makes the error of it. Most specific first.
ErrorMap = Mapping[type[Exception] | tuple[type[Exception], ...], Callable[[Any], ReadieError]]


@contextmanager
def mapped_errors(table: ErrorMap) -> Iterator[None]:
    """Run the body; raise what it raises as the readie error ``table`` makes of it.

    The first entry whose type the exception is wins; anything the table
    does not name leaves unchanged. The library's exception is not chained
    (``from None``): its text may name host paths, and the readie error's
    message already says what failed.
    """
    try:
        yield
    except Exception as exc:
        for failure, error in table.items():
            if isinstance(exc, failure):
                raise error(exc) from None
        raise
