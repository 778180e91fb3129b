"""The pure parts of egress enforcement: nft text, refused-set parsing, /30 allocation, rule
matching, and what a restore needs of runsc and the spec. No namespace, no nft process."""

from __future__ import annotations

import concurrent.futures
import ipaddress
import json
import socket
import threading
import time
from pathlib import Path

import dns.flags
import dns.message
import dns.name
import dns.rcode
import dns.rrset
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import fuzz_examples
from readie_worker import _nft, _resolver
from readie_worker.bundle import SandboxSpec
from readie_worker.egress_net import HIDE_NET_SYSCTLS, EgressConfig, NetRules, Subnets, host_nameservers, with_sandbox_network
from readie_worker.errors import ConfigError, SandboxSetupError
from readie_worker.runsc import Runsc

N = ipaddress.IPv4Network
RULES = _nft.SandboxRules(
    key="0a1b2c3d",
    veth="rdiev0a1b2c3d",
    address=ipaddress.IPv4Address("198.18.0.2"),
    deny=(N("10.0.0.0/8"), N("10.1.0.0/16"), N("169.254.0.0/16")),
    opened=((N("10.9.0.0/24"), 443),),
    allow=((N("10.9.0.0/24"), 443), (N("203.0.113.0/24"), None)),
    public=False,
)


def test_a_sandbox_chain_refuses_denied_addresses_before_anything_opens_them():
    lines = _nft.sandbox_batch("readie", RULES).splitlines()
    chain = [line.split(" sb_0a1b2c3d ", 1)[1] for line in lines if line.startswith("add rule inet readie sb_0a1b2c3d ")]
    assert chain == [
        "ip saddr != 198.18.0.2 goto rf_0a1b2c3d",  # a spoofed source: refused first
        "ct state established,related ct mark 0x0a1b2c3d accept",
        f"ct state new add @conns_0a1b2c3d {{ ip saddr ct count over {_nft.MAX_CONNECTIONS_PER_SANDBOX} }} goto rf_0a1b2c3d",
        "ct state new ct mark set 0x0a1b2c3d",
        "fib daddr type { local, broadcast, multicast, anycast } goto rf_0a1b2c3d",
        "ip daddr { 0.0.0.0/8, 224.0.0.0/3 } goto rf_0a1b2c3d",
        "ip daddr @deny_0a1b2c3d meta l4proto != { tcp, udp } goto rf_0a1b2c3d",  # opened only on ports
        "ip daddr @deny_0a1b2c3d ip daddr . th dport != @open_0a1b2c3d goto rf_0a1b2c3d",
        'meta l4proto { tcp, udp } ip daddr . th dport @allow_0a1b2c3d counter name "allowed_0a1b2c3d" accept',
        'ip daddr @dns_0a1b2c3d counter name "allowed_0a1b2c3d" accept',
        'meta l4proto { tcp, udp } ip daddr . th dport @dnsport_0a1b2c3d counter name "allowed_0a1b2c3d" accept',
        'ip daddr @public_0a1b2c3d counter name "allowed_0a1b2c3d" accept',  # empty unless public
        "goto rf_0a1b2c3d",
    ]
    assert "add counter inet readie allowed_0a1b2c3d" in lines
    assert not any("public_0a1b2c3d {" in line for line in lines if line.startswith("add element"))
    assert "add element inet readie deny_0a1b2c3d { 10.0.0.0/8, 169.254.0.0/16 }" in lines  # overlaps collapsed
    assert "add element inet readie allow_0a1b2c3d { 203.0.113.0/24 . 0-65535, 10.9.0.0/24 . 443 }" in lines
    assert 'add element inet readie refusers { "rdiev0a1b2c3d" : goto rf_0a1b2c3d }' in lines
    assert 'add element inet readie owners { "rdiev0a1b2c3d" . 0x0a1b2c3d }' in lines  # its replies' mark
    refuse = [line.split(" rf_0a1b2c3d ", 1)[1] for line in lines if line.startswith("add rule inet readie rf_0a1b2c3d ")]
    assert refuse[0] == 'meta l4proto { tcp, udp } counter name "refusals_0a1b2c3d"'  # before the set, which can be full
    assert lines[-1] == 'add element inet readie sandboxes { "rdiev0a1b2c3d" : jump sb_0a1b2c3d }'


