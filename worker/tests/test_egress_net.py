"""Egress enforcement on real namespaces, nftables and sockets (no gVisor here: a plain process
in the sandbox's namespace plays the sandbox; test_egress_runsc.py proves it with gVisor's
netstack). Everything stays in the tests' own namespaces, behind host blackhole routes."""

from __future__ import annotations

import concurrent.futures
import dataclasses
import errno
import socket
import time

import dns.message
import dns.query
import dns.rcode
import pytest

from readie_worker import _netns, _nft, _resolver
from readie_worker.egress_net import EgressGateway, NetRules, Refusal
from readie_worker.errors import ConfigError, SandboxSetupError
from readie_worker.testing import wait_until
from worker.tests import _egress_world as w


@pytest.fixture(scope="module")
def world():
    with w.world() as made:
        yield made


@pytest.fixture(scope="module")
def egress(world):
    opened = EgressGateway(w.config()).start()
    yield opened
    opened.close()
    assert w.leftovers() == []


@pytest.fixture
def wired(egress):
    network = egress.wire(w.RULES)
    yield network
    network.remove()


def connect(network, address: str, port: int = w.PORT) -> str:
    """Connect from inside the sandbox's namespace: 'ok' or the errno's name."""

    def attempt() -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.settimeout(3)
        try:
            sock.connect((address, port))
            sock.sendall(b"GET / HTTP/1.0\r\n\r\n")
            return "ok" if sock.recv(100).startswith(b"HTTP/1.0 200") else "bad answer"
        except OSError as exc:
            return "timeout" if isinstance(exc, TimeoutError) else errno.errorcode[exc.errno]
        finally:
            sock.close()

    return _netns.call_in(network.netns, attempt)


def lookup(network, name: str, rdtype: str = "A") -> dns.message.Message:
    return _netns.call_in(network.netns, lambda: dns.query.udp(dns.message.make_query(name, rdtype), str(network.gateway), timeout=3))


def addresses(answer: dns.message.Message) -> list[str]:
    return sorted(rdata.address for rrset in answer.answer for rdata in rrset)


def test_an_allowed_network_is_reachable_and_everything_else_is_refused_at_once(wired):
    assert connect(wired, w.ALLOWED) == "ok"
    started = time.monotonic()
    for address, port in ((w.DENIED, w.PORT), (w.METADATA, w.PORT), (w.METADATA, 80), (w.ALLOWED, 9000), (w.UPLINK_EGRESS, 22)):
        assert connect(wired, address, port) == "ECONNREFUSED", (address, port)
    assert time.monotonic() - started < 1.0  # refused, never dropped: no connect waits out its timeout
    refused = wired.refused()
    assert Refusal(w.DENIED, w.PORT, 1) in refused and Refusal(w.METADATA, 80, 1) in refused
    assert Refusal(w.ALLOWED, 9000, 1) in refused  # an allowed network, another port
    assert Refusal(w.UPLINK_EGRESS, 22, 1) in refused  # the egress namespace's own addresses


def test_public_opens_the_world_but_never_the_default_denied(egress, world):
    network = egress.wire(NetRules(public=True, denied=w.DEFAULT_DENIED))
    try:
        assert connect(network, w.METADATA) == "ECONNREFUSED"
        assert connect(network, w.DENIED) == "ECONNREFUSED"
        assert [refusal.address for refusal in network.refused()] == sorted([w.DENIED, w.METADATA])
    finally:
        network.remove()
    opened = egress.wire(NetRules(public=True, denied=w.DEFAULT_DENIED, opened=((w.N(f"{w.METADATA}/32"), None),)))
    try:
        assert connect(opened, w.METADATA) == "ok"  # named by the ceiling: open
        assert connect(opened, w.DENIED) == "ECONNREFUSED"
    finally:
        opened.remove()


