"""Pool requests: one JSONL line in, a typed request or a typed refusal out.

Four kinds of line, told apart by their keys:

* ``{"reply": {...}}`` answers a host-function call (:class:`ReplyRequest`);
* ``{"id": ..., "stats": true}`` asks for the counters (:class:`StatsRequest`);
* ``{"id": ..., "session": ..., "close": true}`` ends a session (:class:`CloseSession`);
* anything else is a job or a session step (:class:`JobRequest`).

Parsing never raises on input: a bad line becomes :class:`Refused`, holding
the id when one could be recovered and a :class:`RequestError` naming the
field. Every accepted value is rebuilt into a frozen dataclass, so a field the
spec does not know cannot ride along (unknown fields are refused anyway).

Types are strict (``_values``): a bool is not an integer, a float is not an
integer, strings must be valid Unicode (no lone surrogates: they cannot
cross into the sandbox as UTF-8), duplicate keys and NaN/Infinity are refused. What a request
asks for is only checked for shape here; whether the pool grants it is
``_policy``'s business, and whether a session step may carry it is the
session manager's (see :attr:`JobRequest.setup_fields`).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from readie_executor import hostwire
from readie_executor.hostwire import MAX_FUNCTIONS

from .errors import RequestError, UnitError
from .lines import ID_SCAN_BYTES, MAX_LINE_BYTES, LineEvent, OversizeLine, recover_id
from .units import DURATION_SCHEMA, MAX_VALUE, SIZE_SCHEMA, parse_duration_ms, parse_size, positive_schema
from .wire import MAX_ID_CHARS, MAX_ID_INT, RequestId, id_problem, json_type

from ._values import (
    MAX_REQUIREMENT_CHARS,
    Invalid,
    argv_string,
    bool_value,
    bounded_text,
    code_value,
    env_value,
    function_names,
    list_of,
    load_strict,
    positive,
    requirement,
    schema_of,
    text_value,
    with_schema,
)

__all__ = [
    "MAX_FUNCTIONS",
    "MAX_PATH_BYTES",
    "MAX_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_REQUIREMENT_CHARS",
    "MAX_REPLY_BYTES",
    "MAX_SESSION_CHARS",
    "SESSION_SETUP_FIELDS",
    "SESSION_STEP_FIELDS",
    "CLOSE_FIELDS",
    "JOB_FIELDS",
    "REQUEST_ID_SCHEMA",
    "JobField",
    "CloseSession",
    "JobRequest",
    "Refused",
    "ReplyRequest",
    "Request",
    "StatsRequest",
    "CancelJob",
    "encode_request",
    "parse_event",
    "parse_request",
    "refuse_oversize",
]

#: Linux's PATH_MAX: no longer path can be opened in one call anyway.
MAX_PATH_BYTES = 4096
#: What request checks count in characters: more of them means more bytes too.
MAX_PATH_CHARS = MAX_PATH_BYTES
#: The spec: host-function "arguments and results are JSON, at most 1 MB each way".
MAX_REPLY_BYTES = 1_000_000
#: Linux's NAME_MAX: ``name`` becomes the file name in tracebacks.
MAX_NAME_CHARS = 255
#: Session names are echoed in every step's result and log line.
MAX_SESSION_CHARS = 256

#: Fields only a session's first request may carry: they fix the session's
#: permissions, limits, environment and host functions for its whole life.
SESSION_SETUP_FIELDS = frozenset(
    {
        "allow_read",
        "allow_write",
        "package_dirs",
        "env",
        "allow_network",
        "memory",
        "max_file_size",
        "profile",
        "functions",
        "packages",
    }
)
#: Fields any step of a session may carry (the spec: "code, name, args, and optionally timeout and
#: max_output"; readie's stream and report_files say what the answer carries, not what the step may do).
SESSION_STEP_FIELDS = frozenset({"id", "session", "code", "name", "args", "timeout", "max_output", "stream", "report_files"})


@dataclass(frozen=True, slots=True)
class JobRequest:
    """A job, or one step of a session when ``session`` is set.

    Fields a request did not carry are None (``args`` is empty), so a profile
    can fill them and the session manager can tell "absent" from "empty".
    ``fields`` lists the wire names the request did carry.
    """

    id: RequestId
    code: str | None = None
    script: str | None = None
    name: str | None = None
    args: tuple[str, ...] = ()
    allow_read: tuple[str, ...] | None = None
    allow_write: tuple[str, ...] | None = None
    package_dirs: tuple[str, ...] | None = None
    env: tuple[tuple[str, str], ...] | None = None
    allow_network: bool | None = None
    timeout_ms: int | None = None
    memory_bytes: int | None = None
    max_output: int | None = None
    max_file_size: int | None = None
    profile: str | None = None
    functions: tuple[str, ...] | None = None
    session: str | None = None
    packages: tuple[str, ...] | None = None
    stream: bool = False
    report_files: bool = False
    fields: frozenset[str] = frozenset()

    @property
    def setup_fields(self) -> tuple[str, ...]:
        """Fields present that a later step of an existing session may not carry, sorted."""
        return tuple(sorted(self.fields & SESSION_SETUP_FIELDS))

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env or ())


@dataclass(frozen=True, slots=True)
class StatsRequest:
    id: RequestId


@dataclass(frozen=True, slots=True)
class CancelJob:
    """Stop job ``target`` (queued or running) and free its sandbox; answered by a cancelled event.

    The job itself is still answered once, by its own result (a PoolWorkerError
    when the cancel reached it in time).
    """

    id: RequestId
    target: RequestId


@dataclass(frozen=True, slots=True)
class CloseSession:
    id: RequestId
    session: str


@dataclass(frozen=True, slots=True)
class ReplyRequest:
    """A host-function answer: ``error`` is None when the call returned ``result``.

    ``result`` is any JSON value exactly as parsed (bounded by
    :data:`MAX_REPLY_BYTES`); it goes on to the sandbox as JSON, never
    interpreted here.
    """

    call_id: int
    result: Any = None
    error: str | None = None


Request = JobRequest | StatsRequest | CloseSession | CancelJob | ReplyRequest


@dataclass(frozen=True, slots=True)
class Refused:
    """A line the pool will not act on. ``id`` is None when none could be recovered."""

    id: RequestId | None
    error: RequestError


# --------------------------------------------------------------------------- entry points


def parse_request(line: bytes | str) -> Request | Refused:
    """Parse one line (without its newline). Never raises on any input."""
    raw = line.encode("utf-8", "surrogatepass") if isinstance(line, str) else bytes(line)
    if len(raw) > MAX_LINE_BYTES:
        return Refused(recover_id(raw[:ID_SCAN_BYTES]), _oversize_error(len(raw)))
    try:
        obj = load_strict(raw)
    except Invalid as exc:
        return Refused(recover_id(raw[:ID_SCAN_BYTES]), RequestError(str(exc)))
    if not isinstance(obj, dict):
        return Refused(None, RequestError(f"a request must be a JSON object, got {json_type(obj)}"))
    rid: RequestId | None = None
    if "id" in obj:
        problem = id_problem(obj["id"])
        if problem:
            return Refused(None, RequestError(problem, "id"))
        rid = obj["id"]
    try:
        return _build(obj, rid)
    except RequestError as exc:
        return Refused(rid, exc)


def parse_event(event: LineEvent) -> Request | Refused:
    """Parse what :class:`~readie_protocol.lines.LineSplitter` produced."""
    if isinstance(event, OversizeLine):
        return refuse_oversize(event)
    return parse_request(event.data)


def refuse_oversize(event: OversizeLine) -> Refused:
    return Refused(event.id, _oversize_error(event.size))


def _oversize_error(size: int) -> RequestError:
    return RequestError(
        f"line of {size} bytes is longer than the {MAX_LINE_BYTES}-byte limit; discarded"
    )


# --------------------------------------------------------------------------- dispatch


_STATS_FIELDS = frozenset({"id", "stats"})
_CLOSE_FIELDS = frozenset({"id", "session", "close"})
_CANCEL_FIELDS = frozenset({"id", "cancel"})
_REPLY_FIELDS = frozenset({"reply"})


def _build(obj: dict[str, Any], rid: RequestId | None) -> Request:
    if "reply" in obj:
        _only(obj, _REPLY_FIELDS, "a reply")
        return _reply(obj["reply"])
    if "stats" in obj:
        _only(obj, _STATS_FIELDS, "a stats request")
        if obj["stats"] is not True:
            raise RequestError("must be true", "stats")
        return StatsRequest(_required_id(rid))
    if "cancel" in obj:
        _only(obj, _CANCEL_FIELDS, "a cancel request")
        problem = id_problem(obj["cancel"])
        if problem:
            raise RequestError(f"the id of the job to cancel {problem}", "cancel")
        return CancelJob(_required_id(rid), obj["cancel"])
    if "close" in obj:
        close = _field(obj, "close", bool_value)
        if close:
            _only(obj, _CLOSE_FIELDS, "a close request")
            if "session" not in obj:
                raise RequestError("close needs the session to close", "session")
            return CloseSession(_required_id(rid), _field(obj, "session", _session))
        # "close": false asks for nothing; the line is an ordinary job or step.
        obj = {k: v for k, v in obj.items() if k != "close"}
    return _job(obj, _required_id(rid))


def _only(obj: dict[str, Any], allowed: frozenset[str], what: str) -> None:
    for key in obj:
        if key not in allowed:
            if key in _JOB_FIELDS or key in _ALL_KINDS:
                raise RequestError(f"not allowed in {what}", key)
            raise RequestError("unknown field", key)


def _required_id(rid: RequestId | None) -> RequestId:
    if rid is None:
        raise RequestError("required", "id")
    return rid


def _field(obj: dict[str, Any], name: str, check: Callable[[Any], Any]) -> Any:
    try:
        return check(obj[name])
    except (Invalid, UnitError) as exc:
        raise RequestError(str(exc), name) from None


# --------------------------------------------------------------------------- jobs


def _job(obj: dict[str, Any], rid: RequestId) -> JobRequest:
    _only(obj, _JOB_KEYS, "a job")
    values: dict[str, Any] = {}
    for key in obj:
        if key == "id":
            continue
        field = _JOB_FIELDS[key]
        values[field.attr] = _field(obj, key, field.check)
    has_code, has_script = "code" in obj, "script" in obj
    if has_code and has_script:
        raise RequestError("give exactly one of code and script, not both", "script")
    if not has_code and not has_script:
        raise RequestError("required: give exactly one of code and script", "code")
    if has_script and "session" in obj:
        raise RequestError("sessions take inline code, not script", "script")
    return JobRequest(id=rid, fields=frozenset(obj) - {"id"}, **values)


_path = bounded_text(MAX_PATH_CHARS)
_session = bounded_text(MAX_SESSION_CHARS)


@dataclass(frozen=True, slots=True)
class JobField:
    """One field a job request may carry: its wire name, the :class:`JobRequest`
    attribute it fills, the check of its value, and what it means.

    The parser and the published schema (``readie_protocol.schema``) both read
    this table, so a field is defined once.
    """

    name: str
    attr: str
    check: Callable[[Any], Any]
    about: str

    def schema(self) -> dict[str, Any]:
        schema = schema_of(self.check)
        # A unit's own description (how sizes and durations are written) follows the field's meaning.
        unit = schema.pop("description", None)
        return {**schema, "description": self.about if unit is None else f"{self.about} Written as {unit}."}


JOB_FIELDS = (
    JobField("code", "code", code_value, "The program as text. Exactly one of code and script."),
    JobField("script", "script", _path,
             "A Python file to run instead, relative to the pool's working directory; read by the pool "
             "without following links. Not in a session."),
    JobField("name", "name", bounded_text(MAX_NAME_CHARS),
             "The file name tracebacks show for inline code."),
    JobField("args", "args", list_of(argv_string), "sys.argv[1:] of the program."),
    JobField("allow_read", "allow_read", list_of(_path),
             "Files or directories the job may read, relative to the pool's working directory; each must lie "
             "beneath one of the ceiling's allow_read."),
    JobField("allow_write", "allow_write", list_of(_path),
             "Existing directories the job may write; each beneath one of the ceiling's allow_write."),
    JobField("package_dirs", "package_dirs", list_of(_path),
             "Extra site-packages directories put on sys.path, read-only; beneath the ceiling's read grants."),
    JobField("env", "env", env_value, "Environment variables of the program."),
    JobField("allow_network", "allow_network", bool_value,
             "Whether the job gets a network; refused unless the ceiling has allow_network = true."),
    JobField("timeout", "timeout_ms", with_schema(positive(parse_duration_ms), positive_schema(DURATION_SCHEMA)),
             "Wall-clock limit of the job (a session step: of the step); at most the ceiling's. Past it the "
             "job ends with TimeoutError and exit 124."),
    JobField("memory", "memory_bytes", with_schema(positive(parse_size), positive_schema(SIZE_SCHEMA)),
             "Memory limit of the job, files it writes in its tmpfs included; at most the ceiling's."),
    JobField("max_output", "max_output", with_schema(parse_size, SIZE_SCHEMA),
             "Bytes of stdout, and of stderr, kept; the rest is cut and the result says truncated."),
    JobField("max_file_size", "max_file_size", with_schema(parse_size, SIZE_SCHEMA),
             "The largest file the job may write (RLIMIT_FSIZE); at most the ceiling's, which also applies "
             "when unset."),
    JobField("profile", "profile", bounded_text(MAX_SESSION_CHARS),
             "A [profiles.NAME] preset of the pool's config; the request's own fields go on top, then the "
             "ceiling applies."),
    JobField("functions", "functions", function_names,
             "Host functions the code may import from readie_host; each call is a call event the client "
             "answers with a reply."),
    JobField("session", "session", _session,
             "A session name: the first request opens a sandbox that keeps its variables, later requests "
             "under the name are its steps (code, name, args, timeout, max_output only)."),
    JobField("packages", "packages", list_of(requirement),
             "Requirements (name[extras]==version) installed once into a cached package directory for "
             "the job."),
    JobField("stream", "stream", bool_value,
             "Send the job's output as output events while it runs, before its result (which still holds "
             "all of it). A session step asks for its own."),
    JobField("report_files", "report_files", bool_value,
             "List in the result the files the job created or changed in its write grants (host path and "
             "size; at most 1000, files_truncated says when more). A session step asks for its own."),
)

# wire name -> field
_JOB_FIELDS = {field.name: field for field in JOB_FIELDS}

#: The fields of a close request beside its id, as a JSON Schema (``readie_protocol.schema``).
CLOSE_FIELDS = {
    "session": {**schema_of(_session), "description": "The session to end; its sandbox is destroyed."},
    "close": {"const": True},
}
#: A request id as a JSON Schema: what :func:`~readie_protocol.wire.id_problem` accepts.
REQUEST_ID_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        {"type": "integer", "minimum": -MAX_ID_INT, "maximum": MAX_ID_INT},
    ],
    "description": "Echoed in the answer; results come in completion order, so ids match them up.",
}

_JOB_KEYS = frozenset(_JOB_FIELDS) | {"id"}

# Keys that select another kind of request; named as "not allowed" rather than "unknown".
_ALL_KINDS = frozenset({"id", "stats", "close", "cancel", "reply"})


# --------------------------------------------------------------------------- replies


def _reply(value: Any) -> ReplyRequest:
    if not isinstance(value, dict):
        raise RequestError(f"expected an object, got {json_type(value)}", "reply")
    for key in value:
        if key not in ("call_id", "result", "error"):
            raise RequestError("unknown field", f"reply.{key}")
    if "call_id" not in value:
        raise RequestError("required", "reply.call_id")
    call_id = value["call_id"]
    if isinstance(call_id, bool) or not isinstance(call_id, int) or not 0 <= call_id <= MAX_VALUE:
        raise RequestError(
            f"expected an integer from 0 to {MAX_VALUE}, got {json_type(call_id)}",
            "reply.call_id",
        )
    has_result, has_error = "result" in value, "error" in value
    if has_result == has_error:
        raise RequestError("give exactly one of result and error", "reply")
    if has_error:
        try:
            error = text_value(value["error"])
        except Invalid as exc:
            raise RequestError(str(exc), "reply.error") from None
        _check_reply_size(error, "reply.error")
        return ReplyRequest(call_id=call_id, error=error)
    _check_reply_size(value["result"], "reply.result")
    return ReplyRequest(call_id=call_id, result=value["result"])


def _check_reply_size(value: Any, field: str) -> None:
    # Measured as the worker will send it into the sandbox: compact JSON, by
    # hostwire's iterative encoder (a deep value needs no recursion).
    try:
        hostwire.dumps(value, MAX_REPLY_BYTES)
    except ValueError:
        raise RequestError(f"too large: the limit is {MAX_REPLY_BYTES} bytes of JSON", field) from None


# --------------------------------------------------------------------------- a client's request lines


def encode_request(request: Mapping[str, Any]) -> bytes:
    """``request`` as one UTF-8 JSON line with its newline; :class:`RequestError` if the pool would refuse its size.

    Checked before sending, so the caller learns the limit from an exception
    naming the field instead of from a refusal after the upload.
    """
    try:
        data = _dumps(request).encode("utf-8")
    except UnicodeEncodeError:
        field = next((key for key, value in request.items() if not _encodable(value)), None)
        raise RequestError("contains a lone surrogate (\\ud800-\\udfff), which UTF-8 cannot carry", field) from None
    except (TypeError, ValueError) as exc:
        raise TypeError(f"request is not JSON: {exc}") from None
    if len(data) > MAX_LINE_BYTES:
        sizes = {key: len(_dumps(value).encode("utf-8")) for key, value in request.items()}
        biggest = max(sizes, key=sizes.__getitem__)
        hint = " (pass long code as a file with script=...)" if biggest == "code" else ""
        raise RequestError(
            f"the request line is {len(data)} bytes, {sizes[biggest]} of them {biggest}; "
            f"the pool reads at most {MAX_LINE_BYTES} bytes (1 MiB) per line{hint}; "
            "put large data in a file under allow_read instead",
            biggest,
        )
    return data + b"\n"


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


def _encodable(value: Any) -> bool:
    try:
        _dumps(value).encode("utf-8")
    except (UnicodeEncodeError, TypeError, ValueError):
        return False
    return True
