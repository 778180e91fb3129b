"""A job's result line as a frozen value, for both ends, with its parts (the error, the runtime,
the policy, the last expression's value), the outcome it stands for, its parser and
:class:`JobError`, the error a failed job's result raises. ``readie_protocol.events`` holds the other lines and re-exports these; see its docstring for the
parsing rules.

One :class:`Result` travels from the pool's engine to its client: the engine
builds it from a worker's outcome (``readie_pool._results``), writes it, and
counts it by :attr:`Result.outcome`; a client parses the same value back.

``exit`` is always an integer, so a client testing ``exit == 0`` (or a shell
habit, ``if exit:``) never mistakes a job that did not run for a success:

* the code ran and exited: its exit status (0; 1 for an uncaught exception;
  ``n`` for ``sys.exit(n)``);
* killed by a signal: 128 + the signal number, as a shell reports it;
* killed at its timeout: 124 (:data:`EXIT_TIMEOUT`), as ``timeout(1)`` reports it;
* never ran, or no status was observed (RequestError, SandboxSetupError,
  PoolWorkerError, SignalError): -1 (:data:`EXIT_NOT_RUN`), which no process
  can exit with.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ._fields import Fields, broken, short
from .errors import ErrorType, ReadieError, RequestError, family_of
from .wire import RequestId
from ._values import Invalid
from .network import NetworkReport, RefusedConnection, parse_network
from .workspace import LEFT_OUT_REASONS, LeftOut, decode_bytes, encode_bytes

__all__ = [
    "EXIT_NOT_RUN",
    "EXIT_TIMEOUT",
    "RUNTIME_NAME",
    "ErrorInfo",
    "FileInfo",
    "JobError",
    "NetworkReport",
    "Outcome",
    "PolicyInfo",
    "RefusedConnection",
    "Result",
    "RuntimeInfo",
    "Value",
    "parse_result",
]

#: The spec's "runtime" value, with pynox read as readie.
RUNTIME_NAME = "readie"
#: ``exit`` of a job that never ran or whose status was never observed.
EXIT_NOT_RUN = -1
#: ``exit`` of a job killed at its timeout, as ``timeout(1)`` reports it.
EXIT_TIMEOUT = 124


class Outcome(enum.Enum):
    """Which stats counter a result adds to; the counters are disjoint. Values are the stats event's keys."""

    OK = "ok"
    FAILED = "failed"  # the job's Python code raised or exited non-zero
    TIMEOUT = "timeouts"
    SIGNAL = "signals"
    REQUEST_ERROR = "request_errors"
    WORKER_ERROR = "worker_errors"  # PoolWorkerError and SandboxSetupError


# The outcome of a result that readie ended before the job's code did, by its error type.
_NOT_RUN = {ErrorType.SIGNAL: Outcome.SIGNAL, ErrorType.REQUEST: Outcome.REQUEST_ERROR}


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
class Value:
    """The value of the code's last bare expression, shown as a notebook cell shows it.

    ``text`` is its ``repr()`` (``truncated`` when cut); ``data`` what the
    object offers through IPython's display protocol, by MIME type
    (``text/html``, ``image/png`` as base64, ...); ``omitted`` the kinds it
    offered that were too large to carry.
    """

    text: str
    truncated: bool = False
    data: Mapping[str, str] = field(default_factory=dict)
    omitted: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"text": self.text, "truncated": self.truncated, "data": dict(self.data), "omitted": list(self.omitted)}


