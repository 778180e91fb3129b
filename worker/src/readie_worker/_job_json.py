"""The one JSON form of a :class:`~readie_policy.jobs.CodeJob`: what a session store keeps of a
session's setup (``session_store.py``), so that another worker can run its next steps.

Every field, by its dataclass name; tuples as lists, ``files``' bytes as
base64, ``egress`` as its destinations (none: the public internet), as on the wire. The reading side is strict (the text comes from a shared directory):
it rebuilds the job only from the fields it knows, each of the type the
dataclass declares, and anything else is a ValueError the store turns into a
refusal. A field added to CodeJob is written at once and read back without a
change here, as long as its type is one of those below.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import typing
from typing import Any

from readie_policy.egress import parse_destinations, resolve_egress
from readie_policy.jobs import CodeJob
from readie_protocol.errors import RequestError

__all__ = ["job_from_json", "job_to_json"]

_HINTS = typing.get_type_hints(CodeJob)
_FIELDS = {field.name: _HINTS[field.name] for field in dataclasses.fields(CodeJob)}


def job_to_json(job: CodeJob) -> dict[str, Any]:
    """``job`` as plain JSON data."""
    data: dict[str, Any] = {}
    for name in _FIELDS:
        value = getattr(job, name)
        if name == "files":
            value = [[path, base64.b64encode(content).decode("ascii")] for path, content in value]
        elif name == "env":
            value = dict(value)
        elif name == "egress":
            value = None if value is None else [str(destination) for destination in value.destinations]
        elif isinstance(value, tuple):
            value = list(value)
        data[name] = value
    return data


def job_from_json(data: object) -> CodeJob:
    """The job :func:`job_to_json` wrote; ValueError naming the field when ``data`` is not one."""
    if not isinstance(data, dict):
        raise ValueError("the job is not an object")
    unknown = set(data) - set(_FIELDS)
    if unknown:
        raise ValueError(f"the job has unknown fields {sorted(unknown)}")
    fields: dict[str, Any] = {}
    for name, value in data.items():
        fields[name] = _field(name, _FIELDS[name], value)
    try:
        return CodeJob(**fields)
    except TypeError as exc:  # a required field missing
        raise ValueError(f"the job is incomplete: {exc}") from None


def _field(name: str, hint: object, value: object) -> object:
    if name == "files":
        return tuple((_text(name, path), _base64(name, content)) for path, content in _pairs(name, value))
    if name == "egress":
        if value is None:
            return None
        if not isinstance(value, list):
            raise ValueError("job field 'egress' is not a list")
        try:
            return resolve_egress(parse_destinations(value) or True, None)
        except RequestError as exc:
            raise ValueError(f"job field 'egress': {exc}") from None
    if name == "env":
        if not isinstance(value, dict):
            raise ValueError("job field 'env' is not an object")
        return {_text(name, key): _text(name, item) for key, item in value.items()}
    if hint == tuple[str, ...]:
        if not isinstance(value, list):
            raise ValueError(f"job field {name!r} is not a list")
        return tuple(_text(name, item) for item in value)
    if hint is str:
        return _text(name, value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ValueError(f"job field {name!r} is not a boolean")
        return value
    if hint is int or hint == (int | None):
        if value is None and hint != int:
            return None
        if not isinstance(value, int) or isinstance(value, bool):
            raise ValueError(f"job field {name!r} is not an integer")
        return value
    raise ValueError(f"job field {name!r} has a type this form does not carry")  # a new CodeJob field: add it


def _text(name: str, value: object) -> str:
    if not isinstance(value, str):
        raise ValueError(f"job field {name!r} holds a value that is not text")
    return value


def _pairs(name: str, value: object) -> list[tuple[object, object]]:
    if not isinstance(value, list) or not all(isinstance(pair, list) and len(pair) == 2 for pair in value):
        raise ValueError(f"job field {name!r} is not a list of pairs")
    return [(path, content) for path, content in value]


def _base64(name: str, value: object) -> bytes:
    try:
        return base64.b64decode(_text(name, value), validate=True)
    except binascii.Error:
        raise ValueError(f"job field {name!r} holds invalid base64") from None
