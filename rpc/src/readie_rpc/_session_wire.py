"""Hibernate and fork on the Interact stream: their answers, both ways (decision 0022)."""

from __future__ import annotations

from typing import Any

from ._proto.readie.v1 import worker_pb2 as pb
from ._status import on_the_wire
from readie_protocol.errors import ErrorType, PoolWorkerError, ReadieError, RequestError, SandboxSetupError, error_type

__all__ = [
    "MAX_KEY_CHARS", "MAX_REFUSAL_CHARS", "MAX_SESSION_IMAGE_MS", "attach_names", "forked_message", "hibernated_message",
    "milliseconds", "refusal", "refusal_fields", "session_key",
]

#: A hibernation, resume or fork a worker reports as taking longer is not believed: the
#: worker's own bounds (slot wait, runsc's command timeout, the socket wait) end it sooner.
MAX_SESSION_IMAGE_MS = 3_600_000.0

# A refusal's message is a sentence; a worker's megabyte of it is cut, not relayed.
MAX_REFUSAL_CHARS = 4096

#: A session key (decision 32) or a fork's token is 32 random bytes in URL-safe base64, 43
#: characters; room for a longer key some day, and nothing like a megabyte reaches a runner.
MAX_KEY_CHARS = 128
_KEY_ALPHABET = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_")


def attach_names(message: Any) -> tuple[str, str]:
    """What an ``attach`` names: ``("token", fork token)`` or ``("key", session key)``, each a
    short URL-safe base64 text; a RequestError (field ``attach``) for neither, both, or a text
    no worker makes (refused as an unknown one is, so its shape tells nothing more)."""
    named = [(kind, getattr(message, kind)) for kind in ("token", "key") if getattr(message, kind)]
    if len(named) != 1:
        raise RequestError("name a fork's token or a session's key, one of them", field="attach")
    kind, value = named[0]
    if len(value) > MAX_KEY_CHARS or not set(value) <= _KEY_ALPHABET:
        raise RequestError(f"no {'fork waits' if kind == 'token' else 'session is stored'} under this {kind}", field="attach")
    return kind, value


def session_key(answer: Any, field: str) -> str | None:
    """A worker's ``session_key`` (or a fork's ``key``) checked as :func:`attach_names` checks
    one coming in: None when unset; PoolWorkerError for a text no worker makes."""
    key: str = getattr(answer, field)
    if not key:
        return None
    if len(key) > MAX_KEY_CHARS or not set(key) <= _KEY_ALPHABET:
        raise PoolWorkerError(f"the worker answered a {field} no worker makes")
    return key


def hibernated_message(hibernate_ms: float = 0.0, refused: RequestError | SandboxSetupError | None = None) -> pb.SessionHibernated:
    """The answer to ``hibernate``: how long it took, or why the worker refused (the session goes on)."""
    if refused is None:
        return pb.SessionHibernated(hibernate_ms=hibernate_ms)
    return pb.SessionHibernated(**refusal_fields(refused))


def forked_message(fork_ms: float = 0.0, token: str = "", refused: RequestError | SandboxSetupError | None = None) -> pb.SessionForked:
    """The answer to ``fork``: its time and the token to attach to it, or why the worker refused."""
    if refused is None:
        return pb.SessionForked(fork_ms=fork_ms, token=token)
    return pb.SessionForked(**refusal_fields(refused))


def refusal_fields(refused: RequestError | SandboxSetupError, *, with_field: bool = False) -> dict[str, str]:
    """An answer's ``error_type`` and ``error_message`` for a refusal, and its ``error_field``
    (the answers to file requests carry one) named as the proto names it."""
    if isinstance(refused, RequestError):
        refused = on_the_wire(refused)
    fields = {"error_type": str(error_type(refused)), "error_message": str(refused)}
    if with_field:
        fields["error_field"] = getattr(refused, "field", None) or ""
    return fields


def refusal(answer: Any, field: str | None = "session") -> ReadieError | None:
    """The refusal an answer to ``hibernate``, ``fork`` or a file request carries, as the error
    the worker raised, a RequestError naming ``field``; None if it did what was asked. A type
    the worker should not refuse with is a PoolWorkerError."""
    if not answer.error_type:
        return None
    message = answer.error_message[:MAX_REFUSAL_CHARS]
    if answer.error_type == ErrorType.REQUEST:
        return RequestError(message.removeprefix(f"{field}: ") if field else message, field=field)
    if answer.error_type == ErrorType.SANDBOX_SETUP:
        return SandboxSetupError(message)
    return PoolWorkerError(f"the worker refused with {answer.error_type[:40]!r}: {message}")


def milliseconds(value: float, field: str) -> float:
    """A time a worker reports (``hibernate_ms``, ``fork_ms``, ``resumed_ms``), checked: a
    number from 0 to :data:`MAX_SESSION_IMAGE_MS`; PoolWorkerError for NaN, infinities, the rest."""
    if not 0.0 <= value <= MAX_SESSION_IMAGE_MS:  # False for NaN too
        raise PoolWorkerError(f"the worker reported {field} = {value!r}, not a time from 0 to {MAX_SESSION_IMAGE_MS:.0f} ms")
    return value