def test_public_accepts_what_is_not_denied_and_nothing_ever_drops():
    text = _nft.sandbox_batch("readie", RULES.__class__(**{**RULES.__dict__, "public": True}))
    # The chain is the same for every policy: public is an element of its public set.
    assert "add element inet readie public_0a1b2c3d { 0.0.0.0/0 }" in text.splitlines()
    for batch in (text, _nft.base_batch("readie", N("198.18.0.0/16"), "rdiev")):
        assert " drop" not in batch and "admin-prohibited" not in batch  # a drop hangs the job; gVisor ignores admin-prohibited
    assert "meta l4proto tcp reject with tcp reset" in text and "reject with icmpx port-unreachable" in text


def test_forwarding_checks_a_forged_source_before_any_reply_and_forwards_nothing_but_sandboxes():
    def forward(**sole: bool) -> list[str]:
        lines = _nft.base_batch("readie", N("198.18.0.0/16"), "rdiev", **sole).splitlines()
        return [line.split(" forward ", 1)[1] for line in lines if line.startswith("add rule inet readie forward ")]

    shared, own = forward(), forward(sole=True)
    assert shared[:2] == [
        'iifname "rdiev*" fib saddr . iif oif missing iifname vmap @refusers',  # counted as its refusal
        'iifname "rdiev*" fib saddr . iif oif missing reject with icmpx port-unreachable',
    ]
    assert shared[2] == 'ct direction reply oifname "rdiev*" oifname . ct mark != @owners reject with icmpx port-unreachable'
    assert shared.index("ct direction reply ct state established,related accept") == 3
    # The worker's own namespace forwards nothing but its sandboxes'; a shared one may hold others' veths.
    assert own == [*shared[:2], 'iifname != "rdiev*" oifname != "rdiev*" reject with icmpx port-unreachable', *shared[2:]]


def test_the_egress_netns_itself_admits_a_sandbox_only_to_its_own_gateways_resolver():
    lines = _nft.base_batch("readie", N("198.18.0.0/16"), "rdiev").splitlines()
    assert [line.split(" input ", 1)[1] for line in lines if line.startswith("add rule inet readie input ")] == [
        # A forged source before anything accepts a "reply" into the egress netns's own flows.
        'iifname "rdiev*" fib saddr . iif oif missing iifname vmap @refusers',
        'iifname "rdiev*" fib saddr . iif oif missing reject with icmpx port-unreachable',
        "ct state established,related accept",
        'iifname "rdiev*" fib daddr . iif type local meta l4proto { tcp, udp } th dport 53 accept',
        "iifname vmap @refusers",  # broadcast, multicast, its services: refused, never the policy
        'iifname "rdiev*" reject with icmpx port-unreachable',
    ]


@pytest.mark.parametrize(("allow", "elements"), [
    (((N("10.0.0.0/8"), 443), (N("10.1.0.0/16"), 443)), "10.0.0.0/8 . 443"),
    (((N("0.0.0.0/0"), None), (N("1.2.3.0/24"), 443)), "0.0.0.0/0 . 0-65535"),
    (((N("1.2.3.0/24"), None), (N("1.2.2.0/23"), 443), (N("1.2.2.0/23"), 80)), "1.2.3.0/24 . 0-65535, 1.2.2.0/24 . 80, 1.2.2.0/24 . 443"),
])
def test_overlapping_allowed_networks_are_merged_so_the_wiring_batch_cannot_fail(allow, elements):
    text = _nft.sandbox_batch("readie", RULES.__class__(**{**RULES.__dict__, "allow": allow}))
    assert f"add element inet readie allow_0a1b2c3d {{ {elements} }}" in text.splitlines()


def test_removal_adds_each_part_before_deleting_it_so_it_works_on_any_partial_state():
    lines = _nft.remove_batch("readie", "0a1b2c3d", "rdiev0a1b2c3d").splitlines()
    deleted = [line.split()[1:] for line in lines if line.startswith(("delete", "flush"))]
    for kind, *_, name in deleted:
        if kind in ("chain", "set"):
            assert any(line.startswith(f"add {kind} inet readie {name}") for line in lines), name
    assert lines.index("delete element inet readie sandboxes { \"rdiev0a1b2c3d\" }") < lines.index("delete chain inet readie sb_0a1b2c3d")
    assert lines.index("flush chain inet readie sb_0a1b2c3d") < lines.index("delete set inet readie deny_0a1b2c3d")


