"""Pool requests: one JSONL line in, a typed request or a typed refusal out.

Four kinds of line, told apart by their keys:

* ``{"reply": {...}}`` answers a host-function call (:class:`ReplyRequest`);
* ``{"id": ..., "stats": true}`` asks for the counters (:class:`StatsRequest`);
* ``{"id": ..., "session": ..., "close": true}`` ends a session (:class:`CloseSession`);
* ``{"id": ..., "session": ..., "hibernate": true}`` checkpoints it to disk (:class:`HibernateSession`);
* ``{"id": ..., "session": ..., "fork": name}`` copies it to a new session (:class:`ForkSession`);
* anything else is a job or a session step (:class:`JobRequest`).

Parsing never raises on input: a bad line becomes :class:`Refused`, holding
the id when one could be recovered and a :class:`RequestError` naming the
field. Every accepted value is rebuilt into a frozen dataclass, so a field the
spec does not know cannot ride along (unknown fields are refused anyway).

Types are strict (``_values``): a bool is not an integer, a float is not an
integer, strings must be valid Unicode (no lone surrogates: they cannot
cross into the sandbox as UTF-8), duplicate keys and NaN/Infinity are refused. What a request
asks for is only checked for shape here; whether the pool grants it is
:mod:`readie_policy.policy`'s business, and whether a session step may carry it is the
session manager's (see :attr:`JobRequest.setup_fields`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from readie_executor.hostwire import MAX_FUNCTIONS
from readie_executor.jobs import bounds

from .encoding import encode_request
from .replies import MAX_REPLY_BYTES, ReplyRequest, parse_reply
from .errors import RequestError, UnitError
from .lines import ID_SCAN_BYTES, MAX_LINE_BYTES, LineEvent, OversizeLine, recover_id
from .units import (
    DURATION_SCHEMA,
    SIZE_SCHEMA,
    at_most_schema,
    format_duration_ms,
    format_size,
    parse_duration_ms,
    parse_size,
    positive_schema,
)
from .wire import MAX_ID_CHARS, MAX_ID_INT, MAX_SESSION_CHARS, RequestId, id_problem, json_type

from ._values import (
    MAX_REQUIREMENT_CHARS,
    Invalid,
    at_most,
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
    with_schema,
)

__all__ = [
    "MAX_FUNCTIONS",
    "MAX_LISTED_FILES",
    "MAX_OUTPUT_BYTES",
    "MAX_PATH_BYTES",
    "MAX_NAME_CHARS",
    "MAX_PATH_CHARS",
    "MAX_REQUIREMENT_CHARS",
    "MAX_REPLY_BYTES",
    "MAX_SESSION_CHARS",
    "MAX_TIMEOUT_MS",
    "SESSION_SETUP_FIELDS",
    "SESSION_STEP_FIELDS",
    "CLOSE_FIELDS",
    "FORK_FIELDS",
    "HIBERNATE_FIELDS",
    "JOB_FIELDS",
    "REQUEST_ID_SCHEMA",
    "JobField",
    "CloseSession",
    "ForkSession",
    "HibernateSession",
    "JobRequest",
    "Refused",
    "ReplyRequest",
    "Request",
    "StatsRequest",
    "CancelJob",
    "build_job",
    "encode_request",
    "parse_event",
    "parse_request",
    "refuse_oversize",
]

#: Linux's PATH_MAX: no longer path can be opened in one call anyway.
MAX_PATH_BYTES = 4096
#: What request checks count in characters: more of them means more bytes too.
MAX_PATH_CHARS = MAX_PATH_BYTES
#: Linux's NAME_MAX: ``name`` becomes the file name in tracebacks.
MAX_NAME_CHARS = 255
#: A result lists at most this many files (``report_files``): a model or a person
#: reads the first thousand. Paths are at most PATH_MAX, so the list is at most
#: 4 MiB, and 12 MiB of JSON for names that are not UTF-8 (each byte a
#: replacement character). The worker cuts its list there; a peer reading a
#: worker's answer refuses a longer one.
MAX_LISTED_FILES = 1000
#: The longest timeout a job or a step may have, from a request, a profile or
#: a ceiling: a day. The sandbox's timers take at most 2**63 ns (about 292
#: years: Python's socket and signal timers, on the host and in gVisor alike,
#: raise OverflowError past it), and every deadline built on a timeout adds to
#: it (the worker's grace, the monotonic clock); a day keeps all of them far
#: inside, and a job's result within what it may claim to have run (a week,
#: readie_worker._job_result). gRPC requests have a shorter bound of their own.
MAX_TIMEOUT_MS = 24 * 3600 * 1000
#: The largest ``max_output`` a job or a step may have: what the in-sandbox
#: runner captures at most. Held at every parse (this one, the gRPC wire's,
#: the config's), so a policy never holds more.
MAX_OUTPUT_BYTES = bounds.MAX_OUTPUT_LIMIT

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
class HibernateSession:
    """Checkpoint the session to disk now and free its sandbox; its next step resumes it."""

    id: RequestId
    session: str


@dataclass(frozen=True, slots=True)
class ForkSession:
    """Open session ``fork`` as a copy of ``session``: same state and permissions, its own sandbox."""

    id: RequestId
    session: str
    fork: str


Request = JobRequest | StatsRequest | CloseSession | HibernateSession | ForkSession | CancelJob | ReplyRequest


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
_HIBERNATE_FIELDS = frozenset({"id", "session", "hibernate"})
_FORK_FIELDS = frozenset({"id", "session", "fork"})
_REPLY_FIELDS = frozenset({"reply"})


def _build(obj: dict[str, Any], rid: RequestId | None) -> Request:
    if "reply" in obj:
        _only(obj, _REPLY_FIELDS, "a reply")
        return parse_reply(obj["reply"])
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
    if "hibernate" in obj:
        _only(obj, _HIBERNATE_FIELDS, "a hibernate request")
        if obj["hibernate"] is not True:
            raise RequestError("must be true", "hibernate")
        return HibernateSession(_required_id(rid), _session_named(obj))
    if "fork" in obj:
        _only(obj, _FORK_FIELDS, "a fork request")
        session, fork = _session_named(obj), _field(obj, "fork", _session)
        if fork == session:
            raise RequestError("a fork needs a name of its own, not its session's", "fork")
        return ForkSession(_required_id(rid), session, fork)
    if "close" in obj:
        close = _field(obj, "close", bool_value)
        if close:
            _only(obj, _CLOSE_FIELDS, "a close request")
            if "session" not in obj:
                raise RequestError("close needs the session to close", "session")
            return CloseSession(_required_id(rid), _field(obj, "session", _session))
        # "close": false asks for nothing; the line is an ordinary job or step.
        obj = {k: v for k, v in obj.items() if k != "close"}
    return build_job(_required_id(rid), obj)


def _only(obj: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    for key in obj:
        if key not in allowed:
            if key in _JOB_FIELDS or key in _ALL_KINDS:
                raise RequestError(f"not allowed in {what}", key)
            raise RequestError("unknown field", key)


def _session_named(obj: dict[str, Any]) -> str:
    if "session" not in obj:
        raise RequestError("required: the session to act on", "session")
    return _field(obj, "session", _session)


def _required_id(rid: RequestId | None) -> RequestId:
    if rid is None:
        raise RequestError("required", "id")
    return rid


def _field(obj: Mapping[str, Any], name: str, check: Callable[[Any], Any]) -> Any:
    try:
        return check(obj[name])
    except (Invalid, UnitError) as exc:
        raise RequestError(str(exc), name) from None


# --------------------------------------------------------------------------- jobs


def build_job(id: RequestId, fields: Mapping[str, Any]) -> JobRequest:
    """The job (or step) whose line carries ``fields`` (wire names, JSON values) beside ``id``, checked
    as the parser checks that line: a client builds its requests here (RequestError naming the field)."""
    if problem := id_problem(id):
        raise RequestError(problem, "id")
    _only(fields, _JOB_KEYS, "a job")
    values: dict[str, Any] = {}
    for key in fields:
        if key == "id":
            continue
        field = _JOB_FIELDS[key]
        values[field.attr] = _field(fields, key, field.check)
    has_code, has_script = "code" in fields, "script" in fields
    if has_code and has_script:
        raise RequestError("give exactly one of code and script, not both", "script")
    if not has_code and not has_script:
        raise RequestError("required: give exactly one of code and script", "code")
    if has_script and "session" in fields:
        raise RequestError("sessions take inline code, not script", "script")
    return JobRequest(id=id, fields=frozenset(fields) - {"id"}, **values)


_path = bounded_text(MAX_PATH_CHARS)
_session = bounded_text(MAX_SESSION_CHARS)
_timeout = with_schema(
    at_most(positive(parse_duration_ms), MAX_TIMEOUT_MS, format_duration_ms(MAX_TIMEOUT_MS)),
    at_most_schema(positive_schema(DURATION_SCHEMA), MAX_TIMEOUT_MS // 1000),
)
_max_output = with_schema(
    at_most(parse_size, MAX_OUTPUT_BYTES, format_size(MAX_OUTPUT_BYTES)),
    at_most_schema(SIZE_SCHEMA, MAX_OUTPUT_BYTES),
)


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
    JobField("timeout", "timeout_ms", _timeout,
             f"Wall-clock limit of the job (a session step: of the step); at most the ceiling's, and at most "
             f"{format_duration_ms(MAX_TIMEOUT_MS)}. Past it the job ends with TimeoutError and exit 124."),
    JobField("memory", "memory_bytes", with_schema(positive(parse_size), positive_schema(SIZE_SCHEMA)),
             "Memory limit of the job, files it writes in its tmpfs included; at most the ceiling's."),
    JobField("max_output", "max_output", _max_output,
             f"Bytes of stdout, and of stderr, kept; the rest is cut and the result says truncated. At most "
             f"the ceiling's, and at most {format_size(MAX_OUTPUT_BYTES)}."),
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
#: The fields of a hibernate request beside its id.
HIBERNATE_FIELDS = {
    "session": {**schema_of(_session), "description": "The open session to checkpoint to disk; its next step resumes it."},
    "hibernate": {"const": True},
}
#: The fields of a fork request beside its id.
FORK_FIELDS = {
    "session": {**schema_of(_session), "description": "The open session to copy."},
    "fork": {**schema_of(_session), "description": "The new session's name: its state is the session's now, its sandbox its own."},
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
_ALL_KINDS = frozenset({"id", "stats", "close", "hibernate", "fork", "cancel", "reply"})