def test_a_public_sandboxs_answers_add_nothing_to_the_kernels_sets(egress, world, monkeypatch):
    """Every address not denied is open to it already: a job resolving name after name in a zone
    of its own would otherwise fill kernel memory for an hour a name."""
    answered: list[object] = []
    real_batch = _nft.answered_batch
    monkeypatch.setattr(_nft, "answered_batch", lambda *args: answered.append(args) or real_batch(*args))
    network = egress.wire(NetRules(public=True))  # nothing denied: the test world's addresses are private
    try:
        assert addresses(lookup(network, "allowed.test")) == [w.ALLOWED] and answered == []
        assert connect(network, w.ALLOWED) == "ok"
    finally:
        network.remove()


def test_broadcast_from_a_public_sandbox_reaches_no_listener_of_the_egress_netns(egress):
    listener = _netns.call_in(w.EGRESS, lambda: socket.socket(socket.AF_INET, socket.SOCK_DGRAM))
    listener.bind(("0.0.0.0", 9999))  # a wildcard UDP service of the egress netns (rpcbind, avahi...)
    listener.settimeout(0.5)
    network = egress.wire(NetRules(public=True, denied=w.DEFAULT_DENIED))
    broadcasts = [str(network.address + 1), "255.255.255.255"]
    try:
        def send() -> None:
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_BROADCAST, 1)
                for address in broadcasts:
                    sock.sendto(b"hello", (address, 9999))

        _netns.call_in(network.netns, send)
        with pytest.raises(TimeoutError):
            listener.recvfrom(100)
        assert {refusal.address for refusal in network.refused()} == set(broadcasts)
    finally:
        listener.close()
        network.remove()


def test_a_packet_with_a_source_not_the_sandboxs_own_is_refused(wired):
    spoofed = "10.199.9.9"  # the sandbox gave itself another address (it would need CAP_NET_ADMIN)
    _netns.ip_batch(wired.netns, [f"addr add {spoofed}/32 dev eth0"])

    def attempt() -> str:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.settimeout(0.5)  # the refusal goes to the spoofed address, not back to the sandbox
            sock.bind((spoofed, 0))
            try:
                sock.connect((w.ALLOWED, w.PORT))
                return "ok"
            except OSError as exc:
                return "timeout" if isinstance(exc, TimeoutError) else errno.errorcode[exc.errno]

    assert connect(wired, w.ALLOWED) == "ok"
    assert _netns.call_in(wired.netns, attempt) != "ok"
    assert [refusal.address for refusal in wired.refused()] == [w.ALLOWED]  # refused, though the network is allowed


def test_a_sandbox_past_its_connection_bound_is_refused_new_ones(wired):
    def flood() -> None:  # each socket is a new source port: a new tracked connection
        for _ in range(_nft.MAX_CONNECTIONS_PER_SANDBOX + 16):
            with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
                sock.sendto(b"x", (w.ALLOWED, w.PORT))

    _netns.call_in(wired.netns, flood)
    refused = wired.refused()
    assert [refusal.address for refusal in refused] == [w.ALLOWED] and refused[0].count >= 8  # an allowed address (the bound is checked as entries are confirmed: a few slack)


def test_the_resolver_answers_allowed_names_only_and_opens_what_it_answered(wired, world):
    assert connect(wired, w.ALLOWED) == "ok"  # by its network; now by name, on any port
    answer = lookup(wired, "allowed.test")
    assert (answer.rcode(), addresses(answer)) == (dns.rcode.NOERROR, [w.ALLOWED])
    assert lookup(wired, "allowed.test", "AAAA").answer == []  # no IPv6 in a sandbox
    assert lookup(wired, "a.api.test").rcode() == dns.rcode.NOERROR  # *.api.test
    for refused_name in ("denied.test", "api.test", "example.com"):
        assert lookup(wired, refused_name).rcode() == dns.rcode.NXDOMAIN, refused_name
    assert wired.refused_lookups() == (3, {"denied.test": 1, "api.test": 1, "example.com": 1})


