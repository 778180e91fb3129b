"""A sandbox's egress policy as its enforcement needs it (decision 36): :class:`NetRules`, made
from the policy layer's :class:`~readie_policy.egress.Egress` by :meth:`NetRules.of`, and turned
into one sandbox's nft rules (``sandbox_rules``) and the resolver's questions (``name_ports``,
``refuses``)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from dataclasses import dataclass

from readie_policy.egress import DEFAULT_DENIED, Egress

from . import _nft

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True)
class NetRules:
    """What enforcement needs of one sandbox's egress policy (built from the policy layer's Egress).

    ``networks`` and ``names`` are allowed, each with an optional port (None: every port); a
    name is exact or ``*.suffix`` (any name below the suffix). ``public`` allows any address
    not denied. ``denied`` (private, loopback, link-local...) and ``own`` (the worker's
    addresses) are refused first, even for an allowed network or a DNS answer, unless
    ``opened`` names them, on its port (None: every port) only. IPv6 entries are ignored: the
    sandbox has no IPv6.
    """

    networks: tuple[tuple[Network, int | None], ...] = ()
    names: tuple[tuple[str, int | None], ...] = ()
    public: bool = False
    denied: tuple[Network, ...] = ()
    opened: tuple[tuple[Network, int | None], ...] = ()
    own: tuple[Network, ...] = ()

    def __post_init__(self) -> None:
        # They reach nft batches as text: only values of these types, ports in range.
        for network, port in self.networks:
            if not isinstance(network, ipaddress.IPv4Network | ipaddress.IPv6Network):
                raise ValueError(f"egress network {network!r:.80} is not an ipaddress network")
            _check_port(port)
        for _, port in (*self.names, *self.opened):
            _check_port(port)
        for network in (*self.denied, *(net for net, _ in self.opened), *self.own):
            if not isinstance(network, ipaddress.IPv4Network | ipaddress.IPv6Network):
                raise ValueError(f"egress network {network!r:.80} is not an ipaddress network")

    @classmethod
    def of(cls, egress: Egress) -> NetRules:
        """The enforcement of the policy ``egress`` (made for this worker: ``Egress.for_worker``).

        The policy opens one of the worker's own addresses only by a single-address entry, while
        ``opened`` here un-denies whole networks: so own addresses not named alone are cut out of
        the opened networks, and stay refused."""
        named_alone = {o.network.network_address for o in egress.opened if o.network is not None and o.network.num_addresses == 1}
        own = [address for address in egress.own if address not in named_alone]
        opened = tuple((o.network, o.port) for o in egress.opened if o.network is not None)
        return cls(
            networks=tuple((d.network, d.port) for d in egress.destinations if d.network is not None),
            names=tuple((f"*.{d.name}" if d.wildcard else d.name, d.port) for d in egress.destinations if d.name is not None),
            public=egress.public,
            denied=tuple(network for network, _ in DEFAULT_DENIED),
            opened=_without(opened, own),
            own=tuple(ipaddress.ip_network(address) for address in own),
        )

    def name_ports(self, name: str) -> tuple[int | None, ...] | None:
        """The ports ``name`` may be reached on (None among them: every port), or None: not allowed."""
        if self.public:  # the public internet: every name, its answers on every port (denied ones refused)
            return (None,)
        name = name.lower().rstrip(".")
        ports = {port for pattern, port in self.names if _matches(pattern.lower().rstrip("."), name)}
        if not ports:
            return None
        return (None,) if None in ports else tuple(sorted(port for port in ports if port is not None))

    def refuses(self, address: Address) -> bool:
        """Whether ``address`` is denied (or the worker's) and opened on no port: a DNS answer
        cannot open it (one opened on some ports stays refused on the others, in the firewall)."""
        return any(address in net for net in (*self.denied, *self.own)) and not any(address in net for net, _ in self.opened)

    def sandbox_rules(self, key: str, veth: str, address: ipaddress.IPv4Address) -> _nft.SandboxRules:
        return _nft.SandboxRules(
            key=key,
            veth=veth,
            address=address,
            deny=_v4(self.denied) + _v4(self.own),
            opened=tuple((net, port) for net, port in self.opened if isinstance(net, ipaddress.IPv4Network)),
            allow=tuple((net, port) for net, port in self.networks if isinstance(net, ipaddress.IPv4Network)),
            public=self.public,
        )


def _without(
    networks: tuple[tuple[Network, int | None], ...], addresses: Iterable[Address],
) -> tuple[tuple[Network, int | None], ...]:
    """``networks`` (each with its port) with each of ``addresses`` cut out (each cut splits a
    network into at most 32 or 128 smaller ones; a worker has a handful of addresses)."""
    result = list(networks)
    for address in addresses:
        single = ipaddress.ip_network(address)
        cut: list[tuple[Network, int | None]] = []
        for network, port in result:
            if network.version == single.version and single.subnet_of(network):  # type: ignore[arg-type]
                cut.extend((piece, port) for piece in network.address_exclude(single))  # type: ignore[arg-type]
            else:
                cut.append((network, port))
        result = cut
    return tuple(result)


def _check_port(port: int | None) -> None:
    if port is not None and (isinstance(port, bool) or not isinstance(port, int) or not 1 <= port <= 65535):
        raise ValueError(f"egress port {port!r:.20} is not 1 to 65535")


def _matches(pattern: str, name: str) -> bool:
    """``*.example.com`` matches any name below example.com (not example.com itself); else exact."""
    if pattern.startswith("*."):
        return len(pattern) > 2 and name.endswith(pattern[1:])
    return name == pattern


def _v4(networks: Iterable[Network]) -> tuple[ipaddress.IPv4Network, ...]:
    return tuple(net for net in networks if isinstance(net, ipaddress.IPv4Network))
