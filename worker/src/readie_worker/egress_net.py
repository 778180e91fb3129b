"""Egress enforcement for networked sandboxes (issue 32; docs/decisions/0036-egress-enforcement.md).

Each networked sandbox gets a network namespace of its own (runsc moves its address and routes
into netstack for good: one per sandbox), IPv6 off, and a veth into ``egress_netns``, the
namespace that stands for the outside world. There, readie's nftables table decides every new
connection by the sandbox's :class:`NetRules` (deny first, reject never drop), the resolver
readie runs answers only allowed names, and traffic leaves masqueraded. :class:`EgressGateway` is the
per-worker part (table, resolver, address pool); :class:`SandboxNetwork` one sandbox's wiring.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import re
import secrets
import threading
from dataclasses import dataclass, field
from pathlib import Path

import structlog

from readie_policy.config_values import NETNS_NAME_PATTERN
from readie_protocol.network import (
    MAX_DNS_NAME_CHARS, MAX_REFUSED_COUNT, MAX_REFUSED_NAMES, MAX_REFUSED_REPORTED, NetworkReport, RefusedConnection,
)

from . import _netns, _nft
from ._net_rules import NetRules
from ._resolver import Resolver
from .errors import ConfigError, SandboxSetupError
from .runsc import Runsc

log = structlog.get_logger("readie.egress")


# The sandboxes' /30s come from here unless the operator names another pool. 198.18.0.0/15 is
# reserved for benchmarking (RFC 2544): no real network routes it, so a /30 of ours never hides
# a destination in the egress netns; NAT hides these addresses from everything beyond.
DEFAULT_POOL = ipaddress.IPv4Network("198.18.0.0/16")
# Sandboxes wired at once per worker: far above a worker's slots plus warm sandboxes, and it
# bounds the netns, veths and nft chains a runaway caller could make.
MAX_SANDBOXES_WIRED = 1024
# Names: the sandbox netns is "<prefix>-<key>", its veth in the egress netns "<prefix>v<key>"
# (an interface name has at most 15 bytes: 4 + 1 + 8 hex).
DEFAULT_PREFIX = "rdie"
KEY_HEX = 4
# runsc 0.0~20240729 refuses --network=sandbox when /proc/sys/net/core/rmem_default exists, its
# test for "the root network namespace"; on kernel 6.x that file exists in every one. So runsc
# runs in a mount namespace of its own with an empty read-only tmpfs over /proc/sys/net, which it
# needs for nothing else (lab §0; docs/decisions/0036). Re-check on a runsc upgrade.
HIDE_NET_SYSCTLS = (
    "unshare", "--mount", "--propagation", "private", "sh", "-c",
    'mount -t tmpfs -o ro,size=4k readie-no-net-sysctls /proc/sys/net && exec "$@"', "sh",
)


def with_sandbox_network(runsc: Runsc) -> Runsc:
    """``runsc`` with gVisor's own network stack on the interfaces of the namespace the spec names
    (``SandboxSpec.network_namespace``): an image captured with ``--network=none`` restores so."""
    flags = tuple("--network=sandbox" if flag.startswith("--network") else flag for flag in runsc.flags)
    return dataclasses.replace(runsc, flags=flags, prefix=HIDE_NET_SYSCTLS)


@dataclass(frozen=True)
class Refusal:
    """Connections a sandbox was refused to one destination."""

    address: str
    port: int
    count: int


@dataclass(frozen=True)
class _Told:
    """What a sandbox's last report counted: the next one tells only what came since."""

    connections: dict[tuple[str, int], int] = field(default_factory=dict)
    lookups: int = 0
    names: dict[str, int] = field(default_factory=dict)
    allowed: int = 0
    refusals: int = 0