def test_a_name_answered_opens_its_address_and_a_rebound_name_opens_nothing_denied(egress, world):
    network = egress.wire(NetRules(names=(("rebind.test", None),), denied=w.DEFAULT_DENIED, opened=((w.N("10.199.1.0/24"), None),)))
    try:
        assert connect(network, w.OTHER_ALLOWED) == "ECONNREFUSED"  # not answered yet
        world.upstream.names["rebind.test"] = w.OTHER_ALLOWED
        assert addresses(lookup(network, "rebind.test")) == [w.OTHER_ALLOWED]
        assert connect(network, w.OTHER_ALLOWED) == "ok"  # opened by the answer, before the reply left
        world.upstream.names["rebind.test"] = w.DENIED
        assert lookup(network, "rebind.test").rcode() == dns.rcode.NXDOMAIN  # a denied answer is dropped
        assert connect(network, w.DENIED) == "ECONNREFUSED"  # and the connect-time check holds anyway
        world.upstream.names["rebind.test"] = w.METADATA
        assert lookup(network, "rebind.test").rcode() == dns.rcode.NXDOMAIN
        assert network.refused_lookups() == (2, {"rebind.test": 2})
    finally:
        world.upstream.names["rebind.test"] = w.ALLOWED
        network.remove()


def test_sandboxes_wired_at_once_get_distinct_subnets_and_leave_nothing(egress):
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        networks = list(pool.map(lambda _: egress.wire(w.RULES), range(4)))
    try:
        assert len({network.subnet for network in networks}) == 4
        assert all(network.subnet.subnet_of(w.POOL) for network in networks)
        assert connect(networks[0], str(networks[1].address), 22) == "ECONNREFUSED"  # not each other
    finally:
        for network in networks:
            network.remove()
    assert egress.wired == 0 and egress.subnets.in_use == 0 and egress.resolver.serving == 0
    assert w.leftovers(table_closed=False) == [], "a removed sandbox network left something"
    networks[0].remove()  # idempotent


def test_a_wiring_that_fails_part_way_is_removed(egress, monkeypatch):
    def broken(*args, **kwargs):
        raise SandboxSetupError("nft refused, as the test asked")

    monkeypatch.setattr("readie_worker.egress_net._nft.sandbox_batch", broken)
    with pytest.raises(SandboxSetupError, match="as the test asked"):
        egress.wire(w.RULES)
    assert w.leftovers(table_closed=False) == [] and egress.wired == 0 and egress.subnets.in_use == 0


def test_an_egress_namespace_that_does_not_exist_is_a_clear_error():
    with pytest.raises(ConfigError, match="egress_netns: no network namespace named 'rdtest-none'"):
        EgressGateway(w.config().__class__(netns="rdtest-none", upstreams=())).start()


def test_garbage_and_floods_at_the_resolver_get_no_answer_or_a_bounded_one_and_it_keeps_serving(wired):
    def send_garbage() -> None:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        for payload in (b"", b"\x00", b"\xff" * 12, b"\x12\x34" + b"\x01\x00\x00\x02" + b"\x00" * 6, b"x" * 4000):
            sock.sendto(payload, (str(wired.gateway), 53))
        sock.close()

    _netns.call_in(wired.netns, send_garbage)
    many = dns.message.make_query("allowed.test", "A")
    many.question.append(many.question[0])  # two questions: refused as malformed, with an answer
    assert _netns.call_in(wired.netns, lambda: dns.query.udp(many, str(wired.gateway), timeout=3)).rcode() == dns.rcode.FORMERR
    long_name = ".".join(["a" * 60] * 4)
    assert lookup(wired, long_name).rcode() == dns.rcode.NXDOMAIN
    assert addresses(lookup(wired, "allowed.test")) == [w.ALLOWED]


