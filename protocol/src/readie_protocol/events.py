"""The pool protocol's lines as frozen values, for both ends: the ready event, job
results (``readie_protocol.results``, re-exported here), the stats, closed,
cancelled, call and output events.

The pool builds these and writes ``to_json()``; a client parses a line with
``parse_result`` and the like (:class:`~readie_protocol.connection.PoolConnection`
does both). Parsing is strict (a wrong type is a
:class:`PoolError`: the pool broke the protocol) but forward-compatible:
fields this side does not know are ignored, since adding a field does not
bump the protocol version. The version itself is checked once, on the ready
event. Field order in ``to_json`` is the spec's: lines are compared byte for
byte by the conformance suite.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from readie_executor import hostwire

from ._fields import Fields, broken, short
from .errors import VersionMismatch
from .network import MAX_REFUSED_NAMES, MAX_REFUSED_REPORTED, NetworkReport, RefusedConnection
from .results import RUNTIME_NAME, ErrorInfo, FileInfo, PolicyInfo, Result, RuntimeInfo, Value, parse_result
from .wire import PROTOCOL_VERSION, RequestId

__all__ = [
    "MAX_REFUSED_NAMES",
    "MAX_REFUSED_REPORTED",
    "RUNTIME_NAME",
    "AttachedEvent",
    "CallEvent",
    "CancelledEvent",
    "ClosedEvent",
    "ErrorInfo",
    "ForkedEvent",
    "HibernatedEvent",
    "FileInfo",
    "NetworkReport",
    "OutputEvent",
    "PolicyInfo",
    "ReadyEvent",
    "RefusedConnection",
    "Result",
    "RuntimeInfo",
    "StatsEvent",
    "Value",
    "parse_attached",
    "parse_call",
    "parse_cancelled",
    "parse_closed",
    "parse_forked",
    "parse_hibernated",
    "parse_output",
    "parse_ready",
    "parse_result",
    "parse_stats",
]

@dataclass(frozen=True, slots=True)
class ReadyEvent:
    """The pool's first line: what the operator configured."""

    workers: int
    runtime: str
    preloaded_modules: tuple[str, ...]
    package_dirs: tuple[str, ...]
    config: str | None
    profiles: tuple[str, ...]
    protocol: int = PROTOCOL_VERSION

    @classmethod
    def pool(
        cls,
        workers: int,
        preloaded_modules: Iterable[str] = (),
        package_dirs: Iterable[str | os.PathLike[str]] = (),
        config: str | os.PathLike[str] | None = None,
        profiles: Iterable[str] = (),
    ) -> ReadyEvent:
        """The ready event of a ``readie pool`` set up so."""
        return cls(
            workers=workers,
            runtime=RUNTIME_NAME,
            preloaded_modules=tuple(preloaded_modules),
            package_dirs=tuple(os.fspath(path) for path in package_dirs),
            config=None if config is None else os.fspath(config),
            profiles=tuple(profiles),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "ready",
            "workers": self.workers,
            "runtime": self.runtime,
            "preloaded_modules": list(self.preloaded_modules),
            "package_dirs": list(self.package_dirs),
            "config": self.config,
            "profiles": list(self.profiles),
            "protocol": self.protocol,
        }


@dataclass(frozen=True, slots=True)
class StatsEvent:
    """The answer to ``{"id", "stats": true}``: the counters, in the order the pool wrote them."""

    id: RequestId
    counters: Mapping[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "event": "stats", **self.counters}


@dataclass(frozen=True, slots=True)
class ClosedEvent:
    """The answer to ``{"id", "session", "close": true}``; a refused close is answered by a result."""

    id: RequestId
    session: str

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "session": self.session, "closed": True}


@dataclass(frozen=True, slots=True)
class HibernatedEvent:
    """The answer to ``{"id", "session", "hibernate": true}``: the session is on disk, its sandbox
    gone (``hibernate_ms`` it took; 0 when it was already); a refusal is answered by a result."""

    id: RequestId
    session: str
    hibernate_ms: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "session": self.session, "hibernated": True, "hibernate_ms": self.hibernate_ms}


@dataclass(frozen=True, slots=True)
class ForkedEvent:
    """The answer to ``{"id", "session", "fork": name}``: session ``forked`` is open, a copy of
    ``session`` (``fork_ms`` it took); a refusal is answered by a result."""

    id: RequestId
    session: str
    forked: str
    fork_ms: int
    # The fork's own key (decision 32), as a session's first result carries its; a secret, so out
    # of the repr. None when its worker keeps no keys.
    session_key: str | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "session": self.session, "forked": self.forked, "fork_ms": self.fork_ms}
        if self.session_key is not None:
            out["session_key"] = self.session_key
        return out


@dataclass(frozen=True, slots=True)
class AttachedEvent:
    """The answer to ``{"id", "session", "attach": key}``: the stored session is this pool's session
    ``session`` now, ``step`` the number of its last step (decision 32); a refusal is a result."""

    id: RequestId
    session: str
    step: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "session": self.session, "attached": True, "step": self.step}


@dataclass(frozen=True, slots=True)
class CancelledEvent:
    """The answer to ``{"id", "cancel": target}``: ``found`` says whether ``target`` was a job
    still queued or running (then its own result follows, or came already)."""

    id: RequestId
    target: RequestId
    found: bool

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "event": "cancelled", "target": self.target, "found": self.found}


