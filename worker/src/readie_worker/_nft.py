"""nftables text for egress enforcement (docs/decisions/0036-egress-enforcement.md): pure text
generation and parsing, plus one runner. Nothing here decides policy; ``egress_net`` hands in
the networks.

Layout, in the egress network namespace, one ``inet`` table readie owns::

    table inet <table>
      map sandboxes   ifname -> jump sb_<id>      (the sandbox's veth picks its chain)
      map refusers    ifname -> goto rf_<id>      (what it sends the egress netns itself)
      set owners      ifname . mark               (a veth and its sandbox's conntrack mark)
      chain forward   forged source (RPF) -> rf_<id>; (own namespace) neither side a veth ->
                      reject; a reply into
                      a veth not its sandbox's own -> reject; replies -> accept;
                      new into a sandbox -> reject; iifname vmap @sandboxes
      chain input     forged source (RPF) -> rf_<id>; established -> accept; from a veth: its own
                      gateway port 53 -> accept; rf_<id>
      chain postrouting  masquerade what leaves from the sandboxes' pool
      chain sb_<id>   not its own source -> refuse; its own (ct mark) established -> accept; new past
                      its connection bound -> refuse; new -> mark as its own;
                      local/broadcast/multicast -> refuse; denied and not opened ->
                      refuse; allowed net . port -> accept; DNS-answered -> accept; public set (0/0 or empty) -> accept;
                      refuse
      chain rf_<id>   count (counter refusals_<id>, and into the refused set); TCP -> reset,
                      the rest -> port unreachable
      sets {deny,open,allow,dns,dnsport,refused,conns}_<id>

Never ``drop`` a sandbox's packet: a drop leaves the job's connect hanging to its own timeout.
Never ``icmpx admin-prohibited``: gVisor's netstack ignores it (the same hang); it turns
port-unreachable into ECONNREFUSED (lab §6).
"""

from __future__ import annotations

import ctypes
import ipaddress
import json
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ._netns import call_in as _netns_call
from .errors import SandboxSetupError, host_failure, log_host_facts

IPv4Net = ipaddress.IPv4Network

# The refused set holds this many distinct (address, port) pairs per sandbox; past it new
# destinations are still refused, just not itemised. A result reports fewer (egress_net).
REFUSED_SET_SIZE = 256
# Addresses (and address-port pairs) a sandbox's lookups opened at once: 16 a lookup
# (MAX_ANSWER_ADDRESSES) for a thousand live answers, a crawler's worth. Each holds kernel memory
# for up to an hour, and a job under a wildcard over a zone it controls could otherwise add
# without end; once full, a lookup that would open more is answered SERVFAIL.
ANSWERED_SET_SIZE = 16384
# What a listing may print for one refused set (256 elements of ~120 bytes, with room).
MAX_NFT_JSON_BYTES = 1 << 20
ALL_PORTS = "0-65535"
# Connections one sandbox may have tracked at once. The egress netns's conntrack table is shared:
# without a bound one sandbox fills it (30 000 entries in under a second) and every other
# sandbox's new connections fail. A job needs tens; 256 x MAX_SANDBOXES_WIRED (1024) fits the
# kernel's default table of 262 144.
MAX_CONNECTIONS_PER_SANDBOX = 256


@dataclass(frozen=True)
class SandboxRules:
    """What one sandbox's chain needs, all IPv4 (the sandbox has no IPv6)."""

    key: str  # the sandbox's short id: names its chains and sets
    veth: str  # its veth's name in the egress netns
    address: ipaddress.IPv4Address  # the only source its packets may carry
    deny: tuple[IPv4Net, ...]
    opened: tuple[tuple[IPv4Net, int | None], ...]  # (network, port or None: every port)
    allow: tuple[tuple[IPv4Net, int | None], ...]
    public: bool


