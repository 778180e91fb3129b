"""The kinds of value a key of the pool's TOML file holds: each a check that reads the parsed value
(a :class:`ConfigError` naming the file and the dotted key when it refuses), the JSON Schema of
what it accepts, and its name in docs/config.md. ``config_keys`` names the keys that hold them.

A ceiling's ``timeout``, ``memory``, ``max_output``, ``collect_bytes``, ``collect_files`` and
``transfer_bytes`` past what any job can have are lowered with a warning; a profile's ``timeout``,
``memory`` and ``max_output`` past it are refused (:func:`_at_most`).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Iterable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import structlog
from readie_protocol.errors import ConfigError, RequestError, UnitError
from readie_protocol.job_requests import ALLOW_NETWORK_SCHEMA
from readie_protocol.requests import MAX_OUTPUT_BYTES, MAX_TIMEOUT_MS
from readie_protocol.units import (
    DURATION_SCHEMA,
    MAX_VALUE,
    SIZE_SCHEMA,
    at_most_schema,
    format_duration_ms,
    format_size,
    parse_duration_ms,
    parse_size,
    positive_schema,
)
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES

from .egress import Destination, parse_destinations
from .policy import Resolver, resolve_path
from .sandbox_memory import MAX_JOB_MEMORY

__all__ = [
    "one_of",
    "BOOLEAN",
    "CEILING_COLLECT_BYTES",
    "CEILING_COLLECT_FILES",
    "CEILING_MEMORY",
    "CEILING_OUTPUT",
    "CEILING_TIMEOUT",
    "CEILING_TRANSFER_BYTES",
    "EGRESS",
    "EGRESS_DNS",
    "COLLECT_BYTES_BOUND",
    "COLLECT_FILES_BOUND",
    "COUNT",
    "ENV",
    "JOB_MEMORY",
    "JOB_OUTPUT",
    "JOB_TIMEOUT",
    "LOG",
    "LOG_FORMATS",
    "MAX_EGRESS_DNS",
    "MEMORY_BOUND",
    "NETNS_NAME",
    "NETNS_NAME_PATTERN",
    "MODULES",
    "OUTPUT_BOUND",
    "PATH",
    "PATHS",
    "POSITIVE_DURATION",
    "DURATION",
    "POSITIVE_SIZE",
    "SIZE",
    "TIMEOUT_BOUND",
    "TRANSFER_BYTES_BOUND",
    "Reading",
    "ValueKind",
    "integer",
    "toml_type",
]

log = structlog.get_logger("readie.config")

#: ``json`` writes JSON logs and one line per finished job to stderr;
#: ``console`` readable logs and no job lines (``none`` is its first name, kept).
LOG_FORMATS = frozenset({"console", "json", "none"})

#: ``[pool] egress_dns``: upstream resolvers, at most glibc's MAXNS. readie's resolver asks them in
#: turn, each for up to 2 s (``readie_worker._resolver.UPSTREAM_TIMEOUT_S``), and the job's own
#: resolver waits 5 s for an answer: a fourth would be asked only after the job gave up on the query.
MAX_EGRESS_DNS = 3
#: ``[pool] egress_netns``: a network namespace's name as ``ip netns`` keeps it (a file in
#: /run/netns), which readie puts in paths, ip(8) lines and nft batches: nothing but a plain name,
#: never ``.`` or ``..``. The rule of ``readie_worker.egress_net.EgressConfig``, which checks it
#: again as the worker opens the namespace (a test holds the two to the same answers).
NETNS_NAME_PATTERN = r"(?!\.\.?$)[A-Za-z0-9_.-]{1,64}"
# An IPv4 address as ``ipaddress.IPv4Address`` reads one: four decimal octets, no leading zeros.
_OCTET = "(25[0-5]|2[0-4][0-9]|1[0-9][0-9]|[1-9]?[0-9])"
_IPV4_PATTERN = f"^{_OCTET}(\\.{_OCTET}){{3}}$"

_NO_NUL = "^[^\\u0000]*$"
_MODULE_PART = "[A-Za-z_][A-Za-z0-9_]*"  # an ASCII identifier, what str.isidentifier() accepts in ASCII


@dataclass(frozen=True, slots=True)
class Reading:
    """Where values are read from: errors name ``source`` (a file, or the command line) and
    the dotted key; relative paths resolve against ``base``, through ``resolve``."""

    source: str
    base: Path
    resolve: Resolver

    def fail(self, key: str | None, reason: str) -> ConfigError:
        return ConfigError(self.source, key, reason)


@dataclass(frozen=True, slots=True)
class ValueKind:
    """A kind of value: its check, ``read(reading, dotted_key, raw) -> parsed`` (a ConfigError
    when refused), the JSON Schema of what the check accepts, and its name in docs/config.md."""

    read: Callable[[Reading, str, Any], Any]
    schema: dict[str, Any]
    shown: str


# --------------------------------------------------------------------------- values


def toml_type(value: Any) -> str:
    names = {bool: "a boolean", int: "an integer", float: "a float", str: "a string", list: "an array", dict: "a table"}
    return names.get(type(value), type(value).__name__)


def integer(low: int, high: int) -> ValueKind:
    def read(at: Reading, key: str, value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise at.fail(key, f"expected an integer, got {toml_type(value)}")
        if not low <= value <= high:
            raise at.fail(key, f"must be from {low} to {high}, got {value}")
        return value

    return ValueKind(read, {"type": "integer", "minimum": low, "maximum": high}, f"integer, {low} to {high}")


def _boolean(at: Reading, key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise at.fail(key, f"expected true or false, got {toml_type(value)}")
    return value


def _string(at: Reading, key: str, value: Any) -> str:
    if not isinstance(value, str):
        raise at.fail(key, f"expected a string, got {toml_type(value)}")
    if not value:
        raise at.fail(key, "must not be empty")
    if "\x00" in value:
        raise at.fail(key, "contains a NUL character")
    return value


_STRING_SCHEMA = {"type": "string", "minLength": 1, "pattern": _NO_NUL}


def _strings(at: Reading, key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, list):
        raise at.fail(key, f"expected an array of strings, got {toml_type(value)}")
    return tuple(_string(at, f"{key}[{i}]", item) for i, item in enumerate(value))


def _modules(at: Reading, key: str, value: Any) -> tuple[str, ...]:
    names = _strings(at, key, value)
    for i, name in enumerate(names):
        if not all(part.isascii() and part.isidentifier() for part in name.split(".")):
            raise at.fail(f"{key}[{i}]", f"{name!r} is not a module name")
    return tuple(dict.fromkeys(names))


def _paths(at: Reading, key: str, value: Any) -> tuple[Path, ...]:
    resolved = []
    for i, text in enumerate(_strings(at, key, value)):
        try:
            resolved.append(resolve_path(text, at.base, at.resolve))
        except (OSError, ValueError) as exc:
            raise at.fail(f"{key}[{i}]", f"cannot resolve {text!r}: {exc}") from None
    return tuple(dict.fromkeys(resolved))


def _env(at: Reading, key: str, value: Any) -> tuple[tuple[str, str], ...]:
    if not isinstance(value, dict):
        raise at.fail(key, f"expected a table of strings, got {toml_type(value)}")
    pairs = []
    for name, item in value.items():
        if not name or "=" in name or "\x00" in name:
            raise at.fail(f"{key}.{name}", "not a variable name (empty, '=' or NUL)")
        if not isinstance(item, str) or "\x00" in item:
            raise at.fail(f"{key}.{name}", f"expected a string without NUL, got {toml_type(item)}")
        pairs.append((name, item))
    return tuple(pairs)


def one_of(names: Iterable[str]) -> ValueKind:
    """A string that is one of ``names``."""
    choices = sorted(names)

    def read(at: Reading, key: str, value: Any) -> str:
        text = _string(at, key, value)
        if text not in choices:
            raise at.fail(key, f"expected one of {', '.join(choices)}, got {text!r}")
        return text

    return ValueKind(read, {"type": "string", "enum": choices}, " or ".join(f'`"{name}"`' for name in choices))


_NETNS_NAME = re.compile(NETNS_NAME_PATTERN)


def _netns_name(at: Reading, key: str, value: Any) -> str:
    text = _string(at, key, value)
    if not _NETNS_NAME.fullmatch(text):
        raise at.fail(key, f"{text[:80]!r} is not a network namespace's name: 1 to 64 ASCII letters, "
                      "digits, '.', '_' or '-', not . or ..")
    return text


def _ipv4_addresses(at: Reading, key: str, value: Any) -> tuple[str, ...]:
    """``egress_dns``: 1 to :data:`MAX_EGRESS_DNS` IPv4 addresses, in the order they are asked."""
    addresses = _strings(at, key, value)
    if not addresses:
        raise at.fail(key, "names no resolver (leave it out for the host's /etc/resolv.conf)")
    if len(addresses) > MAX_EGRESS_DNS:
        raise at.fail(key, f"{len(addresses)} resolvers, at most {MAX_EGRESS_DNS}: they are asked in turn, "
                      "and a job's own lookup gives up before a fourth would be asked")
    for i, text in enumerate(addresses):
        try:
            ipaddress.IPv4Address(text)
        except ValueError:
            raise at.fail(f"{key}[{i}]", f"{text[:80]!r} is not an IPv4 address") from None
    return tuple(dict.fromkeys(addresses))


def _path(at: Reading, key: str, value: Any) -> Path:
    text = _string(at, key, value)
    try:
        return resolve_path(text, at.base, at.resolve)
    except (OSError, ValueError) as exc:
        raise at.fail(key, f"cannot resolve {text!r}: {exc}") from None


def _unit(parse: Callable[[Any], int], schema: dict[str, Any], shown: str, *, allow_zero: bool) -> ValueKind:
    def read(at: Reading, key: str, value: Any) -> int:
        try:
            result = parse(value)
        except UnitError as exc:
            raise at.fail(key, str(exc)) from None
        if result == 0 and not allow_zero:
            raise at.fail(key, "must be greater than zero")
        return result

    return ValueKind(read, dict(schema if allow_zero else positive_schema(schema)), shown)


@dataclass(frozen=True, slots=True)
class _Bound:
    """The most any job can have of a limit, as a number, as the docs write it, and why."""

    most: int
    bare: int  # what a bare TOML integer counts, for the schema: 1000 ms (seconds) or 1 byte
    written: str
    why: str


def _at_most(base: ValueKind, bound: _Bound, *, lower: bool) -> ValueKind:
    """``base`` held to ``bound``, past which a value could serve no job. ``lower``: it is a
    ceiling, lowered to the bound with a warning (it then admits exactly the requests that could
    run); else it is given to jobs, and refused (every job given it would fail)."""

    def read(at: Reading, key: str, value: Any) -> int:
        result = base.read(at, key, value)
        if result <= bound.most:
            return result
        if not lower:
            raise at.fail(key, f"too large: at most {bound.written} ({bound.why})")
        log.warning("config value lowered", file=at.source, key=key, given=value, used=bound.written, reason=bound.why)
        return bound.most

    schema = base.schema if lower else at_most_schema(base.schema, bound.most // bound.bare)
    return ValueKind(read, schema, f"{base.shown}, at most {bound.written} (more is {'lowered' if lower else 'refused'})")


def _egress(at: Reading, key: str, value: Any) -> bool | tuple[Destination, ...]:
    """``allow_network``: true, false or destinations (``egress``); an empty list is false."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, list):
        raise at.fail(key, f"expected true, false or an array of destinations, got {toml_type(value)}")
    try:
        return parse_destinations(value) or False
    except RequestError as exc:
        raise at.fail(key, exc.reason) from None


