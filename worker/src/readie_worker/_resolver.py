"""The resolver readie controls (docs/decisions/0036-egress-enforcement.md): one UDP listener per
networked sandbox, on its gateway address inside the egress netns. Only allowed names are
forwarded to the upstream resolvers; other names get NXDOMAIN (counted). Answers that are
denied are dropped, and every address kept is opened in the sandbox's DNS set BEFORE the reply
leaves, so the job's first SYN finds it. The sandbox has no IPv6: AAAA gets an empty answer.

The connect-time check in nftables is what stops rebinding: this resolver only decides what a
name may open, never what an address already answered may reach.
"""

from __future__ import annotations

import contextlib
import functools
import ipaddress
import os
import re
import selectors
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import dns.exception
import dns.flags
import dns.message
import dns.query
import dns.rcode
import dns.rdataclass
import dns.rdatatype
import dns.rrset
import structlog

# A sandbox's refused names kept one by one (and logged once each); a name's longest text.
from readie_protocol.network import MAX_DNS_NAME_CHARS, MAX_REFUSED_NAMES

from . import _netns
from ._fair_threads import FairThreads
from .errors import SandboxSetupError

log = structlog.get_logger("readie.resolver")

# A DNS query over UDP from glibc fits 512 bytes (EDNS may offer more, but a question is small).
MAX_QUERY_BYTES = 1232
# Upstream answers are read up to this (EDNS's common safe size).
MAX_UPSTREAM_BYTES = 4096
# Addresses kept of one answer: 16 A records keep the reply under 512 bytes (no TCP needed).
MAX_ANSWER_ADDRESSES = 16
# Forwarded queries (and TCP connections) at once, across sandboxes: past this a query gets
# SERVFAIL (a TCP connection is closed) instead of queuing without end (glibc sends 2 per
# lookup: A and AAAA, and AAAA is answered at once).
MAX_IN_FLIGHT = 32
# ... and per sandbox, so that one sandbox's flood leaves room for the others'.
MAX_IN_FLIGHT_PER_SANDBOX = 8
# Threads forwarding upstream (blocking dnspython calls); few: lookups are rare and quick.
FORWARDERS = 4
# ... of which one sandbox's lookups take at most this many at once, in turn with the others'
# (_fair_threads): one whose lookups hang (names whose servers never answer) holds its share, and
# another sandbox's lookup waits for a turn, never behind its queue.
FORWARDER_SHARE = FORWARDERS // 2
# One upstream's answer, then the next upstream; glibc in the sandbox waits 5 s per try.
UPSTREAM_TIMEOUT_S = 2.0
# An answered address stays open this long at least (a TTL of 0 would close it before the
# connect) and at most (a day-long TTL keeps it open past any job; a warm sandbox is re-wired).
MIN_OPEN_S, MAX_OPEN_S = 30, 3600
# A reply holds at most MAX_ANSWER_ADDRESSES records: it fits the classic UDP size.
MAX_REPLY_BYTES = 512
# Over TCP a reply's length is a 16-bit field: a long name with MAX_ANSWER_ADDRESSES addresses,
# which a UDP reply cannot hold (it goes with TC set, and glibc asks again here), fits.
MAX_TCP_REPLY_BYTES = 65535
# Pending TCP connections per sandbox's listener; TCP lookups are rare (glibc's fallback).
TCP_BACKLOG = 8
# A TCP client has this long to send its whole query (one deadline, not one per read): a
# silent or one-byte-at-a-time connection holds its place and a forwarder no longer.
TCP_READ_TIMEOUT_S = 2.0
# The serving thread takes a new listener within microseconds; this only catches a dead one.
LOOP_WAIT_S = 5.0
# A label a name is matched on: letters, digits, hyphen (a hostname's). Anything else (a dot or
# backslash inside a label, other bytes) has no one plain text form, so `*.example.com` could
# match a name that is not below example.com: such a name is refused.
_HOST_LABEL = re.compile(rb"[A-Za-z0-9-]{1,63}")

Allowed = Callable[[str], "tuple[int | None, ...] | None"]  # a name's ports (None: every port), or None
Refuses = Callable[[ipaddress.IPv4Address], bool]
Opens = Callable[["list[ipaddress.IPv4Address]", "tuple[int | None, ...]", int], None]


@dataclass
class _Served:
    key: str
    sock: socket.socket  # UDP on the gateway's port 53
    listener: socket.socket  # TCP on the same (glibc's fallback, and `options use-vc`)
    allowed: Allowed
    refuses: Refuses
    opens: Opens
    # Lookups refused, by name: what a result reports (bounded), and the total beyond it.
    refused: dict[str, int] = field(default_factory=dict)
    refused_total: int = 0
    in_flight: int = 0  # its queries forwarded now (UDP) and TCP connections open
    lock: threading.Lock = field(default_factory=threading.Lock)

    def begin(self) -> bool:
        """Take one of this sandbox's in-flight places: a sandbox that floods its resolver
        waits for its own answers, never takes every sandbox's."""
        with self.lock:
            if self.in_flight >= MAX_IN_FLIGHT_PER_SANDBOX:
                return False
            self.in_flight += 1
            return True

    def end(self) -> None:
        with self.lock:
            self.in_flight -= 1