def base_batch(table: str, pool: IPv4Net, veth_prefix: str, *, sole: bool = False) -> str:
    """Create readie's table and base chains if missing (``add`` is idempotent). ``sole``: the
    namespace is the worker's own (a container's), whose forwarding is readie's alone."""
    return "\n".join(
        [
            f"add table inet {table}",
            f"add map inet {table} sandboxes {{ type ifname : verdict; }}",
            f"add map inet {table} refusers {{ type ifname : verdict; }}",
            f"add set inet {table} owners {{ type ifname . mark; }}",
            f"add chain inet {table} forward {{ type filter hook forward priority 0; policy accept; }}",
            f"add chain inet {table} input {{ type filter hook input priority 0; policy accept; }}",
            f"add chain inet {table} postrouting {{ type nat hook postrouting priority srcnat; policy accept; }}",
            f"flush chain inet {table} forward",
            f"flush chain inet {table} input",
            f"flush chain inet {table} postrouting",
            # A source not routed back through the veth it came in on is forged (strict RPF),
            # checked before anything accepts a reply: a sandbox forging a server's address
            # would otherwise have its packet taken as that server's reply, into another
            # sandbox's flow. Counted as its refusal; its answer goes to the forged address.
            f'add rule inet {table} forward iifname "{veth_prefix}*" fib saddr . iif oif missing iifname vmap @refusers',
            f'add rule inet {table} forward iifname "{veth_prefix}*" fib saddr . iif oif missing reject with icmpx port-unreachable',
            # In a container's own namespace readie turned forwarding on for its sandboxes alone:
            # nothing else is forwarded (its neighbours could route through it; a reply to a
            # sandbox already removed would leave by the default route). An operator's egress
            # namespace may hold other workers' tables, each with its own veths and pool.
            *([f'add rule inet {table} forward iifname != "{veth_prefix}*" oifname != "{veth_prefix}*" '
               "reject with icmpx port-unreachable"] if sole else []),
            # Replies to what a sandbox opened, into the sandbox that opened it (its mark): a /30 is
            # reused while conntrack still holds its last sandbox's flows, whose replies must not
            # reach the next one. The sandbox's own direction is checked in its chain.
            f'add rule inet {table} forward ct direction reply oifname "{veth_prefix}*" oifname . ct mark != @owners reject with icmpx port-unreachable',
            f"add rule inet {table} forward ct direction reply ct state established,related accept",
            # Nothing outside opens a connection into a sandbox (it has no listener meant for it).
            f'add rule inet {table} forward oifname "{veth_prefix}*" reject with icmpx port-unreachable',
            f"add rule inet {table} forward iifname vmap @sandboxes",
            # A veth of ours with no chain (being removed): refused, never forwarded.
            f'add rule inet {table} forward iifname "{veth_prefix}*" reject with icmpx port-unreachable',
            # Forged first, as in forward: a "reply" from a veth into a flow of the egress netns's
            # own (the resolver's upstream queries) is a forgery.
            f'add rule inet {table} input iifname "{veth_prefix}*" fib saddr . iif oif missing iifname vmap @refusers',
            f'add rule inet {table} input iifname "{veth_prefix}*" fib saddr . iif oif missing reject with icmpx port-unreachable',
            f"add rule inet {table} input ct state established,related accept",
            # Input is the egress netns itself, never a sandbox's policy: only the resolver on the
            # sandbox's own gateway (fib: local on the interface it came in on). Broadcast,
            # multicast and every other local address would reach its wildcard listeners: refused.
            f'add rule inet {table} input iifname "{veth_prefix}*" fib daddr . iif type local meta l4proto {{ tcp, udp }} th dport 53 accept',
            f"add rule inet {table} input iifname vmap @refusers",  # itemised in its refused set
            f'add rule inet {table} input iifname "{veth_prefix}*" reject with icmpx port-unreachable',
            f'add rule inet {table} postrouting ip saddr {pool} oifname != "{veth_prefix}*" masquerade',
        ]
    ) + "\n"


def _elements(items: Iterable[str]) -> str:
    listed = ", ".join(items)
    return f" elements = {{ {listed} }}" if listed else ""