def test_answered_addresses_open_for_their_ports_and_time_restarted_when_answered_again():
    text = _nft.answered_batch("readie", "k", [ipaddress.IPv4Address("192.0.2.7")], [None, 443], 60)
    assert text.splitlines() == [  # add (no-op if present), delete, add: a present element's timeout restarts
        "add element inet readie dns_k { 192.0.2.7 timeout 60s }",
        "delete element inet readie dns_k { 192.0.2.7 }",
        "add element inet readie dns_k { 192.0.2.7 timeout 60s }",
        "add element inet readie dnsport_k { 192.0.2.7 . 443 timeout 60s }",
        "delete element inet readie dnsport_k { 192.0.2.7 . 443 }",
        "add element inet readie dnsport_k { 192.0.2.7 . 443 timeout 60s }",
    ]


def test_refused_set_json_is_read_most_refused_first_and_garbage_is_skipped():
    document = {"nftables": [{"metainfo": {}}, {"set": {"elem": [
        {"elem": {"val": {"concat": ["10.0.0.1", 80]}, "counter": {"packets": 1, "bytes": 60}}},
        {"elem": {"val": {"concat": ["169.254.169.254", 80]}, "counter": {"packets": 3, "bytes": 180}}},
        {"elem": {"val": {"concat": ["10.0.0.2"]}, "counter": {"packets": 9}}},
        {"elem": {"val": "x"}}, "junk", {"elem": {"val": {"concat": ["10.0.0.3", "80"]}, "counter": {"packets": 2}}},
    ]}}]}
    assert _nft.parse_refused(json.dumps(document)) == [("169.254.169.254", 80, 3), ("10.0.0.1", 80, 1)]
    assert _nft.parse_refused('{"nftables": []}') == []
    with pytest.raises(SandboxSetupError, match="no JSON"):
        _nft.parse_refused("not json")


def test_subnets_are_distinct_under_concurrency_and_bounded_and_reused():
    subnets = Subnets(N("198.18.0.0/26"))  # 16 /30s
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        taken = list(pool.map(lambda _: subnets.take(), range(16)))
    assert len(set(taken)) == 16 and all(net.prefixlen == 30 and net.subnet_of(N("198.18.0.0/26")) for net in taken)
    with pytest.raises(SandboxSetupError, match="all 16 networked sandbox slots"):
        subnets.take()
    subnets.give_back(taken[5])
    assert subnets.take() == taken[5] and subnets.in_use == 16
    for net in taken[:3]:
        subnets.give_back(net)
    first = subnets.take()
    subnets.give_back(first)
    assert subnets.take() != first  # round robin: a freed /30 comes back last
    assert Subnets(N("198.18.0.0/16"), limit=3)._capacity == 3
    with pytest.raises(ValueError, match="smaller than one /30"):
        Subnets(N("198.18.0.0/31"))


def test_names_match_exactly_or_below_a_suffix_with_their_ports():
    rules = NetRules(names=(("API.example.com", 443), ("*.cdn.test", None), ("api.example.com", 8443), ("*.", 1)))
    assert rules.name_ports("api.example.com.") == (443, 8443)
    assert rules.name_ports("a.b.cdn.test") == (None,)
    assert rules.name_ports("cdn.test") is None  # *.suffix is what is below it
    assert rules.name_ports("evilcdn.test") is None
    assert rules.name_ports("example.com") is None


def test_denied_and_own_addresses_are_refused_unless_opened():
    rules = NetRules(denied=(N("10.0.0.0/8"),), own=(N("192.0.2.10/32"),), opened=((N("10.9.0.0/16"), None),))
    address = ipaddress.IPv4Address
    assert rules.refuses(address("10.1.2.3")) and rules.refuses(address("192.0.2.10"))
    assert not rules.refuses(address("10.9.1.1")) and not rules.refuses(address("203.0.113.5"))
    sandbox = rules.sandbox_rules("k", "v", ipaddress.IPv4Address("198.18.0.2"))
    assert sandbox.deny == (N("10.0.0.0/8"), N("192.0.2.10/32")) and sandbox.opened == ((N("10.9.0.0/16"), None),)


def test_a_ceiling_opens_a_denied_address_on_its_own_port_only_and_an_own_address_only_alone():
    """The policy layer's rule, carried over: an attacker review found `0.0.0.0/0` plus
    `10.0.0.5:3128` in a ceiling opening every port of 10.0.0.5 in the firewall."""
    from readie_policy.egress import parse_destinations, resolve_egress

    ceiling = parse_destinations(["0.0.0.0/0", "10.0.0.5:3128", "192.0.2.10:443"])
    egress = resolve_egress(True, ceiling).for_worker([ipaddress.ip_address("192.0.2.10"), ipaddress.ip_address("10.0.0.7")])
    rules = NetRules.of(egress)
    assert set(rules.opened) == {(N("10.0.0.5/32"), 3128), (N("192.0.2.10/32"), 443)}
    elements = _nft.sandbox_batch("readie", rules.sandbox_rules("k", "v", ipaddress.IPv4Address("198.18.0.2")))
    assert "add element inet readie open_k { 192.0.2.10/32 . 443, 10.0.0.5/32 . 3128 }" in elements.splitlines()
    assert N("10.0.0.7/32") in rules.own and N("192.0.2.10/32") not in rules.own  # named alone: its port opened
    for address, port in (("10.0.0.5", 3128), ("10.0.0.5", 22), ("192.0.2.10", 443), ("192.0.2.10", 50061), ("10.0.0.7", 80)):
        assert egress.allows(ipaddress.ip_address(address), port) == ((address, port) in (("10.0.0.5", 3128), ("192.0.2.10", 443)))


