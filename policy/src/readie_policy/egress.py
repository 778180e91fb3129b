"""Where a job's network may go: the ``allow_network`` destination grammar, the ceiling's
containment of a request's list, and the queries the enforcement asks (decision 35).

Pure: the standard library's ``ipaddress`` and nothing that touches a network. A destination is
one of (each optionally with ``:port``; IPv6 with a port in brackets, ``[2001:db8::1]:443``)::

    api.example.com     a name, exactly (ASCII letters, digits, hyphens; case-insensitive)
    *.example.com       any name strictly below example.com, not example.com itself
    203.0.113.7         an address, v4 or v6
    203.0.113.0/24      a network (strict: no host bits set)

Some addresses are denied whatever the list says (:data:`DEFAULT_DENIED`: private, loopback,
link-local with the cloud metadata endpoint, ...; and the worker's own, a runtime fact passed with
:meth:`Egress.for_worker`), unless the *ceiling* names them explicitly: a ceiling address or network
that lies inside a denied range opens exactly what it covers; a single-address ceiling entry opens
that address, the worker's own included. ``true`` never opens one, nor does a name: a name's DNS
answers that fall in denied space stay denied, so re-pointing an allowed name (rebinding) opens
nothing.
"""

from __future__ import annotations

import ipaddress
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from readie_protocol.errors import RequestError, shown
from readie_protocol.job_requests import MAX_DESTINATION_CHARS, MAX_DESTINATIONS

__all__ = [
    "DEFAULT_DENIED",
    "MAX_DESTINATIONS",
    "MAX_DESTINATION_CHARS",
    "Address",
    "Ceiling",
    "Destination",
    "Egress",
    "Network",
    "default_denied",
    "parse_destination",
    "parse_destinations",
    "resolve_egress",
]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
#: A ceiling's ``allow_network``: True (the public internet), False (none), a list, or None for
#: no ceiling at all (``NO_LIMITS``: the stdio pool's trusted client; see :func:`resolve_egress`).
Ceiling = bool | tuple["Destination", ...] | None

FIELD = "allow_network"
#: DNS: a label is at most 63 octets, a name at most 253 characters written without the final dot.
_MAX_LABEL = 63
_MAX_NAME = 253
_LABEL = re.compile(r"[a-z0-9](?:[a-z0-9-]*[a-z0-9])?", re.ASCII)
_PORT = re.compile(r"[1-9][0-9]{0,4}", re.ASCII)
_MAX_PORT = 65535
_GRAMMAR = "expected a name, *.suffix, an IP address or a CIDR, each optionally with :port"


def _net(text: str) -> Network:
    return ipaddress.ip_network(text)


#: Addresses no job reaches unless the ceiling names them (module docstring), each with why.
#: IPv4-mapped IPv6 addresses (::ffff:a.b.c.d) are checked as the IPv4 address they carry.
DEFAULT_DENIED: tuple[tuple[Network, str], ...] = (
    (_net("0.0.0.0/8"), "'this network': 0.0.0.0 reaches the host itself on Linux"),
    (_net("10.0.0.0/8"), "private (RFC 1918): the operator's own networks"),
    (_net("100.64.0.0/10"), "shared address space (RFC 6598): carrier NAT, and cloud internals (100.100.100.200)"),
    (_net("127.0.0.0/8"), "loopback: services of the host the sandbox runs on"),
    (_net("169.254.0.0/16"), "link-local: the cloud metadata endpoint 169.254.169.254 holds the VM's credentials"),
    (_net("172.16.0.0/12"), "private (RFC 1918)"),
    (_net("192.0.0.0/24"), "IETF protocol assignments (RFC 6890): transition and relay addresses"),
    (_net("168.63.129.16/32"), "Azure's platform address (WireServer): the VM agent's channel for its settings and certificates"),
    (_net("192.168.0.0/16"), "private (RFC 1918)"),
    (_net("198.18.0.0/15"), "benchmarking (RFC 2544): used for internal networks in practice"),
    (_net("224.0.0.0/4"), "multicast: a connection has one peer"),
    (_net("240.0.0.0/4"), "reserved, and 255.255.255.255 broadcast"),
    (_net("::/128"), "unspecified: reaches the host itself"),
    (_net("::1/128"), "loopback"),
    (_net("64:ff9b::/96"), "NAT64 (RFC 6052): carries an IPv4 address, a private one too"),
    (_net("64:ff9b:1::/48"), "local-use NAT64 (RFC 8215): carries an IPv4 address"),
    (_net("2002::/16"), "6to4: carries an IPv4 address, a private one too"),
    (_net("fc00::/7"), "unique local (RFC 4193): private"),
    (_net("fe80::/10"), "link-local"),
    (_net("fec0::/10"), "site-local (deprecated): private"),
    (_net("ff00::/8"), "multicast"),
)
_MAPPED = _net("::ffff:0:0/96")