def _sets(table: str, key: str) -> list[tuple[str, str]]:
    """(name, definition) of a sandbox's sets; the same text creates and (before delete) re-adds them."""
    return [
        (f"deny_{key}", "type ipv4_addr; flags interval;"),
        (f"open_{key}", "type ipv4_addr . inet_service; flags interval;"),
        (f"allow_{key}", "type ipv4_addr . inet_service; flags interval;"),
        # 0.0.0.0/0 when the policy is the public internet (what is denied was refused before).
        (f"public_{key}", "type ipv4_addr; flags interval;"),
        # Addresses the resolver answered for an allowed name, for as long as the answer's TTL.
        (f"dns_{key}", f"type ipv4_addr; size {ANSWERED_SET_SIZE}; flags timeout;"),
        (f"dnsport_{key}", f"type ipv4_addr . inet_service; size {ANSWERED_SET_SIZE}; flags timeout;"),
        (f"refused_{key}", f"type ipv4_addr . inet_service; size {REFUSED_SET_SIZE}; flags dynamic; counter;"),
        # Its one source address, counting its tracked connections (ct count).
        (f"conns_{key}", "type ipv4_addr; size 1; flags dynamic;"),
    ]


def sandbox_batch(table: str, rules: SandboxRules) -> str:
    """One atomic batch that wires a sandbox: its sets, its two chains, its vmap entry."""
    key, t = rules.key, table
    lines = [f"add set inet {t} {name} {{ {definition} }}" for name, definition in _sets(t, key)]
    lines.append(f"add counter inet {t} allowed_{key}")  # its new connections let through
    lines.append(f"add counter inet {t} refusals_{key}")  # every refusal, past a full refused set too
    allowed = f'counter name "allowed_{key}" accept'
    lines += _policy_elements(t, rules)
    refuse, chain = f"rf_{key}", f"sb_{key}"
    lines += [
        f"add chain inet {t} {refuse}",
        f'add rule inet {t} {refuse} meta l4proto {{ tcp, udp }} counter name "refusals_{key}"',
        f"add rule inet {t} {refuse} meta l4proto {{ tcp, udp }} update @refused_{key} {{ ip daddr . th dport }}",
        f"add rule inet {t} {refuse} meta l4proto tcp reject with tcp reset",
        f"add rule inet {t} {refuse} reject with icmpx port-unreachable",
        f"add chain inet {t} {chain}",
        # Only its own source address: a spoofed one would leave un-masqueraded, or (another
        # sandbox's) steer the replies into that sandbox past its own chain.
        f"add rule inet {t} {chain} ip saddr != {rules.address} goto {refuse}",
        # Its own connections go on; a new one is marked as its own (kept only if accepted below).
        f"add rule inet {t} {chain} ct state established,related ct mark {_mark(key)} accept",
        f"add rule inet {t} {chain} ct state new add @conns_{key} {{ ip saddr ct count over {MAX_CONNECTIONS_PER_SANDBOX} }} goto {refuse}",
        f"add rule inet {t} {chain} ct state new ct mark set {_mark(key)}",
        # Forwarded only (input never comes here): nothing of the egress netns itself, and never a
        # broadcast or multicast destination, even for `public` (0/8, 224/3: not unicast hosts).
        f"add rule inet {t} {chain} fib daddr type {{ local, broadcast, multicast, anycast }} goto {refuse}",
        f"add rule inet {t} {chain} ip daddr {{ 0.0.0.0/8, 224.0.0.0/3 }} goto {refuse}",
        # Deny first: neither an allowed CIDR nor a DNS answer opens a default-denied address; the
        # ceiling opens one on its ports only, so for TCP and UDP alone.
        f"add rule inet {t} {chain} ip daddr @deny_{key} meta l4proto != {{ tcp, udp }} goto {refuse}",
        f"add rule inet {t} {chain} ip daddr @deny_{key} ip daddr . th dport != @open_{key} goto {refuse}",
        f"add rule inet {t} {chain} meta l4proto {{ tcp, udp }} ip daddr . th dport @allow_{key} {allowed}",
        f"add rule inet {t} {chain} ip daddr @dns_{key} {allowed}",
        f"add rule inet {t} {chain} meta l4proto {{ tcp, udp }} ip daddr . th dport @dnsport_{key} {allowed}",
        f"add rule inet {t} {chain} ip daddr @public_{key} {allowed}",
    ]
    lines += [
        f"add rule inet {t} {chain} goto {refuse}",
        f'add element inet {t} refusers {{ "{rules.veth}" : goto {refuse} }}',
        f'add element inet {t} owners {{ "{rules.veth}" . {_mark(key)} }}',
        f'add element inet {t} sandboxes {{ "{rules.veth}" : jump {chain} }}',
    ]
    return "\n".join(line for line in lines if line) + "\n"