def test_opening_sweeps_what_an_earlier_run_left(world):
    # A prefix, table and pool of its own: the module's EgressGateway stays untouched (and so is checked).
    settings = dataclasses.replace(w.config(prefix="rds", table="readiesweep"), pool=w.N("198.19.255.128/25"))
    crashed = EgressGateway(settings).start()
    left = [crashed.wire(w.RULES) for _ in range(2)]  # never removed: the worker "died"
    assert len(w.leftovers("rds", "readiesweep", table_closed=False)) > 0
    crashed.resolver.close()
    reopened = EgressGateway(settings).start()
    try:
        assert w.leftovers("rds", "readiesweep", table_closed=False) == []
        assert all(not _netns.present(network.netns) for network in left)
    finally:
        reopened.close()
    assert w.leftovers("rds", "readiesweep") == []


def test_tcp_lookups_are_answered_and_one_sandboxs_flood_leaves_the_others_served(egress, wired):
    answer = _netns.call_in(wired.netns, lambda: dns.query.tcp(dns.message.make_query("allowed.test", "A"), str(wired.gateway), timeout=3))
    assert addresses(answer) == [w.ALLOWED]

    def silent_connections() -> list[socket.socket]:
        return [socket.create_connection((str(wired.gateway), 53), timeout=3) for _ in range(_resolver.MAX_IN_FLIGHT_PER_SANDBOX)]

    held = _netns.call_in(wired.netns, silent_connections)
    other = egress.wire(w.RULES)
    try:
        # Once the resolver has accepted them all, this sandbox's places are taken: SERVFAIL at once.
        assert wait_until(lambda: lookup(wired, "allowed.test").rcode() == dns.rcode.SERVFAIL, 3)
        # Another sandbox is served (within a few tries: the tests' upstream is a Python thread, slow
        # under load, and one timed-out forward is not what this checks).
        assert wait_until(lambda: addresses(lookup(other, "allowed.test")) == [w.ALLOWED], 10)
    finally:
        for connection in held:
            connection.close()
        other.remove()
    assert wait_until(lambda: lookup(wired, "allowed.test").rcode() == dns.rcode.NOERROR, 3)


def test_a_failed_nft_or_ip_says_where_the_details_are_not_the_hosts_names(world):
    for failing in (
        lambda: _nft.Nft(w.EGRESS).run("add rule inet readienone nochain accept\n"),
        lambda: _netns.ip_batch(w.EGRESS, ["link delete rdtnosuchdev"]),
    ):
        with pytest.raises(SandboxSetupError) as failed:
            failing()
        assert "worker's log" in str(failed.value) and "rdt" not in str(failed.value)