def _unmapped_address(address: Address) -> Address:
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _unmapped_network(network: Network) -> Network:
    """An IPv6 network within ::ffff:0:0/96 as the IPv4 network it carries (one policy per address)."""
    if isinstance(network, ipaddress.IPv6Network) and network.subnet_of(_MAPPED):
        return ipaddress.IPv4Network((int(network.network_address) & 0xFFFFFFFF, network.prefixlen - 96))
    return network


def default_denied(address: Address) -> str | None:
    """Why ``address`` is denied by default (:data:`DEFAULT_DENIED`), or None when it is not."""
    address = _unmapped_address(address)
    for network, why in DEFAULT_DENIED:
        if address.version == network.version and address in network:
            return why
    return None


def _denied_network(network: Network) -> bool:
    """Whether every address of ``network`` lies in one default-denied range."""
    return any(network.version == denied.version and network.subnet_of(denied)  # type: ignore[arg-type]
               for denied, _ in DEFAULT_DENIED)


@dataclass(frozen=True, slots=True)
class Destination:
    """One parsed destination: a name (``wildcard``: strictly below it) or a network, and a port
    (None: every port). ``written`` is the entry as its author wrote it, for messages only: two
    entries that mean the same are equal."""

    written: str = field(compare=False)
    name: str | None = None
    wildcard: bool = False
    network: Network | None = None
    port: int | None = None

    def __str__(self) -> str:
        """The canonical form (lower-case, no trailing dot, networks compressed)."""
        if self.network is None:
            host = f"*.{self.name}" if self.wildcard else str(self.name)
        else:
            host = str(self.network.network_address) if _single(self.network) else str(self.network)
            if self.network.version == 6 and self.port is not None:
                host = f"[{host}]"
        return host if self.port is None else f"{host}:{self.port}"

    def names(self, name: str) -> bool:
        """Whether this entry allows the name ``name`` (lower-case, no trailing dot), any port."""
        if self.name is None:
            return False
        return name.endswith("." + self.name) if self.wildcard else name == self.name

    def reaches(self, address: Address, port: int) -> bool:
        """Whether this address entry covers ``address`` (unmapped) on ``port``."""
        return (self.network is not None and self.network.version == address.version
                and address in self.network and self._port(port))

    def covers(self, other: Destination) -> bool:
        """Whether everything ``other`` allows, this entry allows (as names and addresses)."""
        if self.port is not None and other.port != self.port:
            return False
        if self.network is not None:
            return (other.network is not None and other.network.version == self.network.version
                    and other.network.subnet_of(self.network))  # type: ignore[arg-type]
        if other.name is None or self.name is None:
            return False
        if self.wildcard:  # *.a.example.com and a.example.com alike, and itself
            return other.name.endswith("." + self.name) or (other.wildcard and other.name == self.name)
        return not other.wildcard and other.name == self.name

    @property
    def opens(self) -> bool:
        """Whether this entry, in a ceiling, names denied addresses explicitly (module docstring)."""
        return self.network is not None and (_denied_network(self.network) or _single(self.network))

    def _port(self, port: int) -> bool:
        return self.port is None or self.port == port


def _single(network: Network) -> bool:
    return network.prefixlen == network.max_prefixlen


