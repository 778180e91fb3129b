"""The pure half of a session and of a pool's answers: what goes on the wire, how an answer reads.

:class:`~readie.AsyncSession` and :class:`~readie.Session` (generated from it)
and both pools use these; only the waiting differs (the loop's, a thread's).
Also the answers a pool request can get, which both pools name.
"""

from __future__ import annotations

import secrets
from typing import Protocol, TypeVar

from readie_protocol.errors import ErrorType
from readie_protocol.requests import ForkSession, HibernateSession
from readie_protocol.transfers import ChunkEvent, ListingEvent, UploadedEvent
from readie_protocol.events import (
    AttachedEvent,
    CancelledEvent,
    ClosedEvent,
    ForkedEvent,
    HibernatedEvent,
    Result,
    StatsEvent,
)

from ._errors import PoolError, RequestError
from ._requests import RequestId

__all__ = [
    "Answer",
    "answered",
    "fork_name",
    "fork_request",
    "hibernate_request",
    "new_session_name",
    "raise_if_refused",
    "require_open",
]

#: What answers a request: its result, or the event it asked for.
Answer = (
    Result | StatsEvent | ClosedEvent | CancelledEvent | HibernatedEvent | ForkedEvent | AttachedEvent
    | UploadedEvent | ChunkEvent | ListingEvent
)

Event = TypeVar("Event", HibernatedEvent, ForkedEvent, AttachedEvent, UploadedEvent, ChunkEvent, ListingEvent)

_ASKED = {HibernatedEvent: "hibernate", ForkedEvent: "fork", AttachedEvent: "attach", UploadedEvent: "upload",
          ChunkEvent: "download", ListingEvent: "list"}


class _Tracked(Protocol):
    name: str
    _open: bool


def hibernate_request(id: RequestId, session: str) -> HibernateSession:
    return HibernateSession(id, session)


def new_session_name() -> str:
    return "session-" + secrets.token_hex(8)


def fork_name(name: str | None) -> str:
    """The name a fork gets: the caller's, else a new one as for a new session."""
    if name is None:
        return new_session_name()
    if not isinstance(name, str):
        raise TypeError(f"name: expected a str, got {type(name).__name__}")
    return name


def fork_request(id: RequestId, session: str, fork: str) -> ForkSession:
    return ForkSession(id, session, fork)


def raise_if_refused(result: Result) -> None:
    """A result whose error is ``RequestError`` means the pool refused the request and nothing ran:
    a bug in the caller, raised rather than returned so it is loud."""
    if result.error is not None and result.error.type == ErrorType.REQUEST:
        raise RequestError(result.error.message, result=result)


def require_open(session: _Tracked, what: str) -> None:
    """A fork, a download and a listing read the state the pool holds: with no step run yet (or
    after one that ended the session) there is none, and reading nothing is a mistake worth
    hearing about."""
    if not session._open:
        raise RequestError(f"session {session.name!r} is not open (no step has run since it began or ended): "
                           f"nothing to {what}", "session")


def answered(session: _Tracked, answer: Answer, kind: type[Event]) -> Event:
    """The event ``kind`` that answers a request about ``session`` (a hibernate, a fork, a file's
    chunk or listing); a refusal (a result) raises its error: RequestError and SandboxSetupError
    leave the session as it was, anything else (PoolWorkerError, with ``session_ended``) has
    ended it."""
    if isinstance(answer, Result):
        if answer.session_ended:
            session._open = False
        answer.raise_for_error()
        # An ok result is no answer to these requests: a pool that wrote one is broken.
        raise PoolError(f"readie pool answered {_ASKED[kind]} request {answer.id!r} with an ok result")
    if not isinstance(answer, kind):
        raise PoolError(f"readie pool answered {_ASKED[kind]} request {answer.id!r} with {type(answer).__name__}")
    return answer
