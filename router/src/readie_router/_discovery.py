"""Workers found by name: a DNS name (a Kubernetes headless Service) re-resolved on a timer.

    readie router --worker-dns readie-workers.readie.svc.cluster.local:50061

Each round, :meth:`Discovery.resolve` asks the system's resolver
(``socket.getaddrinfo``: /etc/hosts, then DNS, as nsswitch.conf says) for
every name and returns the addresses of all answers together; ``Placement``
then adds a member for each new address (probed before it gets work) and
retires each one that left (decision 19). A headless Service's name answers
with the addresses of its ready pods, so a worker that drains (health
NOT_SERVING) or goes away leaves the answer.

The answer comes from outside and is treated as hostile: only IP literals
are taken, at most :data:`MAX_DISCOVERED_WORKERS` of them. A lookup that fails
(the resolver unreachable, the name unknown, no address) keeps that name's
last answer: an outage of DNS must not retire every worker, and a worker that
really went away fails its probes and is evicted as any other. Failures are
logged when they start or change, and once when the name resolves again,
never once per round.
"""

from __future__ import annotations

import argparse
import ipaddress
import socket
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import structlog

log = structlog.get_logger("readie.discovery")

__all__ = [
    "DEFAULT_DNS_INTERVAL_S",
    "MAX_DISCOVERED_WORKERS",
    "Discovery",
    "DnsName",
    "Resolver",
    "dns_name",
    "system_resolver",
    "worker_address",
]

# Seconds between resolutions. CoreDNS answers a headless Service with a 5 s
# TTL (its kubernetes plugin's default) and drops a pod from the answer once
# it turns unready; asking more often than that sees the same answer, and a
# worker that vanished meanwhile is caught by the probes (EVICT_AFTER_FAILURES
# at PROBE_INTERVAL_S) within the same few seconds.
DEFAULT_DNS_INTERVAL_S = 5.0
# Members one router keeps from DNS. Each is a gRPC channel and a Capacity
# probe per interval, made one after another by a single thread, where an
# unreachable worker costs up to a second (CAPACITY_TIMEOUT_S): a few hundred
# would stretch a probe round past the eviction it is there for. More gVisor
# nodes than this want several routers; an answer larger than this is cut
# (the lowest addresses kept, so the cut is stable) and the cut logged.
MAX_DISCOVERED_WORKERS = 128
# Records read from one answer, before the cut above: a DNS message is at most
# 64 KiB, a few thousand A records; a resolver giving more is not DNS.
MAX_ANSWER_RECORDS = 4096
# A DNS name is at most 253 characters (RFC 1035, in text form).
MAX_NAME_CHARS = 253

#: ``resolver(host, port)``: the IP addresses the name has now; raises OSError when it cannot say.
Resolver = Callable[[str, int], Sequence[str]]


@dataclass(frozen=True, order=True)
class DnsName:
    """``NAME:PORT`` of ``--worker-dns``: every address the name resolves to, on that port."""

    host: str
    port: int

    def __str__(self) -> str:
        return f"{self.host}:{self.port}"


def dns_name(text: str) -> DnsName:
    """``--worker-dns``'s value: ``NAME:PORT`` (argparse type)."""
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise argparse.ArgumentTypeError(f"wants NAME:PORT, got {text!r}")
    if len(host) > MAX_NAME_CHARS or not host.isascii() or any(c.isspace() or c in "[]/" for c in host):
        raise argparse.ArgumentTypeError(f"{host!r} is not a DNS name")
    return DnsName(host, int(port))


def system_resolver(host: str, port: int) -> list[str]:
    """The addresses ``getaddrinfo`` gives for ``host`` (TCP), in its order."""
    return [info[4][0] for info in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)]


def worker_address(ip: str, port: int) -> str:
    """``ip:port`` as WorkerClient takes it (``[v6]:port`` for IPv6)."""
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


class Discovery:
    """The worker addresses some DNS names stand for, as of the last round (not thread-safe: one caller)."""

    def __init__(
        self, names: Iterable[DnsName], resolver: Resolver = system_resolver, *, limit: int = MAX_DISCOVERED_WORKERS
    ) -> None:
        self.names = tuple(dict.fromkeys(names))  # each once, in the order given
        self._resolver = resolver
        self._limit = limit
        self._answers: dict[DnsName, frozenset[str]] = {}  # the last answer each name gave
        self._failures: dict[DnsName, str] = {}  # the failure last logged for a name that does not resolve now
        self._cut = 0  # addresses left out of the last round (over the limit), as last logged

    def resolve(self) -> list[str]:
        """Every name's addresses now (a name that failed: its last answer), sorted, at most ``limit``."""
        for name in self.names:
            try:
                found = self._addresses(name)
            except (OSError, UnicodeError) as exc:  # gaierror is an OSError; a name IDNA refuses, a UnicodeError
                self._failed(name, exc)
                continue
            self._answered(name, found)
        union = sorted(frozenset().union(*self._answers.values()), key=_address_order)
        cut = max(0, len(union) - self._limit)
        if cut != self._cut:
            self._cut = cut
            if cut:
                log.warning("more workers than one router keeps; ignoring some", limit=self._limit, ignored=cut)
            else:
                log.info("every discovered worker is kept again", limit=self._limit)
        return union[: self._limit]

    def _addresses(self, name: DnsName) -> frozenset[str]:
        found: set[str] = set()
        for ip in list(self._resolver(name.host, name.port))[:MAX_ANSWER_RECORDS]:
            try:
                address = ipaddress.ip_address(ip)
            except ValueError:
                log.warning("ignoring an answer that is no IP address", name=str(name), answer=repr(ip)[:80])
                continue
            found.add(worker_address(str(address), name.port))
        return frozenset(found)

    def _failed(self, name: DnsName, exc: BaseException) -> None:
        reason = str(exc) or type(exc).__name__
        if self._failures.get(name) != reason:
            self._failures[name] = reason
            kept = sorted(self._answers.get(name, ()), key=_address_order)
            log.warning("worker name does not resolve; keeping its last answer", name=str(name), error=reason, kept=kept)

    def _answered(self, name: DnsName, found: frozenset[str]) -> None:
        if self._failures.pop(name, None) is not None:
            log.info("worker name resolves again", name=str(name), addresses=len(found))
        before = self._answers.get(name)
        if found != before:
            before = before or frozenset()
            log.info(
                "worker name's answer changed",
                name=str(name),
                added=sorted(found - before, key=_address_order),
                removed=sorted(before - found, key=_address_order),
            )
        self._answers[name] = found


def _address_order(address: str) -> tuple[int, int, int]:
    """IPv4 before IPv6, then numerically (127.0.0.10 after 127.0.0.9), then by port."""
    host, _, port = address.rpartition(":")
    ip = ipaddress.ip_address(host.strip("[]"))
    return ip.version, int(ip), int(port)
