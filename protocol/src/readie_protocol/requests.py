"""Pool requests: one JSONL line in, a typed request or a typed refusal out.

Kinds of line, told apart by their keys:

* ``{"reply": {...}}`` answers a host-function call (:class:`ReplyRequest`);
* ``{"id": ..., "stats": true}`` asks for the counters (:class:`StatsRequest`);
* ``{"id": ..., "session": ..., "close": true}`` ends a session (:class:`CloseSession`);
* ``{"id": ..., "session": ..., "hibernate": true}`` checkpoints it to disk (:class:`HibernateSession`);
* ``{"id": ..., "session": ..., "fork": name}`` copies it to a new session (:class:`ForkSession`);
* ``{"id": ..., "session": ..., "attach": key}`` continues a stored session under that name
  (:class:`AttachSession`, decision 32);
* ``{"id": ..., "session": ..., "upload" | "download" | "list": path, ...}`` moves a session's
  files (:mod:`readie_protocol.transfers`: :class:`UploadChunk`, :class:`DownloadChunk`, :class:`ListFiles`);
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
session manager's (see :attr:`JobRequest.setup_fields`). A job's fields and their checks are
``job_requests``'s.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from readie_executor.hostwire import MAX_FUNCTIONS

from ._values import (
    MAX_REQUIREMENT_CHARS, Invalid, bool_value, bounded_text, load_strict, schema_of, text_value, with_schema,
)
from .encoding import encode_request
from .errors import RequestError
from .job_requests import (
    JOB_FIELDS,
    MAX_LISTED_FILES,
    MAX_NAME_CHARS,
    MAX_OUTPUT_BYTES,
    MAX_PATH_BYTES,
    MAX_PATH_CHARS,
    MAX_TIMEOUT_MS,
    SESSION_SETUP_FIELDS,
    SESSION_STEP_FIELDS,
    JobField,
    JobRequest,
    build_job,
    checked_field,
    only_fields,
)
from .lines import ID_SCAN_BYTES, MAX_LINE_BYTES, LineEvent, OversizeLine, recover_id
from .replies import MAX_REPLY_BYTES, ReplyRequest, parse_reply
from .transfers import TRANSFER_KINDS, DownloadChunk, ListFiles, UploadChunk, build_transfer
from .wire import MAX_ID_CHARS, MAX_ID_INT, MAX_SESSION_CHARS, RequestId, id_problem, json_type

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
    "ATTACH_FIELDS",
    "CLOSE_FIELDS",
    "FORK_FIELDS",
    "HIBERNATE_FIELDS",
    "JOB_FIELDS",
    "REQUEST_ID_SCHEMA",
    "MAX_SESSION_KEY_CHARS",
    "JobField",
    "AttachSession",
    "CloseSession",
    "ForkSession",
    "HibernateSession",
    "JobRequest",
    "Refused",
    "ReplyRequest",
    "Request",
    "StatsRequest",
    "CancelJob",
    "DownloadChunk",
    "ListFiles",
    "UploadChunk",
    "build_job",
    "encode_request",
    "parse_event",
    "parse_request",
    "refuse_oversize",
]


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


@dataclass(frozen=True, slots=True)
class AttachSession:
    """Continue the session stored under ``key`` (its first result's ``session_key``) as this pool's
    session ``session`` (decision 32); its next step runs in the same ``__main__``. The key is a
    secret: it is left out of the repr, and no message or log line carries it."""

    id: RequestId
    session: str
    key: str = field(repr=False)


Request = (
    JobRequest | StatsRequest | CloseSession | HibernateSession | ForkSession | AttachSession | CancelJob
    | ReplyRequest | UploadChunk | DownloadChunk | ListFiles
)


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
    except RecursionError:  # a check that recursed into a value nested past Python's depth
        return Refused(rid, RequestError("a value is nested too deeply"))


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
_ATTACH_FIELDS = frozenset({"id", "session", "attach"})
_REPLY_FIELDS = frozenset({"reply"})


def _build(obj: dict[str, Any], rid: RequestId | None) -> Request:
    if "reply" in obj:
        only_fields(obj, _REPLY_FIELDS, "a reply")
        return parse_reply(obj["reply"])
    if "stats" in obj:
        only_fields(obj, _STATS_FIELDS, "a stats request")
        if obj["stats"] is not True:
            raise RequestError("must be true", "stats")
        return StatsRequest(_required_id(rid))
    if "cancel" in obj:
        only_fields(obj, _CANCEL_FIELDS, "a cancel request")
        problem = id_problem(obj["cancel"])
        if problem:
            raise RequestError(f"the id of the job to cancel {problem}", "cancel")
        return CancelJob(_required_id(rid), obj["cancel"])
    if "hibernate" in obj:
        only_fields(obj, _HIBERNATE_FIELDS, "a hibernate request")
        if obj["hibernate"] is not True:
            raise RequestError("must be true", "hibernate")
        return HibernateSession(_required_id(rid), _session_named(obj))
    if "fork" in obj:
        only_fields(obj, _FORK_FIELDS, "a fork request")
        session, fork = _session_named(obj), checked_field(obj, "fork", _session)
        if fork == session:
            raise RequestError("a fork needs a name of its own, not its session's", "fork")
        return ForkSession(_required_id(rid), session, fork)
    if "attach" in obj:
        only_fields(obj, _ATTACH_FIELDS, "an attach request")
        return AttachSession(_required_id(rid), _session_named(obj), checked_field(obj, "attach", _session_key))
    if any(kind in obj for kind in TRANSFER_KINDS):
        return build_transfer(_required_id(rid), obj)
    if "close" in obj:
        close = checked_field(obj, "close", bool_value)
        if close:
            only_fields(obj, _CLOSE_FIELDS, "a close request")
            if "session" not in obj:
                raise RequestError("close needs the session to close", "session")
            return CloseSession(_required_id(rid), checked_field(obj, "session", _session))
        # "close": false asks for nothing; the line is an ordinary job or step.
        obj = {k: v for k, v in obj.items() if k != "close"}
    return build_job(_required_id(rid), obj)


def _session_named(obj: dict[str, Any]) -> str:
    if "session" not in obj:
        raise RequestError("required: the session to act on", "session")
    return checked_field(obj, "session", _session)


def _required_id(rid: RequestId | None) -> RequestId:
    if rid is None:
        raise RequestError("required", "id")
    return rid


# --------------------------------------------------------------------------- schemas of the other requests


_session = bounded_text(MAX_SESSION_CHARS)

#: A session key is made by a worker: 32 random bytes as URL-safe base64, 43 characters (decision
#: 32). The bound leaves room for a longer key of a later worker, and keeps a line from carrying
#: a megabyte to compare; the alphabet keeps anything but a key out of the worker's lookup.
MAX_SESSION_KEY_CHARS = 128
_KEY_ALPHABET = re.compile(r"[A-Za-z0-9_=-]+")


def _key_check(value: Any) -> str:
    # Never echoes the value: a refusal is a result line, and result lines are logged.
    text = text_value(value)
    if not 0 < len(text) <= MAX_SESSION_KEY_CHARS or not _KEY_ALPHABET.fullmatch(text):
        raise Invalid(f"not a session key (1 to {MAX_SESSION_KEY_CHARS} characters of URL-safe base64)")
    return text


_session_key = with_schema(
    _key_check,
    {"type": "string", "minLength": 1, "maxLength": MAX_SESSION_KEY_CHARS, "pattern": "^[A-Za-z0-9_=-]+$"},
)

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
#: The fields of an attach request beside its id.
ATTACH_FIELDS = {
    "session": {**schema_of(_session), "description": "The name the stored session goes by in this pool; "
                "no session of that name may be open here."},
    "attach": {**schema_of(_session_key), "description": "The session's key: the session_key of its first "
               "result (or of its fork's answer). A wrong key and an unknown one are the same refusal."},
}
#: A request id as a JSON Schema: what :func:`~readie_protocol.wire.id_problem` accepts.
REQUEST_ID_SCHEMA = {
    "anyOf": [
        {"type": "string", "minLength": 1, "maxLength": MAX_ID_CHARS},
        {"type": "integer", "minimum": -MAX_ID_INT, "maximum": MAX_ID_INT},
    ],
    "description": "Echoed in the answer; results come in completion order, so ids match them up.",
}
