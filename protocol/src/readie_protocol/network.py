"""What a job's egress policy refused it (decision 35), as one value for every boundary.

The worker counts the connections its firewall refused and the lookups its
resolver refused for each networked sandbox, and puts a :class:`NetworkReport`
in the job's outcome; the gRPC wire carries it (``readie_rpc``), the pool
writes it in the result line (``"network"``) and a client reads it back into
:attr:`~readie_protocol.results.Result.network`. Every reading side rebuilds
it through :func:`network_report`, which holds it to what an honest worker
sends (a worker is a network peer, and the names and addresses come from the
sandbox's own traffic): at most :data:`MAX_REFUSED_REPORTED` destinations and
:data:`MAX_REFUSED_NAMES` names, IP literals, ports 1-65535, names of plain
printable text no longer than DNS allows. :class:`Invalid` says what is
wrong; the wire that read it names the error (``PoolWorkerError`` for a
worker's answer, ``PoolError`` for a result line).
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ._fields import Fields, broken, short
from ._values import Invalid

__all__ = [
    "MAX_ADDRESS_CHARS",
    "MAX_DNS_NAME_CHARS",
    "MAX_REFUSED_COUNT",
    "MAX_REFUSED_NAMES",
    "MAX_REFUSED_REPORTED",
    "NetworkReport",
    "RefusedConnection",
    "network_report",
    "parse_network",
]

#: Refused destinations (address and port) a result lists, and refused names: a result line
#: stays small (a few KiB however hard a job hammers denied addresses), and the worker keeps
#: these many per sandbox (its firewall's set holds more, and every refusal is counted in the
#: totals). A job that needs more than 32 refused destinations explained has a policy problem,
#: which the first 32 show.
MAX_REFUSED_REPORTED = 32
MAX_REFUSED_NAMES = 32
#: A DNS name in text, without its final dot: 253 characters (255 bytes on the wire, less the
#: first length octet and the root's). The resolver writes a name's odd bytes as ``\\DDD``, so
#: a worker cuts a longer text to this before reporting it.
MAX_DNS_NAME_CHARS = 253
#: The longest IP literal: an IPv6 address ending in an IPv4 one (INET6_ADDRSTRLEN less its NUL).
MAX_ADDRESS_CHARS = 45
#: What the gRPC wire carries for a count (uint32); a worker clamps a larger one.
MAX_REFUSED_COUNT = 2**32 - 1
# A name as the resolver writes it: printable ASCII, no space (the resolver escapes the rest).
_NAME_TEXT = re.compile(r"[\x21-\x7e]{1,%d}" % MAX_DNS_NAME_CHARS)


@dataclass(frozen=True, slots=True)
class RefusedConnection:
    """Connections to one destination the egress policy refused: the address and port the job
    tried, and how many times (packets the firewall turned away: one per refused TCP connect)."""

    address: str
    port: int
    count: int

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "port": self.port, "count": self.count}


@dataclass(frozen=True, slots=True)
class NetworkReport:
    """What the egress policy refused a networked job, or one session step (that step's only).

    ``refused_connections`` counts every refused connection; ``refused`` itemises the
    destinations, most refused first, at most :data:`MAX_REFUSED_REPORTED` (their counts add up
    to at most the total). ``refused_lookups`` counts the DNS lookups refused (a name not
    allowed, or one whose answers all lie in denied space); ``refused_names`` names the first
    :data:`MAX_REFUSED_NAMES` of those names. ``allowed_connections`` counts the new
    connections its policy let through. A job without the network has no report at all.
    """

    refused_connections: int = 0
    refused: tuple[RefusedConnection, ...] = ()
    refused_lookups: int = 0
    refused_names: tuple[str, ...] = ()
    allowed_connections: int = 0

    def to_json(self) -> dict[str, Any]:
        return {
            "refused_connections": self.refused_connections,
            "refused": [entry.to_json() for entry in self.refused],
            "refused_lookups": self.refused_lookups,
            "refused_names": list(self.refused_names),
            "allowed_connections": self.allowed_connections,
        }


def network_report(
    refused_connections: Any,
    refused: Sequence[Any],
    refused_lookups: Any,
    refused_names: Sequence[Any],
    allowed_connections: Any = 0,
    *,
    entry: Callable[[Any], tuple[Any, Any, Any]],
) -> NetworkReport:
    """A report rebuilt from a wire's fields, or :class:`Invalid` saying what no honest worker
    sends. ``entry`` takes one item of ``refused`` apart into its address, port and count; the
    lists' lengths are checked before any item is read."""
    if len(refused) > MAX_REFUSED_REPORTED:
        raise Invalid(f"lists {len(refused)} refused destinations; at most {MAX_REFUSED_REPORTED} are reported")
    if len(refused_names) > MAX_REFUSED_NAMES:
        raise Invalid(f"lists {len(refused_names)} refused names; at most {MAX_REFUSED_NAMES} are reported")
    total = _count("refused_connections", refused_connections, low=0)
    lookups = _count("refused_lookups", refused_lookups, low=0)
    entries = tuple(_refused(*entry(item)) for item in refused)
    if len({(item.address, item.port) for item in entries}) != len(entries):
        raise Invalid("lists a refused destination twice")
    if any(before.count < after.count for before, after in zip(entries, entries[1:])):
        raise Invalid("lists refused destinations out of order: the most refused come first")
    if sum(item.count for item in entries) > total:
        raise Invalid(f"lists more refused connections than its total of {total}")
    names = tuple(_name(name) for name in refused_names)
    if len(set(names)) != len(names):
        raise Invalid("lists a refused name twice")
    if len(names) > lookups:
        raise Invalid(f"names {len(names)} refused lookups but counts {lookups}")
    return NetworkReport(total, entries, lookups, names, _count("allowed_connections", allowed_connections, low=0))


def parse_network(fields: Fields) -> NetworkReport:
    """A result line's ``network``; a report no worker sends is a :class:`PoolError`."""
    refused = fields.get("refused", list)
    names = fields.get("refused_names", list)
    try:
        return network_report(
            fields.get("refused_connections", int), refused, fields.get("refused_lookups", int), names,
            fields.get("allowed_connections", int), entry=_json_entry,
        )
    except Invalid as exc:
        broken(f"a result's network {exc}")


def _json_entry(obj: Any) -> tuple[Any, Any, Any]:
    fields = Fields(obj, "a result's refused destination")
    return fields.get("address", str), fields.get("port", int), fields.get("count", int)


def _refused(address: Any, port: Any, count: Any) -> RefusedConnection:
    return RefusedConnection(_address(address), _count("a port", port, low=1, high=65535), _count("a count", count, low=1))


def _address(text: Any) -> str:
    """An IP literal, as Python writes it (one text per address); no zone, no name."""
    if not isinstance(text, str) or not 0 < len(text) <= MAX_ADDRESS_CHARS or "%" in text:
        raise Invalid(f"lists a refused address that is not an IP address: {short(text, 60)}")
    try:
        return str(ipaddress.ip_address(text))
    except ValueError:
        raise Invalid(f"lists a refused address that is not an IP address: {short(text, 60)}") from None


def _name(text: Any) -> str:
    if not isinstance(text, str) or not _NAME_TEXT.fullmatch(text):
        raise Invalid(f"lists a refused name that is no DNS name: {short(text, 60)}")
    return text


def _count(what: str, value: Any, *, low: int, high: int = MAX_REFUSED_COUNT) -> int:
    # JSON true is not the integer 1.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise Invalid(f"has {what} of {short(value, 60)}, not an integer from {low} to {high}")
    return value