@dataclass(frozen=True, slots=True)
class CallEvent:
    """A host-function call the sandbox of request ``id`` made; the client answers with a reply.

    ``args`` and ``kwargs`` are JSON values exactly as the sandbox sent them
    (integers of any size, any depth): the line is written and read by
    hostwire's iterative codec, never by ``json`` alone.
    """

    id: RequestId
    call_id: int
    function: str
    args: list[Any]
    kwargs: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {
            "event": "call",
            "id": self.id,
            "call_id": self.call_id,
            "function": self.function,
            "args": list(self.args),
            "kwargs": dict(self.kwargs),
        }


@dataclass(frozen=True, slots=True)
class OutputEvent:
    """Output the job of request ``id`` wrote while it ran (it asked with ``"stream": true``).

    ``seq`` counts the job's output events from 1, both streams together, in
    the order they were written; all come before the job's result, which
    still holds the whole output (decision 16).
    """

    id: RequestId
    stream: Literal["stdout", "stderr"]
    data: str
    seq: int

    def to_json(self) -> dict[str, Any]:
        return {"event": "output", "id": self.id, "stream": self.stream, "data": self.data, "seq": self.seq}


# --------------------------------------------------------------------------- parsing


def parse_ready(obj: Any) -> ReadyEvent:
    """The ready event; :class:`VersionMismatch` when the pool speaks another protocol version."""
    fields = Fields(obj, "the ready event")
    if fields.optional("event", str) != "ready":
        broken(f"the pool's first line is not the ready event: {short(obj)}")
    protocol = fields.optional("protocol", int)
    protocol = 1 if protocol is None else protocol
    if protocol != PROTOCOL_VERSION:
        raise VersionMismatch(
            f"readie pool speaks pool protocol version {protocol}, this client speaks version "
            f"{PROTOCOL_VERSION}: install the same readie version on both sides"
        )
    return ReadyEvent(
        workers=fields.get("workers", int),
        runtime=fields.get("runtime", str),
        preloaded_modules=fields.strings("preloaded_modules"),
        package_dirs=fields.strings("package_dirs"),
        config=fields.optional("config", str),
        profiles=fields.strings("profiles"),
        protocol=protocol,
    )


def parse_stats(obj: Any) -> StatsEvent:
    """The stats event; its counters are kept as the pool wrote them (the spec: "the same object")."""
    fields = Fields(obj, "the stats event")
    if fields.get("event", str) != "stats":
        broken(f"expected a stats event, got {short(obj)}")
    fields.get("jobs", int)
    return StatsEvent(
        id=fields.get("id", (str, int)),
        counters={key: value for key, value in obj.items() if key not in ("id", "event")},
    )


def parse_closed(obj: Any) -> ClosedEvent:
    """The answer to a close: ``{"id", "session", "closed": true}``; a refusal comes as a result."""
    fields = Fields(obj, "the answer to a close")
    if fields.optional("closed", bool) is not True:
        broken(f"expected a closed event, got {short(obj)}")
    return ClosedEvent(id=fields.get("id", (str, int)), session=fields.get("session", str))


def parse_hibernated(obj: Any) -> HibernatedEvent:
    """The answer to a hibernate: ``{"id", "session", "hibernated": true, "hibernate_ms"}``."""
    fields = Fields(obj, "the answer to a hibernate")
    if fields.optional("hibernated", bool) is not True:
        broken(f"expected a hibernated event, got {short(obj)}")
    return HibernatedEvent(
        id=fields.get("id", (str, int)), session=fields.get("session", str), hibernate_ms=fields.get("hibernate_ms", int)
    )


def parse_forked(obj: Any) -> ForkedEvent:
    """The answer to a fork: ``{"id", "session", "forked": name, "fork_ms"}``."""
    fields = Fields(obj, "the answer to a fork")
    return ForkedEvent(
        id=fields.get("id", (str, int)), session=fields.get("session", str),
        forked=fields.get("forked", str), fork_ms=fields.get("fork_ms", int),
        session_key=fields.optional("session_key", str),
    )


def parse_attached(obj: Any) -> AttachedEvent:
    """The answer to an attach: ``{"id", "session", "attached": true, "step"}``."""
    fields = Fields(obj, "the answer to an attach")
    if fields.optional("attached", bool) is not True:
        broken(f"expected an attached event, got {short(obj)}")
    return AttachedEvent(
        id=fields.get("id", (str, int)), session=fields.get("session", str), step=fields.get("step", int)
    )


def parse_cancelled(obj: Any) -> CancelledEvent:
    """The answer to a cancel."""
    fields = Fields(obj, "the answer to a cancel")
    if fields.get("event", str) != "cancelled":
        broken(f"expected a cancelled event, got {short(obj)}")
    return CancelledEvent(
        id=fields.get("id", (str, int)), target=fields.get("target", (str, int)), found=fields.get("found", bool)
    )


def parse_call(obj: Any) -> CallEvent:
    """A ``call`` event."""
    fields = Fields(obj, "a call event")
    return CallEvent(
        id=fields.get("id", (str, int)),
        call_id=fields.get("call_id", int),
        function=fields.get("function", str),
        args=fields.get("args", list),
        kwargs=fields.get("kwargs", Mapping),
    )


def parse_output(obj: Any) -> OutputEvent:
    """An ``output`` event."""
    fields = Fields(obj, "an output event")
    stream = fields.get("stream", str)
    if stream not in hostwire.OUTPUT_STREAMS:
        broken(f"an output event on a stream that is neither stdout nor stderr: {short(obj)}")
    return OutputEvent(
        id=fields.get("id", (str, int)), stream=stream, data=fields.get("data", str), seq=fields.get("seq", int)
    )