class Resolver:
    """Serves every networked sandbox of one egress netns from one thread, forwarding on a few."""

    def __init__(self, netns: str | None, upstreams: Sequence[str]) -> None:
        self._netns = netns
        self._upstreams = tuple(upstreams)
        self._served: dict[str, _Served] = {}
        self._lock = threading.Lock()
        self._in_flight = threading.BoundedSemaphore(MAX_IN_FLIGHT)
        self._selector = selectors.DefaultSelector()
        self._wake_read, self._wake_write = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        self._selector.register(self._wake_read, selectors.EVENT_READ, None)
        self._pending: list[Callable[[], None]] = []
        self._closed = False
        # Forwarders live in the egress netns: their upstream sockets are made there.
        self._forwarders = FairThreads(FORWARDERS, FORWARDER_SHARE, "resolver-forward", lambda: _netns.enter(netns))
        self._thread = threading.Thread(target=self._loop, name="resolver", daemon=True)
        self._thread.start()

    def serve(self, key: str, gateway: ipaddress.IPv4Address, allowed: Allowed, refuses: Refuses, opens: Opens) -> None:
        """Answer on ``gateway``:53 (an address of the egress netns) for sandbox ``key``."""

        def bind() -> tuple[socket.socket, socket.socket]:
            made: list[socket.socket] = []
            try:
                for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
                    made.append(socket.socket(socket.AF_INET, kind | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK))
                    made[-1].bind((str(gateway), 53))
                made[1].listen(TCP_BACKLOG)
            except BaseException:
                for sock in made:
                    sock.close()
                raise
            return made[0], made[1]

        served = _Served(key, *_netns.call_in(self._netns, bind), allowed, refuses, opens)
        with self._lock:
            self._served[key] = served  # from here, stop_serving() closes its sockets whatever follows

        def register() -> None:
            self._selector.register(served.sock, selectors.EVENT_READ, (served, self._receive))
            self._selector.register(served.listener, selectors.EVENT_READ, (served, self._accept))

        self._in_loop(register)

    def stop_serving(self, key: str) -> None:
        """Close sandbox ``key``'s listeners (idempotent); they are gone when this returns."""
        with self._lock:
            served = self._served.pop(key, None)
        if served is None:
            return

        def unregister() -> None:
            for sock in (served.sock, served.listener):
                with contextlib.suppress(KeyError, ValueError):  # never registered (serve() failed)
                    self._selector.unregister(sock)

        try:
            self._in_loop(unregister)
        finally:  # closed even with the serving thread gone: no listener outlives its sandbox
            served.sock.close()
            served.listener.close()

    def _in_loop(self, change: Callable[[], object]) -> None:
        """Run ``change`` on the serving thread (the only one touching the selector) and wait for it;
        its failure is the caller's (a listener not registered must fail the wiring, not leave the
        sandbox silently unserved), and never stops the changes queued behind it."""
        done = threading.Event()
        failed: list[Exception] = []

        def run() -> None:
            try:
                change()
            except Exception as exc:  # handed to the caller below
                failed.append(exc)
            finally:
                done.set()

        with self._lock:
            self._pending.append(run)
        os.write(self._wake_write, b"x")
        if not done.wait(LOOP_WAIT_S):
            raise SandboxSetupError("the resolver's thread did not answer")
        if failed:
            raise SandboxSetupError(f"the resolver could not change what it serves: {failed[0]!r:.200}") from failed[0]

    def refused(self, key: str) -> tuple[int, dict[str, int]]:
        """Lookups refused so far for sandbox ``key`` (a name not allowed, or only denied answers):
        how many, and how many per name for the first ``MAX_REFUSED_NAMES`` names. Read it before
        ``stop_serving``, which forgets them."""
        with self._lock:
            served = self._served.get(key)
        if served is None:
            return 0, {}
        with served.lock:
            return served.refused_total, dict(served.refused)

    @property
    def serving(self) -> int:
        with self._lock:
            return len(self._served)

    def close(self) -> None:
        """Stop serving every sandbox, then the threads."""
        with self._lock:
            keys = list(self._served)
        for key in keys:
            self.stop_serving(key)
        self._closed = True
        os.write(self._wake_write, b"x")
        self._thread.join(5.0)
        self._forwarders.close()
        self._selector.close()
        os.close(self._wake_read)
        os.close(self._wake_write)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def _loop(self) -> None:
        while not self._closed:
            for selected, _ in self._selector.select():
                try:
                    if selected.data is None:
                        self._take_pending()
                    else:
                        served, handle = selected.data
                        handle(served)
                except Exception:  # one bad query (or a bug) must not silence every sandbox's resolver
                    log.exception("resolver failed a query")

    def _take_pending(self) -> None:
        try:
            os.read(self._wake_read, 4096)
        except BlockingIOError:
            pass
        with self._lock:
            pending, self._pending = self._pending, []
        for change in pending:
            change()

    def _receive(self, served: _Served) -> None:
        """A UDP query: answered here, or forwarded on a forwarder thread."""
        try:
            wire, peer = served.sock.recvfrom(MAX_QUERY_BYTES)
        except OSError:
            return

        def send(response: dns.message.Message) -> None:
            served.sock.sendto(udp_wire(response), peer)

        decided = decide(served, wire)
        if isinstance(decided, dns.message.Message):
            _send_quietly(send, decided)
        elif decided is not None:
            if not self._begin(served):
                _send_quietly(send, _response(decided[0], dns.rcode.SERVFAIL))
                return
            try:
                self._forwarders.submit(served.key, functools.partial(self._forward, served, send, *decided))
            except RuntimeError:  # shutting down
                self._end(served)

    def _accept(self, served: _Served) -> None:
        """A TCP connection: one query read, answered and closed on a thread of its own (in the
        egress netns, for the upstream), so that a silent client holds only its own place."""
        try:
            connection, _ = served.listener.accept()
        except OSError:
            return
        if not self._begin(served):
            connection.close()  # glibc fails the lookup at once: never a hang
            return

        def body() -> None:
            try:
                _netns.enter(self._netns)
            except OSError:
                connection.close()
                self._end(served)
                return
            self._serve_tcp(served, connection)

        threading.Thread(target=body, name="resolver-tcp", daemon=True).start()

    def _begin(self, served: _Served) -> bool:
        if not served.begin():
            return False
        if not self._in_flight.acquire(blocking=False):
            served.end()
            return False
        return True

    def _end(self, served: _Served) -> None:
        served.end()
        self._in_flight.release()

    def _serve_tcp(self, served: _Served, connection: socket.socket) -> None:
        try:
            connection.setblocking(True)
            query = read_tcp_query(connection)
            if query is None:
                return
            decided = decide(served, query)

            def send(response: dns.message.Message) -> None:
                wire = response.to_wire(max_size=MAX_TCP_REPLY_BYTES)
                connection.sendall(struct.pack(">H", len(wire)) + wire)

            if isinstance(decided, dns.message.Message):
                _send_quietly(send, decided)
            elif decided is not None:
                self._forward(served, send, *decided, release=False)
        except (OSError, EOFError, struct.error):
            pass  # a slow, short or closed connection: nothing to answer
        finally:
            connection.close()
            self._end(served)

    def _forward(
        self, served: _Served, send: Callable[[dns.message.Message], None], query: dns.message.Message,
        ports: tuple[int | None, ...], release: bool = True,
    ) -> None:
        try:
            _send_quietly(send, self._answer(served, query, ports))
        except Exception as exc:  # one failed lookup must not end the forwarder
            log.warning("lookup failed", sandbox=served.key, error=str(exc)[:300])
            _send_quietly(send, _response(query, dns.rcode.SERVFAIL))
        finally:
            if release:
                self._end(served)

    def _answer(self, served: _Served, query: dns.message.Message, ports: tuple[int | None, ...]) -> dns.message.Message:
        name = query.question[0].name
        upstream = self._ask_upstream(name)
        if upstream is None:
            return _response(query, dns.rcode.SERVFAIL)
        if upstream.rcode() != dns.rcode.NOERROR:
            return _response(query, upstream.rcode())
        addresses, ttl = _addresses(upstream, name)
        # Each once: a CNAME chain can repeat an address, and one batch cannot delete an element twice.
        kept = list(dict.fromkeys(a for a in addresses if not served.refuses(a)))[:MAX_ANSWER_ADDRESSES]
        if addresses and not kept:
            _count_refusal(served, name.to_text(omit_final_dot=True).lower(), "only denied addresses")
        if not kept:
            return _response(query, dns.rcode.NXDOMAIN if addresses else dns.rcode.NOERROR)
        ttl = max(MIN_OPEN_S, min(MAX_OPEN_S, ttl))
        served.opens(kept, ports, ttl)  # before the reply: the first SYN must find them open
        response = _response(query, dns.rcode.NOERROR)
        response.answer.append(dns.rrset.from_text_list(name, ttl, "IN", "A", [str(a) for a in kept]))
        return response

    def _ask_upstream(self, name: dns.name.Name) -> dns.message.Message | None:
        for upstream in self._upstreams:
            try:
                return dns.query.udp(dns.message.make_query(name, dns.rdatatype.A), upstream, timeout=UPSTREAM_TIMEOUT_S)
            except (dns.exception.DNSException, OSError) as exc:
                log.warning("upstream resolver failed", upstream=upstream, error=str(exc)[:300])
        return None



