"""A job, or a session's step: the fields its line may carry, the :class:`JobRequest` they fill, and
:func:`build_job`, which checks them for the parser and for a client alike.

The field table (:data:`JOB_FIELDS`) is the one definition of each field:
its wire name, the attribute it fills, the check of its value (which carries
its JSON Schema) and what it means. The parser (``requests``), the published
schema (``schema``), the client's request lines (``request_lines``) and the
reference page all read it, so a field is defined once. Which fields a later
step of a session may carry is here too (:data:`SESSION_STEP_FIELDS`).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from readie_executor.jobs import bounds

from ._values import (
    Invalid,
    argv_string,
    at_most,
    bool_value,
    bounded_text,
    code_value,
    env_value,
    function_names,
    list_of,
    positive,
    requirement,
    schema_of,
    with_schema,
)
from .errors import RequestError, UnitError
from .transfers import TRANSFER_KINDS
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
from .wire import MAX_SESSION_CHARS, RequestId, id_problem, json_type
from .workspace import MAX_COLLECTED_BYTES, MAX_REQUEST_FILES, MAX_REQUEST_FILES_BYTES, collect_value, files_value

__all__ = [
    "ALLOW_NETWORK_SCHEMA",
    "KIND_KEYS",
    "JOB_FIELDS",
    "MAX_DESTINATIONS",
    "MAX_DESTINATION_CHARS",
    "MAX_LISTED_FILES",
    "MAX_NAME_CHARS",
    "MAX_OUTPUT_BYTES",
    "MAX_PATH_BYTES",
    "MAX_PATH_CHARS",
    "MAX_TIMEOUT_MS",
    "SESSION_SETUP_FIELDS",
    "SESSION_STEP_FIELDS",
    "JobField",
    "JobRequest",
    "allow_network_value",
    "build_job",
    "checked_field",
    "only_fields",
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

#: The most destinations one ``allow_network`` list holds (a request's, a profile's, a ceiling's):
#: an agent's job talks to a few APIs; the enforcement makes a firewall rule or set element per
#: entry for every networked sandbox, so the list stays a short, reviewed allow-list.
MAX_DESTINATIONS = 64
#: The longest destination: a 253-character name, its final dot and ``:65535``.
MAX_DESTINATION_CHARS = 253 + 1 + 6

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
SESSION_STEP_FIELDS = frozenset(
    {"id", "session", "code", "name", "args", "timeout", "max_output", "stream", "report_files", "files", "collect"}
)


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
    # False or True, or the destinations as written (readie_policy.egress parses them).
    allow_network: bool | tuple[str, ...] | None = None
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
    # Files written into the workspace before the code runs (checked paths and their bytes), and
    # the paths or patterns whose files come back with the result (decision 31).
    files: tuple[tuple[str, bytes], ...] = ()
    collect: tuple[str, ...] = ()
    fields: frozenset[str] = frozenset()

    @property
    def setup_fields(self) -> tuple[str, ...]:
        """Fields present that a later step of an existing session may not carry, sorted."""
        return tuple(sorted(self.fields & SESSION_SETUP_FIELDS))

    @property
    def env_dict(self) -> dict[str, str]:
        return dict(self.env or ())



# --------------------------------------------------------------------------- building


def build_job(id: RequestId, fields: Mapping[str, Any]) -> JobRequest:
    """The job (or step) whose line carries ``fields`` (wire names, JSON values) beside ``id``, checked
    as the parser checks that line: a client builds its requests here (RequestError naming the field)."""
    if problem := id_problem(id):
        raise RequestError(problem, "id")
    only_fields(fields, _JOB_KEYS, "a job")
    values: dict[str, Any] = {}
    for key in fields:
        if key == "id":
            continue
        field = _JOB_FIELDS[key]
        values[field.attr] = checked_field(fields, key, field.check)
    has_code, has_script = "code" in fields, "script" in fields
    if has_code and has_script:
        raise RequestError("give exactly one of code and script, not both", "script")
    if not has_code and not has_script:
        raise RequestError("required: give exactly one of code and script", "code")
    if has_script and "session" in fields:
        raise RequestError("sessions take inline code, not script", "script")
    return JobRequest(id=id, fields=frozenset(fields) - {"id"}, **values)


_path = bounded_text(MAX_PATH_CHARS)
_destination = bounded_text(MAX_DESTINATION_CHARS)


def allow_network_value(value: Any) -> bool | tuple[str, ...]:
    """``false``, ``true`` or a list of at most :data:`MAX_DESTINATIONS` destination strings; their
    grammar is the policy's (``readie_policy.egress``), checked against the ceiling."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, list):
        raise Invalid(f"expected true, false or an array of destinations, got {json_type(value)}")
    if len(value) > MAX_DESTINATIONS:
        raise Invalid(f"{len(value)} destinations; at most {MAX_DESTINATIONS} are allowed")
    return _destinations(value)


_destinations = list_of(_destination)
#: What ``allow_network`` holds in a request, a profile and a ceiling alike.
ALLOW_NETWORK_SCHEMA = {"anyOf": [{"type": "boolean"}, {**schema_of(_destinations), "maxItems": MAX_DESTINATIONS}]}
with_schema(allow_network_value, ALLOW_NETWORK_SCHEMA)
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
    JobField("allow_network", "allow_network", allow_network_value,
             "The job's network: false (none), true (what the ceiling allows), or a list of destinations "
             "(api.example.com, *.example.com, 203.0.113.0/24, [2001:db8::1]:443; each optionally with "
             ":port), each within the ceiling's allow_network. Private, loopback and link-local addresses "
             "are denied unless the ceiling names them. Until the egress enforcement lands, a worker "
             "refuses a list."),
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
    JobField("files", "files", files_value,
             f"Files written into the job's workspace (its working directory in the sandbox, nothing of the "
             f"host's) before its code runs: relative paths to base64, at most {MAX_REQUEST_FILES} files and "
             f"{format_size(MAX_REQUEST_FILES_BYTES)} together; larger files go into a session by upload. "
             f"A session step brings its own."),
    JobField("collect", "collect", collect_value,
             f"Workspace paths and glob patterns (*, ?, [...], ** for any directories) whose files come back "
             f"in the result's collected, as base64, after the code ran (at most "
             f"{format_size(MAX_COLLECTED_BYTES)} and the ceiling's collect_bytes and collect_files); "
             f"what matched and was left out is in left_out, with why. A session step asks for its own."),
)

# wire name -> field
_JOB_FIELDS = {field.name: field for field in JOB_FIELDS}


_JOB_KEYS = frozenset(_JOB_FIELDS) | {"id"}

#: Keys that select another kind of request: in a line of one kind, the keys of another are
#: "not allowed" there rather than "unknown".
KIND_KEYS = frozenset({"id", "stats", "close", "hibernate", "fork", "attach", "cancel", "reply", *TRANSFER_KINDS})


def only_fields(obj: Mapping[str, Any], allowed: frozenset[str], what: str) -> None:
    """RequestError naming the first key of ``obj`` not in ``allowed``: "not allowed" when it is a
    field of another kind of request, "unknown" otherwise."""
    for key in obj:
        if key not in allowed:
            if key in _JOB_FIELDS or key in KIND_KEYS:
                raise RequestError(f"not allowed in {what}", key)
            raise RequestError("unknown field", key)


def checked_field(obj: Mapping[str, Any], name: str, check: Callable[[Any], Any]) -> Any:
    """``check(obj[name])``, its refusal a RequestError naming the field."""
    try:
        return check(obj[name])
    except (Invalid, UnitError) as exc:
        raise RequestError(str(exc), name) from None