def test_the_public_internet_resolves_every_name():
    from readie_policy.egress import Egress

    assert NetRules.of(Egress(public=True)).name_ports("example.com") == (None,)
    assert NetRules.of(Egress()).name_ports("example.com") is None


def test_the_default_upstreams_are_the_hosts_ipv4_nameservers(tmp_path):
    resolv = tmp_path / "resolv.conf"
    resolv.write_text("# comment\nnameserver 192.0.2.53\nnameserver ::1\nnameserver bogus\nsearch x\nnameserver 198.51.100.1 extra\n")
    assert host_nameservers(resolv) == ("192.0.2.53", "198.51.100.1")
    assert host_nameservers(tmp_path / "missing") == ()


def test_a_networked_restore_runs_runsc_with_the_sandbox_stack_and_net_sysctls_hidden(tmp_path):
    runsc = Runsc(root=tmp_path, flags=("--platform=systrap", "--network=none", "--host-uds=create"), checkpoint_flags=())
    networked = with_sandbox_network(runsc)
    command = networked.command("restore", "x")
    assert command[: len(HIDE_NET_SYSCTLS)] == list(HIDE_NET_SYSCTLS)
    assert "--network=sandbox" in command and "--network=none" not in command
    assert "/proc/sys/net" in HIDE_NET_SYSCTLS[6] and HIDE_NET_SYSCTLS[-1] == "sh"


def test_the_spec_names_the_sandboxs_network_namespace_only_when_given():
    spec = SandboxSpec(rootfs=Path("/r"), executor_dir=Path("/e/run"), env={})
    namespaces = spec.oci_config()["linux"]["namespaces"]
    assert {"type": "network"} in namespaces
    joined = SandboxSpec(rootfs=Path("/r"), executor_dir=Path("/e/run"), env={}, network_namespace=Path("/var/run/netns/rdie-0a1b2c3d"))
    assert {"type": "network", "path": "/var/run/netns/rdie-0a1b2c3d"} in joined.oci_config()["linux"]["namespaces"]


@pytest.mark.parametrize(
    "settings",
    [
        {"netns": "../../etc"}, {"netns": ".."}, {"netns": "a b"}, {"table": "readie; flush ruleset"},
        {"prefix": "toolongprefix"}, {"prefix": "r-"}, {"upstreams": ("resolver.example",)},
        {"pool": N("198.18.0.0/31")}, {"netns": None},  # never the host's own namespace by default
    ],
)
def test_operator_settings_that_would_reach_a_path_ip_or_nft_as_more_than_a_name_are_config_errors(settings):
    with pytest.raises(ConfigError):
        EgressConfig(**{"netns": "egress", "upstreams": ("192.0.2.53",), **settings})


@pytest.mark.parametrize(
    "fields",
    [{"networks": (("10.0.0.0/8", None),)}, {"networks": ((N("10.0.0.0/8"), 0),)}, {"names": (("a.test", 70000),)},
     {"names": (("a.test", True),)}, {"denied": ("10.0.0.0/8",)}],
)
def test_rules_hold_only_networks_and_ports_in_range(fields):
    with pytest.raises(ValueError, match="egress"):
        NetRules(**fields)


def _served() -> _resolver._Served:
    rules = NetRules(names=(("allowed.test", 443),))
    return _resolver._Served("k", None, None, rules.name_ports, rules.refuses, lambda *_: None)