def stale_reply(world) -> str:
    """Listen where the first sandbox's flow came from while the world sends on that flow."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.settimeout(1)
    try:
        sock.bind(("0.0.0.0", 40000))
        world.udp_echo.sendto(b"stale", world.echoed_to)
        return sock.recv(100).decode()
    except TimeoutError:
        return "timeout"
    finally:
        sock.close()


def test_refusals_past_a_full_refused_set_are_still_counted(wired):
    ports = range(20000, 20000 + _nft.REFUSED_SET_SIZE + 44)

    def refused_everywhere() -> list[str]:
        outcomes = []
        for port in ports:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
                sock.settimeout(3)
                outcomes.append(errno.errorcode.get(sock.connect_ex((w.DENIED, port)), "ok"))
        return outcomes

    assert set(_netns.call_in(wired.netns, refused_everywhere)) == {"ECONNREFUSED"}
    report = wired.report()
    assert len(wired.refused(limit=10_000)) == _nft.REFUSED_SET_SIZE  # itemised: the set is full
    assert report.refused_connections == len(ports)  # counted: every one
    assert wired.report().refused_connections == 0  # and told once


def test_a_reply_forged_by_another_sandbox_reaches_no_sandboxs_flow(egress, world):
    victim, forger = egress.wire(w.RULES), egress.wire(w.RULES)

    def open_flow() -> socket.socket:  # the victim's UDP flow to the world's echo, left open
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(2)
        sock.bind(("0.0.0.0", 40001))
        sock.connect((w.ALLOWED, w.PORT))
        sock.send(b"ping")
        assert sock.recv(100) == b"ping"
        return sock

    def forge(to: tuple[str, int]) -> None:  # the server's address and port, as the flow's reply
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.bind((w.ALLOWED, w.PORT))
            sock.sendto(b"INJECTED", to)

    try:
        flow = _netns.call_in(victim.netns, open_flow)
        try:
            masqueraded = world.echoed_to  # where the world's replies to the flow go
            _netns.ip_batch(forger.netns, [f"addr add {w.ALLOWED}/32 dev eth0"])  # it would need CAP_NET_ADMIN
            _netns.call_in(forger.netns, lambda: forge(masqueraded))
            flow.settimeout(1)
            with pytest.raises(TimeoutError):
                flow.recv(100)
            world.udp_echo.sendto(b"real", masqueraded)  # the flow itself still works
            assert flow.recv(100) == b"real"
        finally:
            flow.close()
    finally:
        victim.remove()
        forger.remove()


def test_a_reused_address_inherits_nothing_of_its_last_sandboxs_connections(world):
    # One /30: the second sandbox gets the first one's address while conntrack still holds its flow.
    settings = dataclasses.replace(w.config(prefix="rdr", table="readiereuse"), pool=w.N("198.19.255.252/30"))
    egress = EgressGateway(settings).start()

    def udp_echo() -> str:
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(2)
        try:
            sock.bind(("0.0.0.0", 40000))  # the same source port both times: the same conntrack tuple
            sock.connect((w.ALLOWED, w.PORT))
            sock.send(b"ping")
            return sock.recv(100).decode()
        except OSError as exc:
            return "timeout" if isinstance(exc, TimeoutError) else errno.errorcode[exc.errno]
        finally:
            sock.close()

    try:
        first = egress.wire(w.RULES)
        assert _netns.call_in(first.netns, udp_echo) == "ping"
        first.remove()
        second = egress.wire(NetRules(denied=w.DEFAULT_DENIED))  # allowed nothing
        try:
            assert second.address == first.address
            # The world answers the first sandbox's flow again: the reply must not reach the second.
            assert _netns.call_in(second.netns, lambda: stale_reply(world)) == "timeout"
            assert _netns.call_in(second.netns, udp_echo) == "ECONNREFUSED"
        finally:
            second.remove()
    finally:
        egress.close()
    assert w.leftovers("rdr", "readiereuse") == []


def test_a_containers_own_namespace_serves_as_its_egress_under_a_name_it_gives_and_takes_back(world):
    # A worker whose own namespace is the egress one, as in a pod (--egress-own-netns): here a
    # thread inside the tests' egress namespace starts the gateway. The name's file is there
    # already, empty, as a worker killed in a container that keeps its files leaves it.
    (_netns.NETNS_DIR / "rdtest-own").touch()
    settings = dataclasses.replace(w.config(prefix="rdo", table="readieown"), netns="rdtest-own", own=True)
    egress = _netns.call_in(w.EGRESS, EgressGateway(settings).start)
    try:
        assert _netns.identity("rdtest-own") == _netns.identity(w.EGRESS)
        network = egress.wire(w.RULES)
        try:
            assert connect(network, w.ALLOWED) == "ok"
            assert connect(network, w.DENIED) == "ECONNREFUSED"
        finally:
            network.remove()
    finally:
        egress.close()
    assert not _netns.present("rdtest-own") and _netns.present(w.EGRESS)  # the name only goes
    assert w.leftovers("rdo", "readieown") == []


def test_a_name_that_is_another_namespace_is_never_taken_for_the_workers_own(world):
    settings = dataclasses.replace(w.config(), own=True)  # names the tests' egress namespace
    with pytest.raises(SandboxSetupError, match="exists and is not this worker's own"):
        EgressGateway(settings).start()  # this thread's namespace is the host's
    assert _netns.present(w.EGRESS)
