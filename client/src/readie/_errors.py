"""The client's errors: readie's one hierarchy, plus what only a client can see.

The families (:class:`ReadieError`, :class:`SandboxSetupError`,
:class:`PoolWorkerError`) are the worker's own classes, so one ``except``
covers a local pool and a remote router alike. :class:`RequestError` is a
subclass of the worker's that may carry the pool's result line.

What a job does (an exception, a non-zero exit, a timeout) is not an error
of the client: :meth:`Pool.run` returns it as a :class:`~readie.Result`, and
:meth:`Result.raise_for_error` turns it into :class:`JobError` on request. A
remote function that raises is the exception: :class:`RemoteError`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from readie_worker.errors import PoolWorkerError, ReadieError, SandboxSetupError
from readie_worker.errors import RequestError as _WorkerRequestError

if TYPE_CHECKING:
    from ._results import Result

__all__ = [
    "CallTimeout",
    "EnvelopeError",
    "JobError",
    "PoolError",
    "PoolWorkerError",
    "ReadieError",
    "RemoteError",
    "RequestError",
    "SandboxSetupError",
    "VersionMismatch",
]


class RequestError(_WorkerRequestError):
    """A request was refused before anything ran: by this client, by the pool or by a router.

    ``result`` is the pool's result line for the refusal (``None`` when the
    client or a router refused). ``field`` names the request field at fault
    when the refuser said which.
    """

    def __init__(self, message: str, field: str | None = None, *, result: Result | None = None) -> None:
        super().__init__(message, field)
        self.result = result


class PoolError(ReadieError):
    """The ``readie pool`` process failed: it did not start, it exited, or it broke the protocol.

    The message ends with the last lines the pool wrote on stderr.
    """


class VersionMismatch(ReadieError):
    """The two ends of a wire speak different versions; the message names both."""


class JobError(ReadieError):
    """Raised by :meth:`Result.raise_for_error` for a job whose code failed (exception, exit, timeout)."""

    def __init__(self, result: Result) -> None:
        error = result.error
        if error is None:
            text = f"job {result.id!r} exited with status {result.exit}"
        else:
            where = f" ({error.file}, line {error.line})" if error.file and error.line else ""
            text = f"job {result.id!r} failed: {error.type}: {error.message}{where}"
        super().__init__(text)
        self.result = result


class RemoteError(ReadieError):
    """A remote function raised; ``exc_type``, ``message`` and ``traceback`` are the sandbox's words.

    The exception itself is not re-created here: its class may not exist on
    this side, and building arbitrary classes from a sandbox's answer is what
    the envelope's plain fields avoid. ``output`` is what the call printed.
    """

    def __init__(self, exc_type: str, message: str, traceback: str, output: tuple[str, ...] = ()) -> None:
        text = f"{exc_type}: {message}"
        if traceback:
            text += f"\n\nRemote traceback (from the sandbox):\n{traceback.rstrip()}"
        super().__init__(text)
        self.exc_type = exc_type
        self.message = message
        self.traceback = traceback
        self.output = output


class EnvelopeError(ReadieError):
    """A remote call's answer could not be decoded here (not an envelope, or its value cannot be loaded)."""


class CallTimeout(PoolWorkerError):
    """A remote call did not finish within its timeout; the sandbox was destroyed, it may have had effects."""