@dataclass(frozen=True, slots=True)
class FileInfo:
    """A file the code wrote in one of its write grants (``report_files``): its host path and size."""

    path: str
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size}


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
    ``session``, ``step`` and ``session_ended`` are set for session steps only, and
    ``resumed_ms`` only for a step that restored its hibernated session first;
    ``session_key`` only on a session's first result (decision 32: with it another connection
    attaches to the session); ``lost`` for a step whose worker was lost while it ran (it may have
    run in part; the session goes on); ``resumed_from_step`` for a step whose session resumed from
    the state after that earlier step (a crash lost the steps since);
    ``value`` only when the code ended with a bare expression whose value is not None;
    ``files`` and ``files_truncated`` only when the request asked for ``report_files``;
    ``network`` only when the job had the network (decision 35: what its egress policy refused).
    """

    id: RequestId | None
    exit: int
    stdout: str = ""
    stderr: str = ""
    error: ErrorInfo | None = None
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    duration_ms: int = 0
    duration_us: int = 0
    queue_us: int = 0
    runtime: RuntimeInfo | None = None
    policy: PolicyInfo | None = None
    session: str | None = None
    step: int | None = None
    session_ended: bool = False
    value: Value | None = None
    files: tuple[FileInfo, ...] | None = None
    files_truncated: bool = False
    resumed_ms: int | None = None
    # What ``collect`` brought back (decision 31): each file's bytes by its workspace path, and
    # the matches left out and why (at most MAX_LEFT_OUT; ``left_out_more`` counts the rest).
    # None and empty unless the request asked to collect.
    collected: Mapping[str, bytes] | None = None
    left_out: tuple[LeftOut, ...] = ()
    left_out_more: int = 0
    # Decision 32. The key is a secret: out of the repr (and of the job log line, _events).
    session_key: str | None = field(default=None, repr=False)
    lost: bool = False
    resumed_from_step: int | None = None
    network: NetworkReport | None = None

    @property
    def ok(self) -> bool:
        """The code ran to the end and exited 0."""
        return self.exit == 0 and self.error is None

    @property
    def truncated(self) -> bool:
        return self.stdout_truncated or self.stderr_truncated

    @property
    def outcome(self) -> Outcome:
        """The counter this result adds to, read from ``exit`` and the error's type alone.

        Only readie writes exit -1 (a process exits 0 to 255; a job that forges
        its runner's "not started" answer gets it too, for its own line only),
        so a job's own exception named like one of readie's errors (exit 1) is
        the job's failure; a timeout is exit 124 with ``TimeoutError``, which a job's
        uncaught TimeoutError (exit 1) is not.
        """
        error = self.error
        if error is None:
            return Outcome.OK if self.exit == 0 else Outcome.FAILED
        if self.exit == EXIT_NOT_RUN:
            return _NOT_RUN.get(error.type, Outcome.WORKER_ERROR)
        if self.exit == EXIT_TIMEOUT and error.type == ErrorType.TIMEOUT:
            return Outcome.TIMEOUT
        return Outcome.FAILED

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
        if self.session_key is not None:
            out["session_key"] = self.session_key
        if self.lost:
            out["lost"] = True
        if self.resumed_ms is not None:
            out["resumed_ms"] = self.resumed_ms
        if self.resumed_from_step is not None:
            out["resumed_from_step"] = self.resumed_from_step
        if self.value is not None:
            out["value"] = self.value.to_json()
        if self.files is not None:
            out["files"] = [file.to_json() for file in self.files]
            out["files_truncated"] = self.files_truncated
        if self.collected is not None:
            out["collected"] = {path: encode_bytes(data) for path, data in self.collected.items()}
            out["left_out"] = [entry.to_json() for entry in self.left_out]
            out["left_out_more"] = self.left_out_more
        if self.network is not None:
            out["network"] = self.network.to_json()
        return out


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


def parse_result(obj: Any) -> Result:
    """A job's result line."""
    fields = Fields(obj, "a result")
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
        value=fields.nested("value", _value) if "value" in obj else None,
        files=_files(obj["files"]) if obj.get("files") is not None else None,
        files_truncated=fields.optional("files_truncated", bool) or False,
        resumed_ms=fields.optional("resumed_ms", int),
        collected=_collected(obj["collected"]) if obj.get("collected") is not None else None,
        left_out=_left_out(obj.get("left_out") or []),
        left_out_more=fields.optional("left_out_more", int) or 0,
        session_key=fields.optional("session_key", str),
        lost=fields.optional("lost", bool) or False,
        resumed_from_step=fields.optional("resumed_from_step", int),
        network=fields.nested("network", parse_network) if "network" in obj else None,
    )


def _collected(files: Any) -> dict[str, bytes]:
    if not isinstance(files, Mapping):
        broken(f"a result's collected must be an object, got {type(files).__name__}")
    collected = {}
    for path, text in files.items():
        try:
            collected[path] = decode_bytes(text)
        except Invalid as exc:
            broken(f"a result's collected file {short(path)}: {exc}")
    return collected


def _left_out(entries: Any) -> tuple[LeftOut, ...]:
    if not isinstance(entries, list):
        broken(f"a result's left_out must be a list, got {type(entries).__name__}")
    left_out = []
    for entry in entries:
        fields = Fields(entry, "a result's left_out entry")
        reason = fields.get("reason", str)
        if reason not in LEFT_OUT_REASONS:
            broken(f"a result's left_out entry has an unknown reason: {short(reason)}")
        left_out.append(LeftOut(path=fields.get("path", str), reason=reason, size=fields.optional("size", int)))
    return tuple(left_out)


def _value(fields: Fields) -> Value:
    data = fields.get("data", Mapping)
    if not all(isinstance(key, str) and isinstance(item, str) for key, item in data.items()):
        broken("a result's value.data must map MIME types to text")
    return Value(
        text=fields.get("text", str), truncated=fields.get("truncated", bool), data=dict(data),
        omitted=fields.strings("omitted"),
    )


def _files(entries: Any) -> tuple[FileInfo, ...]:
    if not isinstance(entries, list):
        broken(f"a result's files must be a list, got {type(entries).__name__}")
    files = []
    for entry in entries:
        fields = Fields(entry, "a result's file")
        files.append(FileInfo(path=fields.get("path", str), size=fields.get("size", int)))
    return tuple(files)


def _error(fields: Fields) -> ErrorInfo:
    return ErrorInfo(
        type=fields.get("type", str),
        message=fields.get("message", str),
        file=fields.optional("file", str),
        line=fields.optional("line", int),
        hint=fields.optional("hint", str),
    )


def _runtime(fields: Fields) -> RuntimeInfo:
    return RuntimeInfo(
        name=fields.get("name", str),
        python=fields.get("python", str),
        mode=fields.get("mode", str),
        preloaded_modules=fields.strings("preloaded_modules"),
    )


def _policy(fields: Fields) -> PolicyInfo:
    return PolicyInfo(
        allow_read=fields.strings("allow_read"),
        allow_write=fields.strings("allow_write"),
        network=fields.get("network", str),
        subprocesses=fields.get("subprocesses", str),
        timeout_ms=fields.optional("timeout_ms", int),
        memory_bytes=fields.optional("memory_bytes", int),
        backend=fields.get("backend", str),
    )
