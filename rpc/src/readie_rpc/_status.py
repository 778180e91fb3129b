"""readie's errors as gRPC status codes and back: the one place they are mapped.

Every RPC of the worker service runs inside :func:`grpc_errors`, which turns
whatever the call raised into a status through :func:`status_for`. Nothing
else in the service picks a status code. Every call to a worker runs inside
:func:`readie_errors`, which raises a failed call as the readie error its
status stands for (:func:`error_from_status`, the inverse); nothing else
catches ``grpc.RpcError``.

The mapping, and why:

==========================  ===================  =======================================
error                       status               why
==========================  ===================  =======================================
RequestError                INVALID_ARGUMENT     the request is wrong; retrying it as is
                                                 fails again. The field goes in the
                                                 details and in ``readie-field``.
DeadlineExpired,            DEADLINE_EXCEEDED    the caller's time ran out.
ExecutorTimeout
NotStarted                  UNAVAILABLE,         the server drains and refused the call
                            ``readie-unstarted``  before any of it ran: the one refusal a
                                                 client may send again as it is, here
                                                 later or to the next address, since it
                                                 provably did nothing (decision 32).
                                                 A call gRPC failed at the connect
                                                 (``never_sent``) comes back as this too.
SandboxSetupError           UNAVAILABLE          no sandbox to be had here (draining,
(draining, restore failed,                       restore failed): the same request may
manifest, checkpoint)                            well succeed on another worker or later,
                                                 and UNAVAILABLE is what clients retry.
ResponseTooLarge            RESOURCE_EXHAUSTED   what gRPC itself says of an oversized
                                                 message.
Cancelled                   CANCELLED            the caller went away before the work
                                                 started (the status is mostly for the log).
PoolWorkerError, any other  INTERNAL             the worker or the sandbox failed under
ReadieError                                      the call. Not UNAVAILABLE: a call that
                                                 crashes its sandbox would crash the next
                                                 one too, and clients must not retry it
                                                 blindly.
anything else               INTERNAL             a bug; the details name only its type,
                                                 the traceback goes to the log.
==========================  ===================  =======================================

A code job that fails (exception, timeout, crash under the job) is not an RPC
failure: the worker reports it in the response's ``error``, status OK.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass

import grpc
import structlog

from readie_protocol.errors import (
    Cancelled, ErrorType, PoolWorkerError, ReadieError, RequestError, SandboxSetupError, internal_error,
)
from readie_protocol.errors import ExecutorTimeout, NotStarted, mapped_errors

log = structlog.get_logger("readie.grpc")

# Trailing metadata on every failed call, so clients branch on a name, not on prose.
ERROR_METADATA_KEY = "readie-error"
FIELD_METADATA_KEY = "readie-field"
# On a call refused before any of it ran (NotStarted): a client may send it again as it is.
UNSTARTED_METADATA_KEY = "readie-unstarted"
_PRINTABLE_BUT_PERCENT = "".join(chr(c) for c in range(0x20, 0x7F) if chr(c) != "%")


class DeadlineExpired(ReadieError):
    """The caller's gRPC deadline left no time to run anything."""


class WorkerLost(PoolWorkerError):
    """A call ended without the worker's word: no readie status came back, so the connection or
    the worker process went away. It may have run. Unlike the worker's own PoolWorkerError (a
    job's sandbox failed, and the worker said so), it says something of the worker."""


class Unreachable(NotStarted):
    """The call never left this process: its connection was refused (``never_sent``). Nothing
    ran, as for any NotStarted; unlike a draining server's refusal, nobody answered at all."""


class ResponseTooLarge(ReadieError):
    """An answer is larger than the service may send."""


