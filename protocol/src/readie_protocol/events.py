"""The pool protocol's lines as frozen values, for both ends: the ready event, job
results, the stats, closed, cancelled, call and output events.

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
from dataclasses import dataclass
from typing import Any, Literal, NoReturn

from .errors import ErrorType, JobError, PoolError, RequestError, VersionMismatch, family_of
from .wire import PROTOCOL_VERSION, RequestId

__all__ = [
    "RUNTIME_NAME",
    "CallEvent",
    "CancelledEvent",
    "ClosedEvent",
    "ErrorInfo",
    "OutputEvent",
    "PolicyInfo",
    "ReadyEvent",
    "Result",
    "RuntimeInfo",
    "StatsEvent",
    "parse_call",
    "parse_cancelled",
    "parse_closed",
    "parse_output",
    "parse_ready",
    "parse_result",
    "parse_stats",
]

#: The spec's "runtime" value, with pynox read as readie.
RUNTIME_NAME = "readie"


@dataclass(frozen=True, slots=True)
class ErrorInfo:
    """A result's ``error``: the Python exception class or one of readie's error types.

    ``file`` and ``line`` point at the script or inline name; ``hint`` says
    what was granted, for permission and memory errors (and only then is it
    written).
    """

    type: str
    message: str
    file: str | None = None
    line: int | None = None
    hint: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": str(self.type), "message": self.message, "file": self.file, "line": self.line}
        if self.hint is not None:
            out["hint"] = self.hint
        return out


@dataclass(frozen=True, slots=True)
class RuntimeInfo:
    """What ran the job: readie, the sandbox's Python, the mode and what it had imported."""

    name: str
    python: str
    mode: str
    preloaded_modules: tuple[str, ...]

    @classmethod
    def pool(cls, python: str, preloaded_modules: tuple[str, ...] = ()) -> RuntimeInfo:
        """The runtime of a ``readie pool``'s jobs."""
        return cls(RUNTIME_NAME, python, "pool", preloaded_modules)

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "python": self.python,
            "mode": self.mode,
            "preloaded_modules": list(self.preloaded_modules),
        }


@dataclass(frozen=True, slots=True)
class PolicyInfo:
    """The policy a job ran under, after profiles and the ceiling; paths are absolute."""

    allow_read: tuple[str, ...]
    allow_write: tuple[str, ...]
    network: str  # "allow" or "deny"
    subprocesses: str  # "allow" or "deny"
    timeout_ms: int | None
    memory_bytes: int | None
    backend: str

    def to_json(self) -> dict[str, Any]:
        return {
            "allow_read": list(self.allow_read),
            "allow_write": list(self.allow_write),
            "network": self.network,
            "subprocesses": self.subprocesses,
            "timeout_ms": self.timeout_ms,
            "memory_bytes": self.memory_bytes,
            "backend": self.backend,
        }


@dataclass(frozen=True, slots=True)
class Result:
    """One job's result line, every field of the spec's result.

    ``exit`` is always an integer: the job's exit status, 124 after a
    timeout, 128 + n after signal n, -1 when it never ran.
    ``session``, ``step`` and ``session_ended`` are set for session steps only.
    """

    id: RequestId | None
    exit: int
    stdout: str
    stderr: str
    error: ErrorInfo | None
    stdout_truncated: bool
    stderr_truncated: bool
    duration_ms: int
    duration_us: int
    queue_us: int
    runtime: RuntimeInfo | None
    policy: PolicyInfo | None
    session: str | None = None
    step: int | None = None
    session_ended: bool = False

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited 0."""
        return self.exit == 0 and self.error is None

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    def raise_for_error(self) -> Result:
        """Return this result if ok, else raise: :class:`RequestError` (carrying this result),
        :class:`SandboxSetupError` or :class:`PoolWorkerError` for readie's own error types,
        :class:`JobError` for the job's."""
        if self.ok:
            return self
        family = None if self.error is None else family_of(self.error.type)
        if self.error is None or family is None:
            raise JobError(self)
        if self.error.type == ErrorType.REQUEST:
            raise RequestError(self.error.message, result=self)
        raise family(self.error.message)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "exit": self.exit,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "error": None if self.error is None else self.error.to_json(),
            "stdout_truncated": self.stdout_truncated,
            "stderr_truncated": self.stderr_truncated,
            "duration_ms": self.duration_ms,
            "duration_us": self.duration_us,
            "queue_us": self.queue_us,
            "runtime": None if self.runtime is None else self.runtime.to_json(),
            "policy": None if self.policy is None else self.policy.to_json(),
        }
        if self.session is not None:
            out["session"] = self.session
            out["step"] = self.step
            out["session_ended"] = self.session_ended
        return out


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
    fields = _Fields(obj, "the ready event")
    if fields.optional("event", str) != "ready":
        _broken(f"the pool's first line is not the ready event: {_short(obj)}")
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