class Subnets:
    """The /30s of a pool, handed out one per sandbox; safe across threads."""

    def __init__(self, pool: ipaddress.IPv4Network, limit: int = MAX_SANDBOXES_WIRED) -> None:
        if pool.prefixlen > 30:
            raise ValueError(f"egress pool {pool} is smaller than one /30")
        self.pool = pool
        self._capacity = min(limit, pool.num_addresses // 4)
        self._used: set[int] = set()
        self._next = 0
        self._lock = threading.Lock()

    def take(self) -> ipaddress.IPv4Network:
        """The next free /30 after the last one taken: an address comes back as late as it can,
        long after the conntrack entries of its last sandbox expired."""
        with self._lock:
            order = (self._next + i for i in range(self._capacity))
            index = next((i % self._capacity for i in order if i % self._capacity not in self._used), None)
            if index is None:
                raise SandboxSetupError(f"all {self._capacity} networked sandbox slots of {self.pool} are wired")
            self._used.add(index)
            self._next = index + 1
        return ipaddress.IPv4Network((int(self.pool.network_address) + 4 * index, 30))

    def give_back(self, subnet: ipaddress.IPv4Network) -> None:
        with self._lock:
            self._used.discard((int(subnet.network_address) - int(self.pool.network_address)) // 4)

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._used)


_NETNS_NAME = re.compile(NETNS_NAME_PATTERN)  # the config's rule, one definition
_NFT_NAME = re.compile(r"[a-z][a-z0-9_]{0,31}")
# A prefix leaves room for "v" and the key in a 15-byte interface name.
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,5}")


@dataclass(frozen=True)
class EgressConfig:
    """The operator's settings: ``netns`` is ``[pool] egress_netns``, ``upstreams`` ``[pool] egress_dns``.

    ``netns`` is required: never the host's own namespace by default, whose ``ip_forward`` this
    module turns on (host-wide) and whose firewall reloads (``flush ruleset``) would remove
    readie's table while the sandboxes' veths stay up (decision 36, review fixes)."""

    netns: str
    upstreams: tuple[str, ...] = field(default_factory=lambda: host_nameservers())
    pool: ipaddress.IPv4Network = DEFAULT_POOL
    table: str = "readie"  # one worker per egress netns and table (decision 36)
    prefix: str = DEFAULT_PREFIX
    # ``netns`` names the starting thread's own namespace, named at start and unnamed at close: a
    # container's or pod's, whose way out is its own (``--egress-own-netns``). Never on a host.
    own: bool = False

    def __post_init__(self) -> None:
        # Every one of these ends up in a path, an ip(8) line or an nft batch: nothing but a plain name.
        if self.netns is None:
            raise ConfigError("egress_netns", None, "required: the network namespace readie forwards sandboxes through, never the host's own")
        if not isinstance(self.netns, str) or not _NETNS_NAME.fullmatch(self.netns):
            raise ConfigError("egress_netns", None, f"{str(self.netns)[:80]!r} is not a network namespace's name (letters, digits, . _ -)")
        if not _NFT_NAME.fullmatch(self.table) or not _PREFIX.fullmatch(self.prefix):
            raise ConfigError("egress", None, f"table {self.table[:80]!r} or prefix {self.prefix[:80]!r}: a short lowercase name")
        if self.pool.prefixlen > 30:
            raise ConfigError("egress pool", None, f"{self.pool} is smaller than one /30")
        for upstream in self.upstreams:
            try:
                ipaddress.IPv4Address(upstream)
            except ValueError:
                raise ConfigError("egress_dns", None, f"{upstream[:80]!r} is not an IPv4 address") from None


def host_nameservers(resolv_conf: Path = Path("/etc/resolv.conf")) -> tuple[str, ...]:
    """The IPv4 ``nameserver`` lines of ``resolv_conf`` (the default ``egress_dns``)."""
    found = []
    try:
        lines = resolv_conf.read_text(errors="replace").splitlines()[:1000]
    except OSError:
        return ()
    for line in lines:
        words = line.split()
        if len(words) >= 2 and words[0] == "nameserver":
            try:
                found.append(str(ipaddress.IPv4Address(words[1])))
            except ValueError:
                continue
    return tuple(found)