def _policy_elements(t: str, rules: SandboxRules) -> list[str]:
    """The elements of a sandbox's policy sets: all of its policy (its chain is the same for every one)."""
    key, allow = rules.key, [f"{net} . {port}" for net, port in _port_elements(rules.allow)]
    opened = [f"{net} . {port}" for net, port in _port_elements(rules.opened)]
    return [line for line in (
        f"add element inet {t} deny_{key} {{ {', '.join(map(str, _merged(rules.deny)))} }}" if rules.deny else "",
        f"add element inet {t} open_{key} {{ {', '.join(opened)} }}" if opened else "",
        f"add element inet {t} allow_{key} {{ {', '.join(allow)} }}" if allow else "",
        f"add element inet {t} public_{key} {{ 0.0.0.0/0 }}" if rules.public else "",
    ) if line]


def rerule_batch(table: str, rules: SandboxRules) -> str:
    """One atomic batch that gives a wired sandbox (a warm one) a new policy: its policy sets
    emptied and filled anew, and what it was told of before forgotten (answered names, refusals,
    its allowed count), as if it had been wired so."""
    key, t = rules.key, table
    emptied = ("deny", "open", "allow", "public", "dns", "dnsport", "refused")
    return "\n".join([
        *(f"flush set inet {t} {name}_{key}" for name in emptied),
        f"reset counter inet {t} allowed_{key}",
        f"reset counter inet {t} refusals_{key}",
        *_policy_elements(t, rules),
    ]) + "\n"


def remove_batch(table: str, key: str, veth: str) -> str:
    """One atomic batch that removes a sandbox's chains, sets and vmap entry, whatever of them
    exists: each is added first (a no-op when present), so the deletes cannot miss."""
    t = table
    refuse, chain = f"rf_{key}", f"sb_{key}"
    lines = [
        f"add table inet {t}",
        f"add map inet {t} sandboxes {{ type ifname : verdict; }}",
        *(f"add set inet {t} {name} {{ {definition} }}" for name, definition in _sets(t, key)),
        f"add chain inet {t} {refuse}",
        f"add chain inet {t} {chain}",
        f"add map inet {t} refusers {{ type ifname : verdict; }}",
        f"add set inet {t} owners {{ type ifname . mark; }}",
        f'add element inet {t} sandboxes {{ "{veth}" : jump {chain} }}',
        f'delete element inet {t} sandboxes {{ "{veth}" }}',
        f'add element inet {t} refusers {{ "{veth}" : goto {refuse} }}',
        f'delete element inet {t} refusers {{ "{veth}" }}',
        f'add element inet {t} owners {{ "{veth}" . {_mark(key)} }}',
        f'delete element inet {t} owners {{ "{veth}" . {_mark(key)} }}',
        f"flush chain inet {t} {chain}",
        f"flush chain inet {t} {refuse}",
        f"delete chain inet {t} {chain}",
        f"delete chain inet {t} {refuse}",
        *(f"delete set inet {t} {name}" for name, _ in _sets(t, key)),
        f"add counter inet {t} allowed_{key}",
        f"delete counter inet {t} allowed_{key}",
        f"add counter inet {t} refusals_{key}",
        f"delete counter inet {t} refusals_{key}",
    ]
    return "\n".join(lines) + "\n"


def remove_table_batch(table: str) -> str:
    """Remove readie's whole table, present or not."""
    return f"add table inet {table}\ndelete table inet {table}\n"


