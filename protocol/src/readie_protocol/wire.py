"""JSON wire rules shared by both directions and both ends of the pool protocol.

Request ids, the names of JSON types in error messages, and the one encoder
that turns an outgoing object into a line.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = [
    "MAX_ID_CHARS",
    "PROTOCOL_VERSION",
    "MAX_ID_INT",
    "MAX_SESSION_CHARS",
    "RequestId",
    "encode_line",
    "id_problem",
    "json_type",
]

#: Version of the pool JSONL protocol, sent in the ready event. Bump it when a
#: field changes meaning or disappears; adding a field does not need a bump.
PROTOCOL_VERSION = 1

RequestId = str | int

#: Ids are echoed in every result and log line; a client correlating calls
#: needs far less than this, and a bound keeps a hostile id from bloating them.
MAX_ID_CHARS = 256
#: Integer ids must survive clients whose JSON numbers are int64 (Go, Java).
MAX_ID_INT = 2**63 - 1
#: Session names are echoed in every step's result and log line.
MAX_SESSION_CHARS = 256


def id_problem(value: object) -> str | None:
    """Why ``value`` cannot be a request id, or None when it can.

    An id is a non-empty string or an integer (not a bool, not a float), as
    in the spec's examples, small enough to echo back safely.
    """
    if isinstance(value, bool) or not isinstance(value, str | int):
        return f"must be a string or an integer, got {json_type(value)}"
    if isinstance(value, int):
        if abs(value) > MAX_ID_INT:
            return f"integer ids must lie between -{MAX_ID_INT} and {MAX_ID_INT}"
        return None
    if not value:
        return "must not be empty"
    if len(value) > MAX_ID_CHARS:
        return f"longer than {MAX_ID_CHARS} characters"
    # Lone surrogates ("\ud800") parse fine but cannot be echoed as UTF-8.
    if not _is_utf8(value):
        return "contains a lone surrogate"
    return None


def json_type(value: object) -> str:
    """The JSON name of a parsed value's type, for error messages."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, int | float):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "an array"
    if isinstance(value, dict):
        return "an object"
    return type(value).__name__


def encode_line(obj: dict[str, Any]) -> bytes:
    """One outgoing JSON object as a UTF-8 line ending in ``\\n``.

    Non-ASCII text stays readable. Captured output may hold lone surrogates
    (undecodable bytes kept by surrogateescape); such a line falls back to
    ASCII escapes rather than failing or writing invalid UTF-8. NaN is
    refused: it is not JSON and many clients reject the whole line.
    """
    text = json.dumps(obj, ensure_ascii=False, allow_nan=False)
    try:
        data = text.encode("utf-8")
    except UnicodeEncodeError:
        data = json.dumps(obj, ensure_ascii=True, allow_nan=False).encode("ascii")
    return data + b"\n"


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