BOOLEAN = ValueKind(_boolean, {"type": "boolean"}, "boolean")
EGRESS = ValueKind(_egress, dict(ALLOW_NETWORK_SCHEMA), "boolean or array of destinations")
PATHS = ValueKind(_paths, {"type": "array", "items": _STRING_SCHEMA}, "array of paths")
MODULES = ValueKind(
    _modules,
    {"type": "array", "items": {"type": "string", "pattern": f"^{_MODULE_PART}(\\.{_MODULE_PART})*$"}},
    "array of module names",
)
ENV = ValueKind(
    _env,
    {
        "type": "object",
        "propertyNames": {"minLength": 1, "pattern": "^[^=\\u0000]*$"},
        "additionalProperties": {"type": "string", "pattern": _NO_NUL},
    },
    "table of strings",
)
LOG = one_of(LOG_FORMATS)
NETNS_NAME = ValueKind(_netns_name, {"type": "string", "pattern": f"^{NETNS_NAME_PATTERN}$"}, "network namespace name")
EGRESS_DNS = ValueKind(
    _ipv4_addresses,
    {"type": "array", "minItems": 1, "maxItems": MAX_EGRESS_DNS, "items": {"type": "string", "pattern": _IPV4_PATTERN}},
    f"array of 1 to {MAX_EGRESS_DNS} IPv4 addresses",
)
PATH = ValueKind(_path, dict(_STRING_SCHEMA), "path")
SIZE = _unit(parse_size, SIZE_SCHEMA, "size", allow_zero=True)
POSITIVE_SIZE = _unit(parse_size, SIZE_SCHEMA, "size, not 0", allow_zero=False)
POSITIVE_DURATION = _unit(parse_duration_ms, DURATION_SCHEMA, "duration, not 0", allow_zero=False)
DURATION = _unit(parse_duration_ms, DURATION_SCHEMA, "duration, 0 for never", allow_zero=True)
COUNT = replace(integer(0, MAX_VALUE), shown="integer, 0 or more")
TIMEOUT_BOUND = _Bound(MAX_TIMEOUT_MS, 1000, format_duration_ms(MAX_TIMEOUT_MS), "the longest timeout a job may have")
MEMORY_BOUND = _Bound(MAX_JOB_MEMORY, 1, format_size(MAX_JOB_MEMORY), "the most memory a sandbox can give a job")
OUTPUT_BOUND = _Bound(MAX_OUTPUT_BYTES, 1, format_size(MAX_OUTPUT_BYTES), "the most output a sandbox captures")
COLLECT_BYTES_BOUND = _Bound(MAX_COLLECTED_BYTES, 1, format_size(MAX_COLLECTED_BYTES),
                             "the most a result brings back, held whole by the pool and its client")
