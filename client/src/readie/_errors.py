"""The client's errors: readie's one hierarchy, plus what only a client can see.

The families (:class:`ReadieError`, :class:`RequestError`,
:class:`SandboxSetupError`, :class:`PoolWorkerError`) and the pool
protocol's :class:`PoolError` and :class:`VersionMismatch` are
``readie_protocol.errors``'s (:class:`JobError`, the error a result raises,
is ``readie_protocol.results``'s), the classes the worker
and the pool raise too, so one ``except`` covers a local pool and a remote
router alike. A :class:`RequestError` raised again from a pool's answer
carries that result line (``result``).

What a job does (an exception, a non-zero exit, a timeout) is not an error
of the client: :meth:`Pool.run` returns it as a :class:`~readie.Result`, and
:meth:`Result.raise_for_error` turns it into :class:`JobError` on request. A
remote function that raises is the exception: :class:`RemoteError`.
"""

from __future__ import annotations

from readie_protocol.errors import (
    PoolError,
    PoolWorkerError,
    ReadieError,
    RequestError,
    SandboxSetupError,
    VersionMismatch,
)
from readie_protocol.results import JobError

__all__ = [
    "CallTimeout",
    "EnvelopeError",
    "FileChanged",
    "JobError",
    "PoolError",
    "PoolWorkerError",
    "ReadieError",
    "RemoteError",
    "RequestError",
    "SandboxSetupError",
    "VersionMismatch",
    "WaitTimeout",
]


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


class FileChanged(ReadieError):
    """A file changed while it was moved: a download whose chunks disagree on the file's size or
    modification time, or a local file that grew or shrank while it was uploaded. Nothing of the
    two versions is joined: a download to a local file leaves no file behind, an upload leaves the
    session's copy partly written (upload it again)."""


class WaitTimeout(ReadieError, TimeoutError):
    """A ``run`` gave up waiting at its ``wait_timeout``: the job was cancelled (its sandbox freed),
    and what it did until then is lost to the caller (its output events included)."""


class CallTimeout(PoolWorkerError):
    """A remote call did not finish within its timeout; the sandbox was destroyed, it may have had effects."""
