"""Strict JSON for request lines, and the checks of each request value's shape.

``load_strict`` refuses what ``json.loads`` lets through: bytes that are not
UTF-8 (it would guess UTF-16), duplicate keys (the last would hide the
first), NaN and Infinity; deep nesting is parsed iteratively. Each check
returns the value rebuilt (tuples, not lists) or raises :class:`Invalid`;
``_requests`` adds the field name.
"""

from __future__ import annotations

import json
import keyword
import math
from collections import Counter
from collections.abc import Callable
from typing import Any

from readie_executor import hostwire
from readie_executor.hostwire import MAX_FUNCTIONS, function_name_problem
from .errors import shown
from .wire import json_type

__all__ = [
    "MAX_REQUIREMENT_CHARS",
    "Invalid",
    "schema_of",
    "with_schema",
    "argv_string",
    "bool_value",
    "bounded_text",
    "code_value",
    "env_value",
    "function_names",
    "identifier",
    "list_of",
    "at_most",
    "load_strict",
    "positive",
    "requirement",
    "text_value",
]

#: One requirement (name[extras] and version clauses): enough for any real
#: one, and it bounds the install command and the package cache key.
MAX_REQUIREMENT_CHARS = 200


class Invalid(ValueError):
    """A value has the wrong shape; the caller adds the field name."""


def with_schema(check: Callable[[Any], Any], schema: dict[str, Any]) -> Callable[[Any], Any]:
    """``check`` carrying the JSON Schema of what it accepts (``check.schema``), which
    ``readie_protocol.schema`` publishes: the check and its schema are written side by side."""
    check.schema = schema  # type: ignore[attr-defined]
    return check


def schema_of(check: Callable[[Any], Any]) -> dict[str, Any]:
    return dict(check.schema)  # type: ignore[attr-defined]


def load_strict(raw: bytes) -> Any:
    try:
        # Decode first: json.loads(bytes) would also accept UTF-16 and UTF-32.
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise Invalid(f"line is not valid UTF-8 (byte {exc.start})") from None
    try:
        return _STRICT.decode(text)
    except Invalid:
        raise
    except RecursionError:
        # Deep nesting is valid JSON: a host function's result may nest as deep
        # as its megabyte allows. hostwire's parser is iterative and as strict.
        try:
            return hostwire.loads(text)
        except hostwire.WireError as exc:
            raise Invalid(f"line is not valid JSON: {exc}") from None
    except ValueError as exc:  # JSONDecodeError, and int() past CPython's digit limit
        raise Invalid(f"line is not valid JSON: {exc}") from None


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        # json.loads keeps the last of duplicate keys; a second "id" or
        # "allow_write" could then hide from whatever looked at the first.
        repeated = next(key for key, count in Counter(key for key, _ in pairs).items() if count > 1)
        raise Invalid(f"duplicate key {shown(repeated)}")
    return obj


def _no_constant(name: str) -> Any:
    raise Invalid(f"{name} is not JSON")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Invalid(f"number {text} is out of range")
    return value


# One decoder for every line: json.loads(text, **hooks) builds a decoder and its scanner per call,
# which cost a request line ~25-50 us after idle here (decision 33). Shared across threads as
# json's own default decoder is.
_STRICT = json.JSONDecoder(object_pairs_hook=_unique_keys, parse_constant=_no_constant, parse_float=_finite_float)


# --------------------------------------------------------------------------- values