COLLECT_FILES_BOUND = _Bound(MAX_COLLECTED_FILES, 1, str(MAX_COLLECTED_FILES), "the most files a result brings back")
TRANSFER_BYTES_BOUND = _Bound(MAX_TRANSFER_BYTES, 1, format_size(MAX_TRANSFER_BYTES),
                              "the largest file a session's upload or download moves")
CEILING_TIMEOUT = _at_most(POSITIVE_DURATION, TIMEOUT_BOUND, lower=True)
CEILING_MEMORY = _at_most(POSITIVE_SIZE, MEMORY_BOUND, lower=True)
CEILING_OUTPUT = _at_most(SIZE, OUTPUT_BOUND, lower=True)
# 0 is allowed: nothing comes back, or no file moves, which an operator may want.
CEILING_COLLECT_BYTES = _at_most(SIZE, COLLECT_BYTES_BOUND, lower=True)
CEILING_COLLECT_FILES = _at_most(COUNT, COLLECT_FILES_BOUND, lower=True)
CEILING_TRANSFER_BYTES = _at_most(SIZE, TRANSFER_BYTES_BOUND, lower=True)
JOB_TIMEOUT = _at_most(POSITIVE_DURATION, TIMEOUT_BOUND, lower=False)
JOB_MEMORY = _at_most(POSITIVE_SIZE, MEMORY_BOUND, lower=False)
JOB_OUTPUT = _at_most(SIZE, OUTPUT_BOUND, lower=False)