def udp_wire(response: dns.message.Message) -> bytes:
    """``response`` as a UDP reply: whole when it fits MAX_REPLY_BYTES, else its question alone with
    TC set, which tells the client to ask again over TCP (RFC 1035) rather than get no reply."""
    try:
        return response.to_wire(max_size=MAX_REPLY_BYTES)
    except dns.exception.TooBig:
        truncated = dns.message.Message(id=response.id)
        truncated.flags = response.flags | dns.flags.TC
        truncated.set_rcode(response.rcode())
        truncated.question = list(response.question)  # a name of at most 255 bytes: it fits
        return truncated.to_wire(max_size=MAX_REPLY_BYTES)


def _send_quietly(send: Callable[[dns.message.Message], None], response: dns.message.Message) -> None:
    try:
        send(response)
    except (OSError, dns.exception.DNSException):
        pass  # the listener closed under us (sandbox removed), or a peer gone: the job retries


def read_tcp_query(connection: socket.socket, within_s: float = TCP_READ_TIMEOUT_S) -> bytes | None:
    """A length-prefixed query read by one deadline (None: longer than a query may be).
    TimeoutError when the deadline passes, however the bytes trickle in."""
    deadline = time.monotonic() + within_s
    (length,) = struct.unpack(">H", _read_exactly(connection, 2, deadline))
    return None if length > MAX_QUERY_BYTES else _read_exactly(connection, length, deadline)