class EgressGateway:
    """One worker's egress wiring: readie's table in ``config.netns``, the resolver, the /30s."""

    def __init__(self, config: EgressConfig) -> None:
        self.config = config
        self.subnets = Subnets(config.pool)
        self._wired: dict[str, SandboxNetwork] = {}
        self._lock = threading.Lock()
        self.resolver: Resolver | None = None
        self._nft: _nft.Nft | None = None  # opened in config.netns at start
        self._netns_identity: tuple[int, int] | None = None
        self._named = False  # config.own: this gateway gave its namespace the name, and takes it back

    def start(self) -> EgressGateway:
        """Sweep what an earlier run left, then make the table, forwarding and the resolver."""
        if self.config.own:
            self._named = _netns.attach_own(self.config.netns)
        try:
            return self._start()
        except BaseException:
            self._unname()
            raise

    def _start(self) -> EgressGateway:
        if not _netns.present(self.config.netns):
            raise ConfigError("egress_netns", None, f"no network namespace named {self.config.netns!r}")
        # The firewall's context and the resolver's sockets stay in the namespace as it is now; one
        # made again under the name later would get veths and no rules (wire refuses then).
        self._netns_identity = _netns.identity(self.config.netns)
        self._nft = _nft.Nft(self.config.netns)
        self.sweep()
        _netns.write_sysctls(self.config.netns, {"ipv4/ip_forward": "1"})
        self.nft(_nft.base_batch(self.config.table, self.config.pool, self.config.prefix + "v", sole=self.config.own))
        self.resolver = Resolver(self.config.netns, self.config.upstreams)
        return self

    def wire(self, rules: NetRules) -> SandboxNetwork:
        """A fresh network namespace, wired by ``rules``, for one sandbox to restore into."""
        if self.resolver is None:
            raise SandboxSetupError("egress is not started")
        if _netns.identity(self.config.netns) != self._netns_identity:
            raise SandboxSetupError("the egress namespace was made again since the worker started: "
                                    "no sandbox is wired into it until the worker restarts")
        with self._lock:
            # Not 0: it is the conntrack mark of its connections, and 0 is no mark. Not a key in use
            # (one in 2^32 a wiring, but a failed wiring removes what its names name: that sandbox's).
            key = secrets.token_hex(KEY_HEX)
            while int(key, 16) == 0 or key in self._wired or _netns.present(f"{self.config.prefix}-{key}"):
                key = secrets.token_hex(KEY_HEX)
            network = SandboxNetwork(self, key, self.subnets.take(), rules)
            self._wired[network.key] = network
        try:
            network._create()
        except BaseException:
            try:
                network.remove()
            except SandboxSetupError as exc:  # the first failure is the one to tell; sweep() gets the rest
                log.error("sandbox network not removed after a failed wiring", key=network.key, error=str(exc))
            raise
        return network

    @property
    def wired(self) -> int:
        with self._lock:
            return len(self._wired)

    def sweep(self) -> None:
        """Remove every namespace and veth named with readie's prefix, and readie's table."""
        prefix = self.config.prefix
        ours = re.compile(rf"{re.escape(prefix)}-[0-9a-f]{{{2 * KEY_HEX}}}")  # never the egress netns itself
        stale = [name for name in _netns.names() if ours.fullmatch(name) and name != self.config.netns]
        veths = _netns.links(self.config.netns, prefix + "v")
        if veths:  # the veths first: `ip netns delete` is asynchronous, a veth delete is not
            _netns.ip_batch(self.config.netns, [f"link delete {veth}" for veth in veths], check=False)
        if stale:
            _netns.ip_batch(None, [f"netns delete {name}" for name in stale], check=False)
        if stale or veths:
            log.warning("swept egress wiring an earlier run left", namespaces=len(stale), veths=len(veths))
        self.nft(_nft.remove_table_batch(self.config.table))

    def nft(self, commands: str) -> str:
        """Run nft ``commands`` in the egress namespace (in process: ``_nft.Nft``); what they printed."""
        if self._nft is None:
            raise SandboxSetupError("egress is not started")
        return self._nft.run(commands)

    def close(self) -> None:
        """Remove every sandbox's wiring, the table and the resolver."""
        with self._lock:
            wired = list(self._wired.values())
        for network in wired:
            try:
                network.remove()
            except SandboxSetupError as exc:  # the rest is removed all the same; sweep() gets it next start
                log.error("sandbox network not removed", key=network.key, error=str(exc))
        if self.resolver is not None:
            self.resolver.close()
            self.resolver = None
        try:
            if self._nft is not None:
                self.nft(_nft.remove_table_batch(self.config.table))
                self._nft.close()
                self._nft = None
        finally:
            self._unname()

    def _unname(self) -> None:
        """Take back the name start gave the worker's own namespace, if it still names that one."""
        if not self._named:
            return
        self._named = False
        try:
            ours = self._netns_identity is None or _netns.identity(self.config.netns) == self._netns_identity
        except SandboxSetupError:  # gone already
            return
        if ours:  # the name only: the namespace is the worker's own and goes with it
            _netns.ip_batch(None, [f"netns delete {self.config.netns}"], check=False)

    def _forget(self, network: SandboxNetwork) -> None:
        with self._lock:
            self._wired.pop(network.key, None)
        self.subnets.give_back(network.subnet)