def parse_result(obj: Any) -> Result:
    """A job's result line."""
    fields = _Fields(obj, "a result")
    return Result(
        id=fields.get("id", (str, int, type(None))),
        exit=fields.get("exit", int),
        stdout=fields.get("stdout", str),
        stderr=fields.get("stderr", str),
        error=fields.nested("error", _error),
        stdout_truncated=fields.get("stdout_truncated", bool),
        stderr_truncated=fields.get("stderr_truncated", bool),
        duration_ms=fields.get("duration_ms", int),
        duration_us=fields.get("duration_us", int),
        queue_us=fields.get("queue_us", int),
        runtime=fields.nested("runtime", _runtime),
        policy=fields.nested("policy", _policy),
        session=fields.optional("session", str),
        step=fields.optional("step", int),
        session_ended=fields.optional("session_ended", bool) or False,
    )


def parse_stats(obj: Any) -> StatsEvent:
    """The stats event; its counters are kept as the pool wrote them (the spec: "the same object")."""
    fields = _Fields(obj, "the stats event")
    if fields.get("event", str) != "stats":
        _broken(f"expected a stats event, got {_short(obj)}")
    fields.get("jobs", int)
    return StatsEvent(
        id=fields.get("id", (str, int)),
        counters={key: value for key, value in obj.items() if key not in ("id", "event")},
    )


def parse_closed(obj: Any) -> ClosedEvent:
    """The answer to a close: ``{"id", "session", "closed": true}``; a refusal comes as a result."""
    fields = _Fields(obj, "the answer to a close")
    if fields.optional("closed", bool) is not True:
        _broken(f"expected a closed event, got {_short(obj)}")
    return ClosedEvent(id=fields.get("id", (str, int)), session=fields.get("session", str))


def parse_cancelled(obj: Any) -> CancelledEvent:
    """The answer to a cancel."""
    fields = _Fields(obj, "the answer to a cancel")
    if fields.get("event", str) != "cancelled":
        _broken(f"expected a cancelled event, got {_short(obj)}")
    return CancelledEvent(
        id=fields.get("id", (str, int)), target=fields.get("target", (str, int)), found=fields.get("found", bool)
    )


def parse_call(obj: Any) -> CallEvent:
    """A ``call`` event."""
    fields = _Fields(obj, "a call event")
    return CallEvent(
        id=fields.get("id", (str, int)),
        call_id=fields.get("call_id", int),
        function=fields.get("function", str),
        args=fields.get("args", list),
        kwargs=fields.get("kwargs", Mapping),
    )


def parse_output(obj: Any) -> OutputEvent:
    """An ``output`` event."""
    fields = _Fields(obj, "an output event")
    stream = fields.get("stream", str)
    if stream not in ("stdout", "stderr"):
        _broken(f"an output event on a stream that is neither stdout nor stderr: {_short(obj)}")
    return OutputEvent(
        id=fields.get("id", (str, int)), stream=stream, data=fields.get("data", str), seq=fields.get("seq", int)
    )


def _error(fields: _Fields) -> ErrorInfo:
    return ErrorInfo(
        type=fields.get("type", str),
        message=fields.get("message", str),
        file=fields.optional("file", str),
        line=fields.optional("line", int),
        hint=fields.optional("hint", str),
    )


def _runtime(fields: _Fields) -> RuntimeInfo:
    return RuntimeInfo(
        name=fields.get("name", str),
        python=fields.get("python", str),
        mode=fields.get("mode", str),
        preloaded_modules=fields.strings("preloaded_modules"),
    )


def _policy(fields: _Fields) -> PolicyInfo:
    return PolicyInfo(
        allow_read=fields.strings("allow_read"),
        allow_write=fields.strings("allow_write"),
        network=fields.get("network", str),
        subprocesses=fields.get("subprocesses", str),
        timeout_ms=fields.optional("timeout_ms", int),
        memory_bytes=fields.optional("memory_bytes", int),
        backend=fields.get("backend", str),
    )


class _Fields:
    """Typed access to one JSON object of the pool's; a missing or mistyped field is a PoolError."""

    def __init__(self, obj: Any, what: str) -> None:
        if not isinstance(obj, Mapping):
            _broken(f"{what} is not a JSON object: {_short(obj)}")
        self._obj = obj
        self._what = what

    def get(self, key: str, kind: type | tuple[type, ...]) -> Any:
        if key not in self._obj:
            _broken(f"{self._what} lacks {key!r}: {_short(self._obj)}")
        return self._check(key, self._obj[key], kind)

    def optional(self, key: str, kind: type) -> Any:
        value = self._obj.get(key)
        return None if value is None else self._check(key, value, kind)

    def strings(self, key: str) -> tuple[str, ...]:
        values = self.get(key, list)
        if not all(isinstance(item, str) for item in values):
            _broken(f"{self._what}: {key} must be a list of strings, got {_short(values)}")
        return tuple(values)

    def nested(self, key: str, build: Any) -> Any:
        value = self.get(key, (Mapping, type(None)))
        return None if value is None else build(_Fields(value, f"{self._what}'s {key}"))

    def _check(self, key: str, value: Any, kind: type | tuple[type, ...]) -> Any:
        kinds = kind if isinstance(kind, tuple) else (kind,)
        # JSON true is not the integer 1, and 1 is not true.
        if isinstance(value, bool) and bool not in kinds:
            ok = False
        else:
            ok = isinstance(value, kinds)
        if not ok:
            _broken(f"{self._what}: {key} has the wrong type: {_short(value)}")
        return value


def _short(value: Any, limit: int = 200) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "..."


def _broken(message: str) -> NoReturn:
    raise PoolError(f"readie pool broke the protocol: {message}")
