"""Strict sizes and durations, as requests and the TOML config write them.

Sizes: a whole number of bytes, optionally followed by one of ``k``, ``m``,
``g``, ``t`` (any case; powers of 1024): ``65536``, ``64k``, ``512m``,
``1g``. Durations: a whole number followed by ``ms``, ``s``, ``m`` or ``h``
(any case): ``250ms``, ``5s``, ``15m``, ``1h``; a bare number means seconds,
so ``timeout = 30`` in TOML and ``"timeout": 30`` in JSON both read as 30
seconds, the unit the spec's examples use.

Integers may be given as JSON/TOML integers directly. Everything else is
refused with the reason: fractions (``1.5g``: write ``1536m``), floats, signs,
spaces, unknown suffixes, and values that do not fit a signed 64-bit integer
once converted (the sandbox layers hand these to C APIs and cgroup files).
"""

from __future__ import annotations

import re

from .errors import UnitError, shown

__all__ = [
    "DURATION_SCHEMA",
    "MAX_VALUE",
    "SIZE_SCHEMA",
    "at_most_schema",
    "format_duration_ms",
    "format_size",
    "parse_duration_ms",
    "parse_size",
    "positive_schema",
]

#: Converted values must fit a signed 64-bit integer: rlimits, cgroup files
#: and protobuf int64 fields all carry them.
MAX_VALUE = 2**63 - 1

# 19 digits already exceed MAX_VALUE; refusing longer strings before int()
# keeps a hostile "timeout": "999...9" (a megabyte of nines) from costing a
# quadratic conversion or tripping CPython's int-digit limit.
_MAX_DIGITS = 20

_SIZE_UNITS = {"": 1, "k": 1024, "m": 1024**2, "g": 1024**3, "t": 1024**4}
_DURATION_UNITS_MS = {"": 1000, "ms": 1, "s": 1000, "m": 60_000, "h": 3_600_000}

# ASCII digits only: str.isdigit() and int() also accept other scripts' digits.
_NUMBER = re.compile(r"([0-9]+)([a-z]*)", re.ASCII)


def _unit_schema(units: dict[str, int], what: str) -> dict[str, object]:
    # ECMA-262 regexes (JSON Schema's) have no inline case flag: [mM][sS].
    suffixes = "|".join("".join(f"[{c}{c.upper()}]" for c in unit) for unit in sorted(units, key=len, reverse=True) if unit)
    return {
        "anyOf": [
            # A bare number is in the unit of units[""] (seconds for durations): it must fit once converted.
            {"type": "integer", "minimum": 0, "maximum": MAX_VALUE // units[""]},
            # Any case; the value once converted must fit MAX_VALUE too (not expressible here).
            {"type": "string", "pattern": f"^[0-9]{{1,{_MAX_DIGITS}}}({suffixes})?$"},
        ],
        "description": what,
    }


def positive_schema(schema: dict[str, object]) -> dict[str, object]:
    """``schema`` (:data:`SIZE_SCHEMA` or :data:`DURATION_SCHEMA`) without zero: 0, "0m", "000s"."""
    integer, string = schema["anyOf"]  # type: ignore[misc]
    pattern = str(string["pattern"]).replace("^", "^(?=[0-9]*[1-9])", 1)
    return {**schema, "anyOf": [{**integer, "minimum": 1}, {**string, "pattern": pattern}]}


def at_most_schema(schema: dict[str, object], most: int) -> dict[str, object]:
    """``schema`` whose bare integers stop at ``most`` (in their own unit: bytes, or seconds).

    A string's value once converted cannot be bounded by a pattern (as with
    :data:`MAX_VALUE`); the check alone refuses those past the bound.
    """
    integer, string = schema["anyOf"]  # type: ignore[misc]
    return {**schema, "anyOf": [{**integer, "maximum": min(int(integer["maximum"]), most)}, string]}


#: JSON Schema of what :func:`parse_size` accepts.
SIZE_SCHEMA = _unit_schema(_SIZE_UNITS, "bytes, or a whole number with k, m, g or t (powers of 1024): 65536, 64k, 512m")
#: JSON Schema of what :func:`parse_duration_ms` accepts.
DURATION_SCHEMA = _unit_schema(_DURATION_UNITS_MS, "seconds, or a whole number with ms, s, m or h: 30, 250ms, 5s, 15m")


def parse_size(value: object) -> int:
    """Bytes for a size: a non-negative int, or a string like ``512m``."""
    return _parse(value, _SIZE_UNITS, "size", "k, m, g or t (powers of 1024)", "1536m")


def parse_duration_ms(value: object) -> int:
    """Milliseconds for a duration: a non-negative int of seconds, or a string like ``250ms``."""
    return _parse(value, _DURATION_UNITS_MS, "duration", "ms, s, m or h", "1500ms")


def format_size(value: int) -> str:
    """``value`` bytes as :func:`parse_size` reads it back, in the largest unit that divides it."""
    return _format(value, _SIZE_UNITS)


def format_duration_ms(value: int) -> str:
    """``value`` ms as :func:`parse_duration_ms` reads it back, in the largest unit that divides it."""
    return _format(value, {**_DURATION_UNITS_MS, "": 0})  # a bare number is seconds: always write "s"


def _format(value: int, units: dict[str, int]) -> str:
    for suffix, factor in sorted(units.items(), key=lambda item: item[1], reverse=True):
        if factor and value % factor == 0:
            return f"{value // factor}{suffix}"
    return str(value)


def _parse(value: object, units: dict[str, int], what: str, suffixes: str, example: str) -> int:
    # bool is an int subclass; True must not read as 1 byte or 1 second.
    if isinstance(value, bool):
        raise UnitError(f"expected a {what}, got a boolean")
    if isinstance(value, int):
        return _checked(value, units[""], repr(value), what)
    if isinstance(value, float):
        raise UnitError(f"expected a {what}, got the float {value!r}; use a whole number")
    if not isinstance(value, str):
        raise UnitError(f"expected a {what}, got {type(value).__name__}")
    text = value
    if not text:
        raise UnitError(f"empty string is not a {what}")
    if text != text.strip() or any(c.isspace() for c in text):
        raise UnitError(f"{shown(text)} is not a {what}: no spaces allowed")
    if text[0] in "+-":
        raise UnitError(f"{shown(text)} is not a {what}: no sign allowed")
    if not text.isascii():  # before lower(): the Kelvin sign (U+212A) lowercases to an ASCII k
        raise UnitError(f"{shown(text)} is not a {what}: expected digits then one of {suffixes}")
    match = _NUMBER.fullmatch(text.lower())
    if match is None:
        if "." in text or ("e" in text.lower() and any(c.isdigit() for c in text)):
            raise UnitError(
                f"{shown(text)} is not a {what}: whole numbers only (write e.g. {example!r})"
            )
        raise UnitError(f"{shown(text)} is not a {what}: expected digits then one of {suffixes}")
    digits, suffix = match.groups()
    if suffix not in units:
        raise UnitError(f"{shown(text)} is not a {what}: unknown unit {suffix!r}; use {suffixes}")
    if len(digits) > _MAX_DIGITS:
        raise UnitError(f"{shown(text)} is too large: at most {MAX_VALUE} once converted")
    return _checked(int(digits), units[suffix], shown(text), what)


def _checked(number: int, factor: int, label: str, what: str) -> int:
    if number < 0:
        raise UnitError(f"{label} is not a {what}: negative")
    result = number * factor
    if result > MAX_VALUE:
        raise UnitError(f"{label} is too large: at most {MAX_VALUE} once converted")
    return result