def text_value(value: Any) -> str:
    if not isinstance(value, str):
        raise Invalid(f"expected a string, got {json_type(value)}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid("contains a lone surrogate (\\ud800-\\udfff)") from None
    return value


def bounded_text(limit: int, *, newlines: bool = False) -> Callable[[Any], str]:
    def check(value: Any) -> str:
        text = text_value(value)
        if not text:
            raise Invalid("must not be empty")
        if len(text) > limit:
            raise Invalid(f"longer than {limit} characters")
        if "\x00" in text:
            raise Invalid("contains a NUL character")
        if not newlines and any(c in text for c in "\n\r"):
            raise Invalid("contains a line break")
        return text

    return with_schema(check, {"type": "string", "minLength": 1, "maxLength": limit})


def code_value(value: Any) -> str:
    # Empty code is a valid (if idle) program; NUL bytes are left for
    # Python's compile() to report as the SyntaxError users know.
    return text_value(value)


def argv_string(value: Any) -> str:
    text = text_value(value)
    if "\x00" in text:
        raise Invalid("contains a NUL character, which argv cannot carry")
    return text


with_schema(code_value, {"type": "string"})
with_schema(argv_string, {"type": "string"})


def list_of(check: Callable[[Any], Any]) -> Callable[[Any], tuple[Any, ...]]:
    def parse(value: Any) -> tuple[Any, ...]:
        if not isinstance(value, list):
            raise Invalid(f"expected an array, got {json_type(value)}")
        items = []
        for index, item in enumerate(value):
            try:
                items.append(check(item))
            except Invalid as exc:
                raise Invalid(f"item {index}: {exc}") from None
        return tuple(items)

    return with_schema(parse, {"type": "array", "items": schema_of(check)})


def env_value(value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise Invalid(f"expected an object of strings, got {json_type(value)}")
    pairs = []
    for key, item in value.items():
        name = text_value(key)
        if not name or "=" in name or "\x00" in name:
            raise Invalid(f"{shown(name)} is not a variable name (empty, '=' or NUL)")
        try:
            text = text_value(item)
        except Invalid as exc:
            raise Invalid(f"{shown(name)}: {exc}") from None
        if "\x00" in text:
            raise Invalid(f"{shown(name)}: contains a NUL character")
        pairs.append((name, text))
    return tuple(pairs)


with_schema(env_value, {"type": "object", "additionalProperties": {"type": "string"}})


def bool_value(value: Any) -> bool:
    if not isinstance(value, bool):
        raise Invalid(f"expected true or false, got {json_type(value)}")
    return value


with_schema(bool_value, {"type": "boolean"})


def positive(parse: Callable[[Any], int]) -> Callable[[Any], int]:
    def check(value: Any) -> int:
        result = parse(value)
        if result == 0:
            raise Invalid("must be greater than zero")
        return result

    return check


def at_most(check: Callable[[Any], int], most: int, shown: str) -> Callable[[Any], int]:
    """``check``, refusing a value past ``most`` (written ``shown`` in the refusal)."""

    def bounded(value: Any) -> int:
        result = check(value)
        if result > most:
            raise Invalid(f"too large: at most {shown}")
        return result

    return bounded


def function_names(value: Any) -> tuple[str, ...]:
    names = list_of(identifier)(value)
    if len(names) > MAX_FUNCTIONS:
        raise Invalid(f"at most {MAX_FUNCTIONS} functions")
    seen: set[str] = set()
    for name in names:
        if name in seen:
            raise Invalid(f"{shown(name)} declared twice")
        seen.add(name)
    return names




def identifier(value: Any) -> str:
    name = text_value(value)
    # ASCII only: lookalike Unicode names would let two declared functions
    # read the same in a tool description and differ in the sandbox.
    if not (name.isascii() and name.isidentifier()) or keyword.iskeyword(name):
        raise Invalid(f"{shown(name)} is not a Python identifier")
    # What else readie_host cannot offer: HostError, dunders, over-long names.
    problem = function_name_problem(name)
    if problem is not None:
        raise Invalid(problem)
    return name


# The shape only: keywords, dunders and HostError are refused by the check too.
with_schema(identifier, {"type": "string", "pattern": "^[A-Za-z_][A-Za-z0-9_]*$"})
with_schema(function_names, {"type": "array", "maxItems": MAX_FUNCTIONS, "uniqueItems": True, "items": schema_of(identifier)})


def requirement(value: Any) -> str:
    text = bounded_text(MAX_REQUIREMENT_CHARS)(value)
    # A leading dash would reach the installer as an option (--index-url=...).
    if text.lstrip().startswith("-"):
        raise Invalid(f"{shown(text)} is not a requirement (starts with '-')")
    return text


with_schema(requirement, {"type": "string", "minLength": 1, "maxLength": MAX_REQUIREMENT_CHARS, "pattern": "^[^-]"})
