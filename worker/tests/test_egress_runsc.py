"""The proof with gVisor: readie's own base checkpoint (captured with --network=none) restored
with --network=sandbox into a wired namespace, and code in it reaching the test world only as
its rules allow. Nothing leaves the tests' namespaces (host blackhole routes meanwhile)."""

from __future__ import annotations

import dataclasses
import pickle
import sys

import cloudpickle
import pytest

from readie_worker import _netns
from readie_worker.egress_net import EgressGateway, Refusal, with_sandbox_network
from readie_worker.sandbox import checkpoint_factory
from worker.tests import _egress_world as w

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def egress():
    with w.world() as world:
        opened = EgressGateway(w.config()).start()
        resolver = opened.resolver
        try:
            yield opened, world
        finally:
            opened.close()
        assert not resolver.alive, "the resolver's thread outlived close()"
        assert w.leftovers() == []


def inside(sandbox, func, *args):
    """Run ``func(*args)`` in the sandbox (shipped by value: test modules are not importable there)."""
    cloudpickle.register_pickle_by_value(sys.modules[func.__module__])
    envelope = pickle.loads(sandbox.call(cloudpickle.dumps({"func": func, "args": args, "kwargs": {}}), timeout=60))
    assert envelope["ok"], envelope
    return envelope["value"]


def probe(gateway, port, targets, names, connect_source):
    """In the sandbox: connect to each target (``connect_source``: ``_egress_world.CONNECT``), and
    look names up at the gateway with a DNS query written by hand (the template's resolv.conf
    names no resolver yet)."""
    import random
    import socket
    import struct

    scope: dict = {}
    exec(connect_source, scope)
    connect = scope["connect"]

    def lookup(name):
        ident = random.randrange(65536)
        question = b"".join(bytes([len(label)]) + label.encode() for label in name.split(".")) + b"\0"
        query = struct.pack(">HHHHHH", ident, 0x0100, 1, 0, 0, 0) + question + struct.pack(">HH", 1, 1)
        sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        sock.settimeout(5)
        try:
            sock.sendto(query, (gateway, 53))
            answer = sock.recv(512)
        finally:
            sock.close()
        rcode, count = answer[3] & 0x0F, struct.unpack(">H", answer[6:8])[0]
        # One A record for a single question: its 4 address bytes end the message.
        return (rcode, socket.inet_ntoa(answer[-4:]) if count else None)

    looked_up = {name: lookup(name) for name in names}
    reached = {name: connect(address, port)[0] for name, (rcode, address) in looked_up.items() if address}
    return {
        "interfaces": sorted(name for _, name in socket.if_nameindex()),
        "connects": {f"{address}:{to_port}": connect(address, to_port) for address, to_port in targets},
        "lookups": looked_up,
        "by_name": reached,
    }


def test_a_restored_sandbox_reaches_what_its_rules_allow_and_is_refused_the_rest(runsc, checkpoints, short_tmp, egress):
    opened, world = egress
    network = opened.wire(w.RULES)
    try:
        factory = checkpoint_factory(with_sandbox_network(runsc), checkpoints.manifest, checkpoints.usable["base"], short_tmp)
        # No cold fallback: it would hide a restore that failed.
        factory = dataclasses.replace(factory, primary=dataclasses.replace(factory.primary, network_namespace=network.netns_path), fallback=None)
        sandbox = factory.create()
        try:
            targets = [(w.ALLOWED, w.PORT), (w.DENIED, w.PORT), (w.METADATA, w.PORT), (w.METADATA, 80), (w.ALLOWED, 9000)]
            first = inside(sandbox, probe, str(network.gateway), w.PORT, targets, ["allowed.test", "denied.test", "rebind.test"], w.CONNECT)
            world.upstream.names["rebind.test"] = w.DENIED  # re-pointed upstream
            rebound = inside(sandbox, probe, str(network.gateway), w.PORT, [(w.DENIED, w.PORT)], ["rebind.test"], w.CONNECT)
        finally:
            sandbox.destroy()
            world.upstream.names["rebind.test"] = w.ALLOWED
        refused = network.refused()
    finally:
        network.remove()
    assert first["interfaces"] == ["eth0", "lo"]
    connects = first["connects"]
    assert connects[f"{w.ALLOWED}:{w.PORT}"][0] == "ok"
    for target in (f"{w.DENIED}:{w.PORT}", f"{w.METADATA}:{w.PORT}", f"{w.METADATA}:80", f"{w.ALLOWED}:9000"):
        outcome, seconds = connects[target]
        assert (outcome, seconds < 0.5) == ("ECONNREFUSED", True), (target, outcome, seconds)  # never a hang
    assert first["lookups"]["allowed.test"] == (0, w.ALLOWED) and first["by_name"]["allowed.test"] == "ok"
    assert first["lookups"]["denied.test"] == (3, None)  # NXDOMAIN: not an allowed name
    assert first["by_name"]["rebind.test"] == "ok"
    assert rebound["lookups"]["rebind.test"] == (3, None)  # the denied answer was dropped
    assert rebound["connects"][f"{w.DENIED}:{w.PORT}"][0] == "ECONNREFUSED"
    assert Refusal(w.DENIED, w.PORT, 2) in refused and Refusal(w.METADATA, 80, 1) in refused
    assert not _netns.present(network.netns)
    assert w.leftovers(table_closed=False) == []