def parse_destination(entry: object) -> Destination:
    """``entry`` as a :class:`Destination`, or RequestError(field ``allow_network``) quoting it."""
    if not isinstance(entry, str):
        raise RequestError(f"destinations are strings, got {type(entry).__name__}", FIELD)
    if len(entry) > MAX_DESTINATION_CHARS:
        raise RequestError(f"{shown(entry)} is longer than {MAX_DESTINATION_CHARS} characters", FIELD)
    try:
        host, port = _split_port(entry)
        return _host(entry, host, port)
    except ValueError as exc:
        raise RequestError(f"{shown(entry)} is not a destination: {exc}", FIELD) from None


def parse_destinations(entries: Iterable[object]) -> tuple[Destination, ...]:
    """A list of destinations, at most :data:`MAX_DESTINATIONS`; repeats (canonically) dropped."""
    entries = tuple(entries)
    if len(entries) > MAX_DESTINATIONS:
        raise RequestError(f"{len(entries)} destinations; at most {MAX_DESTINATIONS} are allowed", FIELD)
    parsed = {}
    for entry in entries:
        destination = parse_destination(entry)
        parsed.setdefault(str(destination), destination)
    return tuple(parsed.values())


def _split_port(entry: str) -> tuple[str, int | None]:
    if entry.startswith("["):
        inside, bracket, rest = entry[1:].partition("]")
        if not bracket or ":" not in inside:
            raise ValueError("brackets hold an IPv6 address or network")
        if not rest:
            raise ValueError("brackets are for an IPv6 address with a port: write it without them")
        if not rest.startswith(":"):
            raise ValueError(_GRAMMAR)
        return inside, _port(rest[1:])
    if entry.count(":") == 1:  # a name or IPv4 with a port; more colons: IPv6 without one
        host, _, port = entry.partition(":")
        return host, _port(port)
    return entry, None


def _port(text: str) -> int:
    if not _PORT.fullmatch(text) or int(text) > _MAX_PORT:
        raise ValueError(f"the port must be a number from 1 to {_MAX_PORT}")
    return int(text)


def _host(entry: str, host: str, port: int | None) -> Destination:
    if not host:
        raise ValueError(_GRAMMAR)
    if ":" in host or "/" in host or _looks_numeric(host):
        if "%" in host:
            raise ValueError("an IPv6 zone (%...) names an interface of the host, not a destination")
        try:
            network = ipaddress.ip_network(host, strict=True)
        except ValueError as exc:
            raise ValueError(f"not an IP address or CIDR ({exc})") from None
        return Destination(entry, network=_unmapped_network(network), port=port)
    if not host.isascii():  # before lower(): the Kelvin sign lowers to an ASCII k
        raise ValueError(f"{shown(host)} is not ASCII; write an internationalised name in its xn-- form")
    name = host.lower()
    wildcard = name.startswith("*.")
    if wildcard:
        name = name[2:]
    name = name[:-1] if name.endswith(".") else name
    _check_name(name)
    return Destination(entry, name=name, wildcard=wildcard, port=port)


def _looks_numeric(host: str) -> bool:
    """A host whose last label is a number is meant as an address (``010.0.0.1``, ``1.2.3``), never a
    name: no top-level domain is numeric, and resolvers would read such text as an address."""
    return host.rstrip(".").rpartition(".")[2].isdigit()


def _check_name(name: str) -> None:
    if not name or len(name) > _MAX_NAME:
        raise ValueError(f"a name is 1 to {_MAX_NAME} characters")
    for label in name.split("."):
        if "*" in label:
            raise ValueError("'*' may only be the whole first label: *.example.com")
        if len(label) > _MAX_LABEL or not _LABEL.fullmatch(label):
            raise ValueError(f"{shown(label)} is not a DNS label (ASCII letters, digits and inner hyphens, "
                             f"at most {_MAX_LABEL})")