def _read_exactly(connection: socket.socket, count: int, deadline: float) -> bytes:
    data = b""
    while len(data) < count:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("the query took longer than its deadline")
        connection.settimeout(left)
        more = connection.recv(count - len(data))
        if not more:
            raise EOFError
        data += more
    return data


def decide(served: _Served, wire: bytes) -> dns.message.Message | tuple[dns.message.Message, tuple[int | None, ...]] | None:
    """A query's reply when it is decided here; (query, ports) when it goes upstream; None for garbage."""
    try:
        query = dns.message.from_wire(wire)
    except Exception:  # dnspython raises many kinds for garbage; a bad query just gets no answer
        return None
    if len(query.question) != 1 or query.question[0].rdclass != dns.rdataclass.IN:
        return _response(query, dns.rcode.FORMERR)
    question = query.question[0]
    name = question.name.to_text(omit_final_dot=True).lower()
    labels = question.name.labels[:-1] if question.name.is_absolute() else question.name.labels
    ports = served.allowed(name) if all(_HOST_LABEL.fullmatch(label) for label in labels) else None
    if ports is None:
        _count_refusal(served, name, "not allowed")
        return _response(query, dns.rcode.NXDOMAIN)
    if question.rdtype != dns.rdatatype.A:
        return _response(query, dns.rcode.NOERROR)  # no IPv6 in the sandbox
    return query, ports


def _count_refusal(served: _Served, name: str, why: str) -> None:
    """Count a refused lookup; a name's first refusal is logged (a job looping on one is not a log flood)."""
    with served.lock:
        served.refused_total += 1
        first = name not in served.refused
        if first and len(served.refused) >= MAX_REFUSED_NAMES:
            return
        served.refused[name] = served.refused.get(name, 0) + 1
    if first:
        log.info("lookup refused", sandbox=served.key, name=name[:MAX_DNS_NAME_CHARS], why=why)


def _response(query: dns.message.Message, rcode: int) -> dns.message.Message:
    response = dns.message.make_response(query)
    response.set_rcode(rcode)
    response.flags |= dns.flags.RA
    return response


def _addresses(answer: dns.message.Message, name: dns.name.Name) -> tuple[list[ipaddress.IPv4Address], int]:
    """The A addresses ``answer`` gives for ``name`` (through its CNAME chain) and their least TTL."""
    wanted, addresses, ttl = {name}, [], MAX_OPEN_S
    for _ in range(8):  # CNAME hops followed: more is a loop or an abuse
        for rrset in answer.answer:
            if rrset.name in wanted and rrset.rdtype == dns.rdatatype.CNAME:
                wanted |= {rdata.target for rdata in rrset}
    for rrset in answer.answer:
        if rrset.name in wanted and rrset.rdtype == dns.rdatatype.A:
            ttl = min(ttl, rrset.ttl)
            addresses += [ipaddress.IPv4Address(rdata.address) for rdata in rrset]
    return addresses, ttl