def test_the_resolver_decides_by_name_and_type_before_anything_goes_upstream():
    served = _served()
    query = dns.message.make_query("Allowed.Test", "A")
    assert _resolver.decide(served, query.to_wire()) == (query, (443,))
    aaaa = _resolver.decide(served, dns.message.make_query("allowed.test", "AAAA").to_wire())
    assert (aaaa.rcode(), aaaa.answer) == (dns.rcode.NOERROR, [])
    refused = _resolver.decide(served, dns.message.make_query("other.test", "A").to_wire())
    assert refused.rcode() == dns.rcode.NXDOMAIN and served.refused == {"other.test": 1}
    two = dns.message.make_query("allowed.test", "A")
    two.question.append(two.question[0])
    assert _resolver.decide(served, two.to_wire()).rcode() == dns.rcode.FORMERR
    assert _resolver.decide(served, b"\x00\x01") is None


def test_a_name_whose_labels_are_not_a_hostnames_is_refused_never_matched_on_its_escaped_text():
    rules = NetRules(names=(("*.example.com", 443),))
    served = _resolver._Served("k", None, None, rules.name_ports, rules.refuses, lambda *_: None)
    plain = dns.message.make_query("a.Example.com", "A")
    assert _resolver.decide(served, plain.to_wire()) == (plain, (443,))
    # 3 labels, not below example.com, though its text `x.evil\.example.com` ends so.
    for labels in ([b"x", b"evil.example", b"com"], [b"a\\b", b"example", b"com"], [b"a b", b"example", b"com"]):
        escaped = dns.message.make_query(dns.name.Name([*labels, b""]), "A")
        assert _resolver.decide(served, escaped.to_wire()).rcode() == dns.rcode.NXDOMAIN, labels


@settings(max_examples=fuzz_examples(300))
@given(st.binary(max_size=_resolver.MAX_QUERY_BYTES))
def test_any_bytes_at_the_resolver_are_no_answer_a_reply_or_a_question_to_forward(wire):
    decided = _resolver.decide(_served(), wire)
    assert decided is None or isinstance(decided, dns.message.Message) or decided[1] == (443,)


def test_a_tcp_query_dripped_a_byte_at_a_time_is_cut_at_one_deadline_for_the_whole_query():
    client, server = socket.socketpair()
    stop = threading.Event()

    def drip() -> None:  # each read alone would be well within a per-read timeout
        for _ in range(50):
            if stop.wait(0.05):
                return
            client.send(b"\x00" if _ == 0 else b"x")

    threading.Thread(target=drip, daemon=True).start()
    started = time.monotonic()
    try:
        with pytest.raises(TimeoutError):
            _resolver.read_tcp_query(server, within_s=0.3)
        assert time.monotonic() - started < 0.6
    finally:
        stop.set()
        client.close()
        server.close()


def test_a_change_the_resolvers_thread_fails_is_the_callers_failure_and_the_next_change_still_runs():
    resolver = _resolver.Resolver(None, ("192.0.2.53",))
    try:
        with pytest.raises(SandboxSetupError, match="could not change what it serves"):
            resolver._in_loop(lambda: 1 / 0)  # e.g. a listener whose registration fails
        ran: list[bool] = []
        resolver._in_loop(lambda: ran.append(True))
        assert ran == [True] and resolver.alive
    finally:
        resolver.close()


def test_one_run_of_several_listings_is_split_into_its_documents_and_garbage_is_a_setup_error():
    printed = '{"nftables": [{"set": {}}]}\n{"nftables": [{"counter": {"packets": 7}}]} {"nftables": []}\n'
    listed = _nft.documents(printed)
    assert len(listed) == 3 and _nft.parse_counter(listed[1]) == 7 and _nft.parse_refused(listed[2]) == []
    assert _nft.documents("  \n") == []
    with pytest.raises(SandboxSetupError):
        _nft.documents('{"nftables": []} not json')


def test_a_reply_too_long_for_udp_goes_as_its_question_with_tc_set_and_whole_over_tcp():
    name = dns.name.from_text(".".join(["a" * 60] * 4)[:240] + ".test")  # 16 addresses: over 512 bytes
    query = dns.message.make_query(name, "A")
    response = _resolver._response(query, dns.rcode.NOERROR)
    response.answer.append(dns.rrset.from_text_list(name, 60, "IN", "A", [f"203.0.113.{i}" for i in range(16)]))
    truncated = dns.message.from_wire(_resolver.udp_wire(response))
    assert truncated.flags & dns.flags.TC and truncated.id == query.id and truncated.answer == []
    assert [rrset.name for rrset in truncated.question] == [name]
    assert len(response.to_wire(max_size=_resolver.MAX_TCP_REPLY_BYTES)) > _resolver.MAX_REPLY_BYTES
    short = _resolver._response(dns.message.make_query("a.test", "A"), dns.rcode.NXDOMAIN)
    assert not dns.message.from_wire(_resolver.udp_wire(short)).flags & dns.flags.TC