@dataclass(frozen=True, slots=True)
class Egress:
    """A job's effective network policy: where its connections may go.

    ``destinations``: the entries it asked for (or its ceiling's, for ``true`` under a list);
    ``public``: the public internet (``true`` under a ``true`` ceiling, or no ceiling);
    ``opened``: the ceiling's entries that name denied addresses explicitly; ``own``: the worker's
    own addresses (:meth:`for_worker`), denied unless a single-address ceiling entry names one.
    """

    destinations: tuple[Destination, ...] = ()
    public: bool = False
    opened: tuple[Destination, ...] = ()
    own: frozenset[Address] = field(default_factory=frozenset)

    def for_worker(self, addresses: Iterable[Address]) -> Egress:
        """This policy on a worker whose own addresses are ``addresses``."""
        own = frozenset(_unmapped_address(a) for a in addresses)
        return Egress(self.destinations, self.public, self.opened, own)

    def allows_name(self, name: str) -> bool:
        """Whether ``name`` may be looked up (the resolver forwards only these), on some port."""
        return self.name_ports(name) != frozenset()

    def name_ports(self, name: str) -> frozenset[int] | None:
        """The ports a connection to ``name``'s answers may use: None for every port, empty for
        none (the name is not allowed). Under ``public``, every name, every port."""
        name = name.lower().removesuffix(".")
        if self.public:
            return None
        ports = set()
        for destination in self.destinations:
            if destination.names(name):
                if destination.port is None:
                    return None
                ports.add(destination.port)
        return frozenset(ports)

    def allows(self, address: Address, port: int, *, name: str | None = None) -> bool:
        """Whether a connection to ``address`` on ``port`` is allowed; ``name``: the allowed name
        whose answer ``address`` was (its answers count as listed, on the name's ports)."""
        address = _unmapped_address(address)
        if not self._listed(address, port, name):
            return False
        if address in self.own:
            return any(_single(o.network) and o.reaches(address, port)  # type: ignore[arg-type]
                       for o in self.opened)
        if default_denied(address) is not None:
            return any(o.reaches(address, port) for o in self.opened)
        return True

    def _listed(self, address: Address, port: int, name: str | None) -> bool:
        if self.public or any(d.reaches(address, port) for d in self.destinations):
            return True
        if name is None:
            return False
        ports = self.name_ports(name)
        return ports is None or port in ports


def resolve_egress(asked: bool | Sequence[Destination] | None, ceiling: Ceiling, origin: str = "") -> Egress | None:
    """The policy ``asked`` gets under ``ceiling`` (None: no network), or RequestError naming the
    first entry asked beyond it, as its author wrote it (``origin``: "(from profile ...)").

    ``true`` asks for what the ceiling allows: its list, or the public internet under ``true``.
    Without a ceiling (None) a list is taken as it is, and its own addresses and networks that name
    denied ones open them: the stdio pool's client started the pool and is its operator.
    """
    if not asked:
        return None
    if ceiling is not None and not ceiling:  # False, or an empty list
        raise RequestError("the pool's [pool.limits] do not allow the network" + origin, FIELD)
    if ceiling is None:
        if asked is True:
            return Egress(public=True)
        listed = tuple(asked)
        return Egress(listed, opened=tuple(d for d in listed if d.opens))
    if ceiling is True:
        if asked is True:
            return Egress(public=True)
        listed = tuple(asked)
        for destination in listed:
            if destination.network is not None and _denied_network(destination.network):
                raise _beyond(destination, origin, denied=True)
        return Egress(listed)
    opened = tuple(d for d in ceiling if d.opens)
    if asked is True:
        return Egress(ceiling, opened=opened)
    listed = tuple(asked)
    for destination in listed:
        if not any(theirs.covers(destination) for theirs in ceiling):
            raise _beyond(destination, origin)
        if (destination.network is not None and _denied_network(destination.network)
                and not any(theirs.covers(destination) for theirs in opened)):
            raise _beyond(destination, origin, denied=True)
    return Egress(listed, opened=opened)


def _beyond(destination: Destination, origin: str, *, denied: bool = False) -> RequestError:
    if denied:
        why = default_denied(destination.network.network_address)  # type: ignore[union-attr]
        return RequestError(f"{shown(destination.written)} is denied by default ({why}) unless the pool's "
                            f"[pool.limits] allow_network names it{origin}", FIELD)
    return RequestError(f"{shown(destination.written)} is not within the pool's [pool.limits] "
                        f"allow_network{origin}", FIELD)