class SandboxNetwork:
    """One sandbox's network: its namespace, veth, /30, nft chain and sets, and resolver listener."""

    def __init__(self, egress: EgressGateway, key: str, subnet: ipaddress.IPv4Network, rules: NetRules) -> None:
        self.egress = egress
        self.key = key
        self.subnet = subnet
        self.rules = rules
        prefix = egress.config.prefix
        self.netns = f"{prefix}-{key}"
        self.veth = f"{prefix}v{key}"
        self.gateway, self.address = subnet.network_address + 1, subnet.network_address + 2
        self._removed = False
        # What the last report told: the next one (a session's next step) tells only what is new.
        self._told = _Told()

    @property
    def netns_path(self) -> Path:
        """What the sandbox's OCI spec names as its network namespace."""
        return _netns.NETNS_DIR / self.netns

    def _create(self) -> None:
        egress, config = self.egress.config.netns, self.egress.config
        # Not under `ip -n`: it runs in a mount namespace of its own, where a new netns's bind
        # mount would stay invisible to everyone else.
        _netns.ip_batch(None, [
            f"netns add {self.netns}",
            f"link add {self.veth} netns {egress} type veth peer name eth0 netns {self.netns}",
        ])
        # Before eth0 is up and before runsc copies the netns into netstack: runsc would copy the
        # link-local IPv6 address too, and a sandbox could reach [::] listeners of the egress netns.
        _netns.write_sysctls(self.netns, {
            "ipv6/conf/all/disable_ipv6": "1", "ipv6/conf/default/disable_ipv6": "1", "ipv6/conf/eth0/disable_ipv6": "1",
        })
        _netns.ip_batch(egress, [f"addr add {self.gateway}/30 dev {self.veth}", f"link set {self.veth} up"])
        _netns.ip_batch(self.netns, [
            "link set lo up",
            f"addr add {self.address}/30 dev eth0",
            "link set eth0 up",
            f"route add default via {self.gateway}",
        ])
        self.egress.nft(_nft.sandbox_batch(config.table, self.rules.sandbox_rules(self.key, self.veth, self.address)))
        resolver = self.egress.resolver
        if resolver is None:
            raise SandboxSetupError("egress was closed while a sandbox network was being wired")
        # Through self.rules as it is at each query: a warm sandbox's rules change at hand-out (rerule).
        resolver.serve(self.key, self.gateway, lambda name: self.rules.name_ports(name),
                       lambda address: self.rules.refuses(address), self._open_answered)
        log.debug("sandbox network wired", key=self.key, address=str(self.address))

    def _open_answered(self, addresses: list[ipaddress.IPv4Address], ports: tuple[int | None, ...], ttl: int) -> None:
        if self.rules.public:  # every address not denied is open on every port already: nothing to add
            return
        self.egress.nft(_nft.answered_batch(self.egress.config.table, self.key, addresses, ports, ttl))

    def refused(self, limit: int = MAX_REFUSED_REPORTED) -> list[Refusal]:
        """The destinations refused so far, most refused first, at most ``limit``."""
        return self._counted()[0][:limit]

    def rerule(self, rules: NetRules) -> None:
        """Give this wired sandbox (a warm one, at hand-out) ``rules`` instead of its own, in one
        atomic nft batch; what it was refused or answered before is forgotten, and its next
        report starts from here."""
        config = self.egress.config
        self.egress.nft(_nft.rerule_batch(config.table, rules.sandbox_rules(self.key, self.veth, self.address)))
        self.rules = rules
        lookups, names = self.refused_lookups()  # the resolver's counts go on: from here
        self._told = _Told(lookups=lookups, names=names)

    def _counted(self) -> tuple[list[Refusal], int, int]:
        """What it was refused so far (its refused set: the first ``REFUSED_SET_SIZE``
        destinations), the new connections let through and every refused attempt (TCP and UDP
        packets, listed or not), in one nft run: a listing costs 0.1-0.6 ms, most of it nft's
        cache, which one run fetches once."""
        t, key = self.egress.config.table, self.key
        listed = _nft.documents(self.egress.nft(
            f"list set inet {t} refused_{key}\nlist counter inet {t} allowed_{key}\nlist counter inet {t} refusals_{key}"))
        if len(listed) != 3:
            raise SandboxSetupError(f"nft printed {len(listed)} listings for a sandbox's three")
        refused = [Refusal(address, port, count) for address, port, count in _nft.parse_refused(listed[0])]
        return refused, _nft.parse_counter(listed[1]), _nft.parse_counter(listed[2])

    def report(self) -> NetworkReport:
        """What was refused since the last report (a job's whole life, or one session step's):
        connection attempts (packets refused, by destination) and lookups (by name)."""
        told = self._told
        refused_now, allowed, refusals = self._counted()
        counts = {(r.address, r.port): r.count for r in refused_now}
        lookups, names = self.refused_lookups()
        self._told = _Told(counts, lookups, names, allowed, refusals)
        new = sorted(
            ((destination, count - told.connections.get(destination, 0)) for destination, count in counts.items()),
            key=lambda item: (-item[1], item[0]),
        )
        new = [(destination, count) for destination, count in new if count > 0]
        # Port 0 (a datagram to it) is counted, never listed: no destination a result names has it.
        # Counts stay within what the wire carries, the listed ones within the total (the readers'
        # checks: a report they refuse would cost the job its whole result).
        listed = [((address, port), min(count, MAX_REFUSED_COUNT)) for (address, port), count in new if port > 0]
        listed = listed[:MAX_REFUSED_REPORTED]
        refused = max(self._told.refusals - told.refusals, sum(count for _, count in new))
        total = max(min(refused, MAX_REFUSED_COUNT), sum(count for _, count in listed))
        while total > MAX_REFUSED_COUNT:
            total -= listed.pop()[1]
        return NetworkReport(
            refused_connections=total,
            refused=tuple(RefusedConnection(address, port, count) for (address, port), count in listed),
            refused_lookups=min(max(0, lookups - told.lookups), MAX_REFUSED_COUNT),
            refused_names=tuple(dict.fromkeys(  # as a result shows a name: its first 253 characters
                name[:MAX_DNS_NAME_CHARS] or "." for name, count in names.items() if count > told.names.get(name, 0)
            ))[:MAX_REFUSED_NAMES],
            allowed_connections=min(max(0, self._told.allowed - told.allowed), MAX_REFUSED_COUNT),
        )

    def refused_lookups(self) -> tuple[int, dict[str, int]]:
        """Lookups refused (name not allowed, or only denied answers): the total, and per name
        for the first names (the resolver's ``MAX_REFUSED_NAMES``)."""
        resolver = self.egress.resolver
        return (0, {}) if resolver is None else resolver.refused(self.key)

    def discard(self) -> None:
        """:meth:`remove`, a failure logged instead of raised: for a sandbox's destroy, whose
        callers go on to the next (the gateway's close and sweep take what is left)."""
        try:
            self.remove()
        except SandboxSetupError as exc:
            log.error("sandbox network not removed", key=self.key, error=str(exc))

    def remove(self) -> None:
        """Remove everything of this sandbox's network, whatever part of it exists (idempotent)."""
        if self._removed:
            return
        config, failures = self.egress.config, []
        resolver = self.egress.resolver
        steps = [
            lambda: resolver.stop_serving(self.key) if resolver is not None else None,
            # The veth first: `ip netns delete` is asynchronous, a veth delete is not (lab §0).
            lambda: _netns.ip_batch(config.netns, [f"link delete {self.veth}"], check=False),
            lambda: _netns.ip_batch(None, [f"netns delete {self.netns}"], check=False),
            lambda: self.egress.nft(_nft.remove_batch(config.table, self.key, self.veth)),
        ]
        for step in steps:  # each step whatever the one before did: leave as little as possible
            try:
                step()
            except SandboxSetupError as exc:
                failures.append(str(exc))
        if _netns.present(self.netns):
            failures.append("its namespace is still there")
        if self.veth in _netns.links(config.netns, self.veth):
            failures.append("its veth is still there")
        if failures:
            raise SandboxSetupError(f"sandbox network {self.key}: not all removed: {'; '.join(failures)}")
        self._removed = True
        self.egress._forget(self)