def answered_batch(table: str, key: str, addresses: Sequence[ipaddress.IPv4Address], ports: Sequence[int | None], timeout_s: int) -> str:
    """Open ``addresses`` (answered for an allowed name) on ``ports`` (None: every port) for ``timeout_s``.

    ``add element`` leaves a present element's timeout as it was, so an address answered again
    would still close at its first expiry: each is added (a no-op when present), deleted and
    added anew in this one atomic batch, which restarts its timeout."""
    lines = []
    for port in ports:
        name = f"dns_{key}" if port is None else f"dnsport_{key}"
        elements = [str(address) if port is None else f"{address} . {port}" for address in addresses]
        timed = ", ".join(f"{element} timeout {timeout_s}s" for element in elements)
        lines += [
            f"add element inet {table} {name} {{ {timed} }}",
            f"delete element inet {table} {name} {{ {', '.join(elements)} }}",
            f"add element inet {table} {name} {{ {timed} }}",
        ]
    return "\n".join(lines) + "\n"


def _mark(key: str) -> str:
    """The conntrack mark of a sandbox's connections: its key (8 hex digits, never 0)."""
    return f"0x{key}"


def _merged(networks: Iterable[IPv4Net]) -> list[IPv4Net]:
    """Overlapping intervals are an error in an nft interval set: collapse them first."""
    return list(ipaddress.collapse_addresses(networks))


def _port_elements(allow: Iterable[tuple[IPv4Net, int | None]]) -> list[tuple[IPv4Net, str]]:
    """(network, port) pairs as elements that never overlap (nft refuses the whole batch if two
    do: an operator's ceiling plus a job's own narrower entry would fail the wiring). Networks are
    collapsed per port, and a port's networks lose what an every-port network already covers."""
    by_port: dict[int | None, list[IPv4Net]] = {}
    for net, port in allow:
        by_port.setdefault(port, []).append(net)
    every = _merged(by_port.pop(None, []))
    elements = [(net, ALL_PORTS) for net in every]
    for port in sorted(by_port):
        remaining = _merged(by_port[port])
        for hole in every:
            remaining = [piece for net in remaining for piece in _without(net, hole)]
        elements += [(net, str(port)) for net in _merged(remaining)]
    return elements


def _without(net: IPv4Net, hole: IPv4Net) -> list[IPv4Net]:
    if net.subnet_of(hole):
        return []
    return list(net.address_exclude(hole)) if hole.subnet_of(net) else [net]


def documents(text: str) -> list[object]:
    """The JSON documents one run of several listings printed, back to back (one per command)."""
    decoder, found, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at].isspace():
            at += 1
        if at == len(text):
            return found
        try:
            document, at = decoder.raw_decode(text, at)
        except ValueError as exc:
            raise SandboxSetupError(f"nft printed no JSON for a listing: {exc}") from None
        found.append(document)


def _document(text: str | object, what: str) -> object:
    if not isinstance(text, str):
        return text
    try:
        return json.loads(text)
    except ValueError as exc:
        raise SandboxSetupError(f"nft printed no JSON for {what}: {exc}") from None


def parse_counter(text: str | object) -> int:
    """The packets of a named counter as ``nft -j list counter`` prints it (0 if none is shown);
    ``text`` or its document."""
    document = _document(text, "a counter")
    for item in document.get("nftables", []) if isinstance(document, dict) else []:
        counter = item.get("counter") if isinstance(item, dict) else None
        packets = counter.get("packets") if isinstance(counter, dict) else None
        if isinstance(packets, int) and not isinstance(packets, bool) and packets >= 0:
            return packets
    return 0


def parse_refused(text: str | object) -> list[tuple[str, int, int]]:
    """(address, port, packets) of a refused set as ``nft -j list set`` prints it, most first;
    ``text`` or its document."""
    document = _document(text, "a refused set")
    found: list[tuple[str, int, int]] = []
    for item in document.get("nftables", []) if isinstance(document, dict) else []:
        elements = item.get("set", {}).get("elem", []) if isinstance(item, dict) else []
        for element in elements if isinstance(elements, list) else []:
            parsed = _refused_element(element)
            if parsed is not None:
                found.append(parsed)
    return sorted(found, key=lambda item: (-item[2], item[0], item[1]))


def _refused_element(element: object) -> tuple[str, int, int] | None:
    """``{"elem": {"val": {"concat": ["10.0.0.1", 80]}, "counter": {"packets": 1, ...}}}``."""
    if not isinstance(element, dict) or not isinstance(element.get("elem"), dict):
        return None
    body = element["elem"]
    concat = body.get("val", {}).get("concat") if isinstance(body.get("val"), dict) else None
    counter = body.get("counter")
    if not (isinstance(concat, list) and len(concat) == 2 and isinstance(counter, dict)):
        return None
    address, port, packets = concat[0], concat[1], counter.get("packets")
    if not (isinstance(address, str) and isinstance(port, int) and isinstance(packets, int)):
        return None
    return address, port, packets