# Most specific first; the first isinstance match wins. Any other ReadieError is INTERNAL.
_STATUS_CODES: tuple[tuple[type[ReadieError], grpc.StatusCode], ...] = (
    (RequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (DeadlineExpired, grpc.StatusCode.DEADLINE_EXCEEDED),
    (ExecutorTimeout, grpc.StatusCode.DEADLINE_EXCEEDED),  # before PoolWorkerError, its base
    (SandboxSetupError, grpc.StatusCode.UNAVAILABLE),
    (ResponseTooLarge, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (Cancelled, grpc.StatusCode.CANCELLED),  # before PoolWorkerError, its base
    (PoolWorkerError, grpc.StatusCode.INTERNAL),
)


@dataclass(frozen=True)
class Status:
    code: grpc.StatusCode
    details: str
    metadata: tuple[tuple[str, str], ...]


# Fields the pool protocol (and so the policy module) names otherwise than the proto does.
_WIRE_NAMES = {"allow_network": "network", "timeout": "timeout_ms", "memory": "memory_bytes", "list": "list_files"}


def on_the_wire(error: RequestError) -> RequestError:
    """``error`` naming its field as the proto does (``step.timeout`` is ``step.timeout_ms``)."""
    if error.field is None:
        return error
    field = ".".join(_WIRE_NAMES.get(part, part) for part in error.field.split("."))
    return error if field == error.field else RequestError(error.reason, field=field)


def status_for(error: BaseException) -> Status:
    """The status (code, details, trailing metadata) a failed call ends with."""
    if isinstance(error, RequestError):
        error = on_the_wire(error)
    if not isinstance(error, ReadieError):
        # A bug: its message could hold anything, so only its type leaves the worker.
        return Status(grpc.StatusCode.INTERNAL, str(internal_error(error)), ((ERROR_METADATA_KEY, "InternalError"),))
    code = next((code for cls, code in _STATUS_CODES if isinstance(error, cls)), grpc.StatusCode.INTERNAL)
    # A worker lost under a router's call is, to the router's own client, the worker failing under
    # it: the documented PoolWorkerError (docs/deploy.md), not the router's name for how it knew.
    name = ErrorType.POOL_WORKER.value if isinstance(error, WorkerLost) else type(error).__name__
    metadata: tuple[tuple[str, str], ...] = ((ERROR_METADATA_KEY, name),)
    if isinstance(error, RequestError) and error.field:
        metadata += ((FIELD_METADATA_KEY, _metadata_text(error.field)),)
    if isinstance(error, NotStarted):
        metadata += ((UNSTARTED_METADATA_KEY, "1"),)
    # A RequestError's message already starts with its field.
    return Status(code, str(error), metadata)


def _metadata_text(text: str) -> str:
    """``text`` as a metadata value: gRPC allows printable ASCII only there, and a field's
    name can hold a request's own text (``env['¡']``); anything else is percent-encoded
    (UTF-8), so a plain field name reads as itself."""
    return urllib.parse.quote(text, safe=_PRINTABLE_BUT_PERCENT)


@contextmanager
def grpc_errors(context: grpc.ServicerContext) -> Iterator[None]:
    """Run an RPC's body; end the call with :func:`status_for` of anything it raises.

    The body must not call ``context.abort`` itself: abort works by raising,
    and that exception would be mapped to INTERNAL here.
    """
    try:
        yield
    except Exception as error:
        status = status_for(error)
        if not isinstance(error, ReadieError):
            log.error("rpc failed with an unexpected error", exc_info=True)
        context.set_trailing_metadata(status.metadata)
        context.abort(status.code, status.details)


def answered_by_readie(error: grpc.RpcError) -> bool:
    """Whether a failed call's status came from readie's code (:func:`grpc_errors`), not the transport."""
    return any(key == ERROR_METADATA_KEY for key, _ in error.trailing_metadata() or ())  # type: ignore[attr-defined]


# What gRPC core says of a call it failed while picking a connection, before any stream was
# opened (the channel is in TRANSIENT_FAILURE: the worker refused or did not answer the connect).
# Nothing of such a call left this process, so it is NotStarted, whatever the call was. A call that
# broke on an open connection says something else ("Socket closed", "Connection reset") and may
# have run.
_NEVER_SENT_DETAILS = "failed to connect to all addresses"


def never_sent(error: grpc.RpcError) -> bool:
    """Whether a failed call never left this process: refused at the connect, not by a worker."""
    code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
    return (code == grpc.StatusCode.UNAVAILABLE and not answered_by_readie(error)
            and details.startswith(_NEVER_SENT_DETAILS))


def readie_errors(unanswered: Callable[[grpc.RpcError], ReadieError] | None = None) -> AbstractContextManager[None]:
    """Make a call to a worker; raise its failure as readie's error (:func:`error_from_status`).

    ``unanswered`` makes the error of a call that failed before the worker's
    code answered it (the default: :func:`error_from_status` decides).
    """
    return mapped_errors({
        grpc.FutureCancelledError: lambda _: Cancelled("the call to the worker was cancelled"),
        grpc.RpcError: lambda error: error_from_status(error, unanswered),
    })


def error_from_status(error: grpc.RpcError, unanswered: Callable[[grpc.RpcError], ReadieError] | None = None) -> ReadieError:
    """The readie error a failed call to a worker stands for: the inverse of :func:`status_for`.

    A call that failed without readie's metadata never got an answer from the
    worker's code (connection reset, worker gone): ``unanswered`` makes its
    error when given. Without it, such a call may have run, so it is a
    PoolWorkerError and must not be retried blindly.
    """
    if never_sent(error):
        return Unreachable(f"the worker could not be reached: {error.details()}")  # type: ignore[attr-defined]
    if unanswered is not None and not answered_by_readie(error):
        return unanswered(error)
    metadata = dict(error.trailing_metadata() or ())  # type: ignore[attr-defined]
    kind = metadata.get(ERROR_METADATA_KEY)
    code, details = error.code(), error.details() or ""  # type: ignore[attr-defined]
    if kind == ErrorType.REQUEST:
        field = metadata.get(FIELD_METADATA_KEY)
        field = None if field is None else urllib.parse.unquote(field)
        prefix = f"{field}: "
        return RequestError(details.removeprefix(prefix) if field else details, field=field)
    if kind is not None and code == grpc.StatusCode.UNAVAILABLE and metadata.get(UNSTARTED_METADATA_KEY) == "1":
        return NotStarted(details)
    if kind is not None and code == grpc.StatusCode.UNAVAILABLE:
        return SandboxSetupError(details)  # refused before anything ran: another worker may take it
    if code == grpc.StatusCode.UNIMPLEMENTED:  # an older worker: the method never ran
        return SandboxSetupError(f"the worker does not implement this call (older protocol): {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return ExecutorTimeout(details or "deadline exceeded")
    lost = WorkerLost if kind is None else PoolWorkerError
    return lost(f"worker call failed ({code.name}): {details}")
