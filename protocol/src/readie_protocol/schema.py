"""JSON Schemas of the pool protocol, generated from the definitions the code runs.

Requests come from the request field table (``requests.JOB_FIELDS``: each
field's check carries the schema of what it accepts, and its description),
events from the frozen dataclasses in ``events`` (their annotations; the
wire names are the field names, as ``to_json`` writes them). Nothing here is
written twice: a field added to the table or to an event is in the schema.

A schema says what a line may look like; the pool still decides what it
grants (the operator's ceiling and profiles), and says so in a result.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Mapping
from typing import Any

from .events import (
    AttachedEvent,
    CallEvent,
    CancelledEvent,
    ClosedEvent,
    ForkedEvent,
    HibernatedEvent,
    ErrorInfo,
    FileInfo,
    NetworkReport,
    OutputEvent,
    PolicyInfo,
    ReadyEvent,
    RefusedConnection,
    Result,
    RuntimeInfo,
    StatsEvent,
    Value,
)
from .lines import MAX_LINE_BYTES
from .network import MAX_ADDRESS_CHARS, MAX_DNS_NAME_CHARS, MAX_REFUSED_COUNT, MAX_REFUSED_NAMES, MAX_REFUSED_REPORTED
from .requests import (
    ATTACH_FIELDS, CLOSE_FIELDS, FORK_FIELDS, HIBERNATE_FIELDS, JOB_FIELDS, MAX_REPLY_BYTES, REQUEST_ID_SCHEMA,
)
from .transfers import DOWNLOAD_FIELDS, LIST_FIELDS, UPLOAD_FIELDS, ChunkEvent, ListingEvent, UploadedEvent
from .units import MAX_VALUE
from .wire import PROTOCOL_VERSION
from .workspace import FileChunk, FileEntry, FileListing, LeftOut

__all__ = ["SCHEMA_DIALECT", "event_schemas", "protocol_schema", "request_schema"]

SCHEMA_DIALECT = "https://json-schema.org/draft/2020-12/schema"


def request_schema() -> dict[str, Any]:
    """A request line: a job (or session step), a stats request, a session's close, hibernate, fork,
    attach, upload, download or list, a cancel, or a host-call reply."""
    job = {
        "title": "job or session step",
        "type": "object",
        "properties": {
            "id": REQUEST_ID_SCHEMA,
            **{f.name: f.schema() for f in JOB_FIELDS},
            "close": {"const": False, "description": "Asks for nothing: the line is an ordinary job or step."},
        },
        "required": ["id"],
        "additionalProperties": False,
        # Exactly one of code and script (the spec); sessions take inline code.
        "oneOf": [{"required": ["code"]}, {"required": ["script"]}],
        "not": {"required": ["session", "script"]},
    }
    stats = {
        "title": "stats request",
        "type": "object",
        "properties": {"id": REQUEST_ID_SCHEMA, "stats": {"const": True}},
        "required": ["id", "stats"],
        "additionalProperties": False,
    }
    close = {
        "title": "close a session",
        "type": "object",
        "properties": {"id": REQUEST_ID_SCHEMA, **CLOSE_FIELDS},
        "required": ["id", "session", "close"],
        "additionalProperties": False,
    }
    hibernate = {
        "title": "hibernate a session",
        "type": "object",
        "properties": {"id": REQUEST_ID_SCHEMA, **HIBERNATE_FIELDS},
        "required": ["id", "session", "hibernate"],
        "additionalProperties": False,
    }
    fork = {
        "title": "fork a session",
        "type": "object",
        "properties": {"id": REQUEST_ID_SCHEMA, **FORK_FIELDS},
        "required": ["id", "session", "fork"],
        "additionalProperties": False,
    }
    attach = {
        "title": "attach a stored session",
        "type": "object",
        "properties": {"id": REQUEST_ID_SCHEMA, **ATTACH_FIELDS},
        "required": ["id", "session", "attach"],
        "additionalProperties": False,
    }
    transfers = [
        {
            "title": title,
            "type": "object",
            "properties": {"id": REQUEST_ID_SCHEMA, **fields},
            "required": ["id", *fields],
            "additionalProperties": False,
        }
        for title, fields in (
            ("upload a chunk of a file into a session", UPLOAD_FIELDS),
            ("download a chunk of a session's file", DOWNLOAD_FIELDS),
            ("list a directory of a session's workspace", LIST_FIELDS),
        )
    ]
    transfers[1]["required"].remove("offset")  # a download starts at 0 unless it says
    cancel = {
        "title": "cancel a job",
        "type": "object",
        "properties": {
            "id": REQUEST_ID_SCHEMA,
            "cancel": {**REQUEST_ID_SCHEMA, "description": "The id of the job to stop; its sandbox is freed."},
        },
        "required": ["id", "cancel"],
        "additionalProperties": False,
    }
    reply = {
        "title": "host-function reply",
        "type": "object",
        "properties": {
            "reply": {
                "type": "object",
                "properties": {
                    "call_id": {"type": "integer", "minimum": 0, "maximum": MAX_VALUE,
                                "description": "the call event's call_id"},
                    "result": {"description": f"the function's value, any JSON (at most {MAX_REPLY_BYTES} bytes)"},
                    "error": {"type": "string", "description": "the exception text: readie_host.HostError in the sandbox"},
                },
                "required": ["call_id"],
                "additionalProperties": False,
                "oneOf": [{"required": ["result"]}, {"required": ["error"]}],
            }
        },
        "required": ["reply"],
        "additionalProperties": False,
    }
    return {
        "title": "readie pool request line",
        "description": f"One JSON object per line, at most {MAX_LINE_BYTES} bytes; unknown fields are refused. "
        "Integers are JSON integers: 1.0 is refused where an integer is expected, though JSON Schema allows it.",
        "oneOf": [job, stats, close, hibernate, fork, attach, *transfers, cancel, reply],
    }


def event_schemas() -> dict[str, dict[str, Any]]:
    """Every line a pool writes, by name."""
    return {
        "ready": _event(ReadyEvent, "ready", required_extra=()),
        "result": _object(Result, optional={"session", "step", "session_ended", "value", "files", "files_truncated", "resumed_ms",
                                            "collected", "left_out", "left_out_more", "session_key", "lost",
                                            "resumed_from_step", "network"}),
        "stats": {
            **_object(StatsEvent, skip={"counters"}),
            "properties": {"id": REQUEST_ID_SCHEMA, "event": {"const": "stats"}},
            "required": ["id", "event", "jobs"],
            # The counters, in the order the pool writes them: integers, and
            # objects of integers (errors by type, host-function traffic).
            "additionalProperties": {"type": ["integer", "object"]},
        },
        "closed": {**_object(ClosedEvent), "properties": {**_object(ClosedEvent)["properties"], "closed": {"const": True}},
                   "required": ["id", "session", "closed"]},
        "hibernated": {**_object(HibernatedEvent),
                       "properties": {**_object(HibernatedEvent)["properties"], "hibernated": {"const": True}},
                       "required": ["id", "session", "hibernated", "hibernate_ms"]},
        "forked": _object(ForkedEvent, optional={"session_key"}),
        "attached": {**_object(AttachedEvent),
                     "properties": {**_object(AttachedEvent)["properties"], "attached": {"const": True}},
                     "required": ["id", "session", "attached", "step"]},
        "cancelled": _event(CancelledEvent, "cancelled", required_extra=()),
        "call": _event(CallEvent, "call", required_extra=()),
        "output": _event(OutputEvent, "output", required_extra=()),
        "uploaded": _event(UploadedEvent, "uploaded", required_extra=()),
        # These two carry a value's fields beside the request's id and session, flat.
        "file_chunk": _flat(ChunkEvent, "file_chunk", "chunk", FileChunk),
        "listing": _flat(ListingEvent, "listing", "listing", FileListing),
    }


def protocol_schema() -> dict[str, Any]:
    """One document: requests and events, with the protocol version it describes."""
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "readie pool protocol",
        "x-readie-protocol": PROTOCOL_VERSION,
        "$defs": {"request": request_schema(), **{f"event_{name}": schema for name, schema in event_schemas().items()}},
    }


# --------------------------------------------------------------------------- dataclasses to schemas


def _event(cls: type, name: str, *, required_extra: tuple[str, ...]) -> dict[str, Any]:
    schema = _object(cls)
    schema["properties"] = {"event": {"const": name}, **schema["properties"]}
    schema["required"] = ["event", *schema["required"], *required_extra]
    return schema


def _flat(cls: type, name: str, attribute: str, value: type) -> dict[str, Any]:
    """The event ``cls`` whose ``to_json`` writes its own fields but ``attribute``, then the
    fields of that ``value``, side by side."""
    schema = _object(cls, skip={attribute})
    inner = _object(value)
    schema["properties"] = {"event": {"const": name}, **schema["properties"], **inner["properties"]}
    schema["required"] = ["event", *schema["required"], *inner["required"]]
    return schema


def _object(cls: type, *, optional: frozenset[str] | set[str] = frozenset(), skip: frozenset[str] | set[str] = frozenset()) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    fields = [field for field in dataclasses.fields(cls) if field.name not in skip]
    schema: dict[str, Any] = {
        "title": cls.__name__,
        "type": "object",
        "properties": {field.name: _type(hints[field.name]) for field in fields},
        # to_json writes every field (None as null), but for the ones it leaves out when unset.
        "required": [field.name for field in fields if field.name not in optional],
    }
    doc = (cls.__doc__ or "").strip().split("\n\n")[0]
    if doc:
        schema["description"] = " ".join(doc.split())
    return schema


_NESTED = (ErrorInfo, RuntimeInfo, PolicyInfo, Value, FileInfo, LeftOut, FileEntry, NetworkReport, RefusedConnection)


# The bounds a parser holds a nested value's fields to, where the dataclass alone cannot say them.
_BOUNDS: dict[type, dict[str, dict[str, Any]]] = {
    NetworkReport: {
        "refused_connections": {"minimum": 0, "maximum": MAX_REFUSED_COUNT},
        "refused": {"maxItems": MAX_REFUSED_REPORTED},
        "refused_lookups": {"minimum": 0, "maximum": MAX_REFUSED_COUNT},
        "refused_names": {"maxItems": MAX_REFUSED_NAMES, "items": {"type": "string", "minLength": 1, "maxLength": MAX_DNS_NAME_CHARS}},
        "allowed_connections": {"minimum": 0, "maximum": MAX_REFUSED_COUNT},
    },
    RefusedConnection: {
        "address": {"maxLength": MAX_ADDRESS_CHARS},
        "port": {"minimum": 1, "maximum": 65535},
        "count": {"minimum": 1, "maximum": MAX_REFUSED_COUNT},
    },
}


def _bounded(cls: type, schema: dict[str, Any]) -> dict[str, Any]:
    for name, bounds in _BOUNDS.get(cls, {}).items():
        schema["properties"][name] = {**schema["properties"][name], **bounds}
    return schema


def _type(hint: Any) -> dict[str, Any]:
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        options = [_type(arg) for arg in typing.get_args(hint)]
        return {"anyOf": options}
    if origin is typing.Literal:
        return {"enum": list(typing.get_args(hint))}
    if hint is type(None):
        return {"type": "null"}
    if hint is bool:
        return {"type": "boolean"}
    if hint is int:
        return {"type": "integer"}
    if hint is str:
        return {"type": "string"}
    if hint is bytes:  # a file's bytes in a JSON line
        return {"type": "string", "contentEncoding": "base64"}
    if hint is Any:
        return {}
    if hint in _NESTED:
        return _bounded(hint, _object(hint, optional={"hint"} if hint is ErrorInfo else set()))
    if origin in (tuple, list):
        args = typing.get_args(hint)
        return {"type": "array", "items": _type(args[0])} if args and args[0] is not Any else {"type": "array"}
    if origin in (dict, Mapping) or hint in (dict, Mapping):
        args = typing.get_args(hint)
        return {"type": "object", "additionalProperties": _type(args[1])} if args and args[1] is not Any else {"type": "object"}
    raise TypeError(f"no JSON Schema for {hint!r}")