class Nft:
    """nftables in process, in one network namespace: libnftables (what the ``nft`` command is a
    front end of) through ctypes. Its netlink socket is opened in ``netns`` (on a thread that
    entered it) and keeps that namespace from any thread. In process a batch or a listing takes
    ~0.1 ms where an ``nsenter nft`` process took ~10 ms (more under load), and a networked job's
    hand-out and report take three (decision 36). Output is JSON (listings); a batch in nft's own
    syntax is read as such."""

    def __init__(self, netns: str | None) -> None:
        with host_failure(SandboxSetupError, "cannot load libnftables", caught=(OSError, AttributeError)):
            self._lib = _libnftables()
        self._lock = threading.Lock()  # one context: its output buffer is one call's at a time
        self._ctx: int | None = _netns_call(netns, self._new_context)

    def _new_context(self) -> int:
        ctx = self._lib.nft_ctx_new(0)
        if not ctx:
            raise SandboxSetupError("libnftables could not make a context")
        self._lib.nft_ctx_output_set_flags(ctx, _OUTPUT_JSON)
        self._lib.nft_ctx_buffer_output(ctx)
        self._lib.nft_ctx_buffer_error(ctx)
        return ctx

    def run(self, commands: str) -> str:
        """Run ``commands`` (one atomic batch, or a listing) and return what they printed."""
        with self._lock:
            if self._ctx is None:
                raise SandboxSetupError("the egress firewall's context is closed")
            failed = self._lib.nft_run_cmd_from_buffer(self._ctx, commands.encode()) != 0
            output = (self._lib.nft_ctx_get_output_buffer(self._ctx) or b"").decode(errors="replace")
            errors = (self._lib.nft_ctx_get_error_buffer(self._ctx) or b"").decode(errors="replace")
        if failed:  # its words name namespaces and addresses: the operator's to read
            where = log_host_facts("nft failed", commands=commands[-2000:], stderr=errors.strip()[-2000:])
            raise SandboxSetupError(f"the sandbox's firewall could not be set: nft failed; {where}")
        if len(output) > MAX_NFT_JSON_BYTES:
            raise SandboxSetupError(f"nft printed over {MAX_NFT_JSON_BYTES} bytes")
        return output

    def close(self) -> None:
        with self._lock:
            ctx, self._ctx = self._ctx, None
        if ctx is not None:
            self._lib.nft_ctx_free(ctx)


# NFT_CTX_OUTPUT_JSON in libnftables' nftables.h.
_OUTPUT_JSON = 1 << 4
_LIBRARY: ctypes.CDLL | None = None


def _libnftables() -> ctypes.CDLL:
    """The library, its functions' signatures declared (once per process)."""
    global _LIBRARY
    if _LIBRARY is None:
        lib = ctypes.CDLL("libnftables.so.1", use_errno=True)
        lib.nft_ctx_new.restype, lib.nft_ctx_new.argtypes = ctypes.c_void_p, [ctypes.c_uint32]
        lib.nft_ctx_free.restype, lib.nft_ctx_free.argtypes = None, [ctypes.c_void_p]
        lib.nft_ctx_output_set_flags.argtypes = [ctypes.c_void_p, ctypes.c_uint]
        lib.nft_ctx_buffer_output.argtypes = [ctypes.c_void_p]
        lib.nft_ctx_buffer_error.argtypes = [ctypes.c_void_p]
        lib.nft_run_cmd_from_buffer.restype, lib.nft_run_cmd_from_buffer.argtypes = ctypes.c_int, [ctypes.c_void_p, ctypes.c_char_p]
        for getter in (lib.nft_ctx_get_output_buffer, lib.nft_ctx_get_error_buffer):
            getter.restype, getter.argtypes = ctypes.c_char_p, [ctypes.c_void_p]
        _LIBRARY = lib
    return _LIBRARY
