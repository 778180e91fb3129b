"""The egress policy's pure layer: the destination grammar, the ceiling's containment, the queries
the enforcement asks, and the laws that tie them (decision 35)."""

from __future__ import annotations

import ipaddress

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from readie_policy.egress import (
    MAX_DESTINATIONS,
    Egress,
    default_denied,
    parse_destination,
    parse_destinations,
    resolve_egress,
)
from readie_protocol.errors import RequestError


def ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


def dests(*entries: str):
    return parse_destinations(entries)


def refusal(call, *args) -> str:
    with pytest.raises(RequestError) as info:
        call(*args)
    assert info.value.field == "allow_network"
    return str(info.value)


# --------------------------------------------------------------------------- grammar


@pytest.mark.parametrize(("entry", "canonical"), [
    ("api.example.com", "api.example.com"),
    ("API.Example.COM.", "api.example.com"),
    ("api.example.com:443", "api.example.com:443"),
    ("*.example.com", "*.example.com"),
    ("*.Example.com.:8080", "*.example.com:8080"),
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("203.0.113.7", "203.0.113.7"),
    ("203.0.113.7:80", "203.0.113.7:80"),
    ("203.0.113.0/24", "203.0.113.0/24"),
    ("203.0.113.0/24:443", "203.0.113.0/24:443"),
    ("2001:DB8::1", "2001:db8::1"),
    ("2001:db8::/32", "2001:db8::/32"),
    ("[2001:db8::1]:443", "[2001:db8::1]:443"),
    ("[2001:db8::/32]:443", "[2001:db8::/32]:443"),
    ("::ffff:10.0.0.0/104", "10.0.0.0/8"),  # IPv4-mapped: the IPv4 network it carries
    ("::ffff:169.254.169.254", "169.254.169.254"),
])
def test_the_grammar_accepts_and_canonicalises(entry: str, canonical: str) -> None:
    destination = parse_destination(entry)
    assert (str(destination), destination.written) == (canonical, entry)
    assert str(parse_destination(str(destination))) == canonical


@pytest.mark.parametrize(("entry", "message"), [
    ("", "allow_network: '' is not a destination: expected a name, *.suffix, an IP address or a CIDR, "
         "each optionally with :port"),
    ("10.0.0.1/8", "allow_network: '10.0.0.1/8' is not a destination: not an IP address or CIDR "
                   "(10.0.0.1/8 has host bits set)"),
    ("010.0.0.1", "allow_network: '010.0.0.1' is not a destination: not an IP address or CIDR "
                  "('010.0.0.1' does not appear to be an IPv4 or IPv6 network)"),
    ("1.2.3", "allow_network: '1.2.3' is not a destination: not an IP address or CIDR "
              "('1.2.3' does not appear to be an IPv4 or IPv6 network)"),
    ("api.example.com:0", "allow_network: 'api.example.com:0' is not a destination: the port must be a number "
                          "from 1 to 65535"),
    ("api.example.com:65536", "allow_network: 'api.example.com:65536' is not a destination: the port must be a "
                              "number from 1 to 65535"),
    ("api.example.com:0443", "allow_network: 'api.example.com:0443' is not a destination: the port must be a "
                             "number from 1 to 65535"),
    ("*.", "allow_network: '*.' is not a destination: a name is 1 to 253 characters"),
    ("*", "allow_network: '*' is not a destination: '*' may only be the whole first label: *.example.com"),
    ("*x.example.com", "allow_network: '*x.example.com' is not a destination: '*' may only be the whole first "
                       "label: *.example.com"),
    ("a.*.example.com", "allow_network: 'a.*.example.com' is not a destination: '*' may only be the whole "
                        "first label: *.example.com"),
    ("a..example.com", "allow_network: 'a..example.com' is not a destination: '' is not a DNS label (ASCII "
                       "letters, digits and inner hyphens, at most 63)"),
    ("a_b.example.com", "allow_network: 'a_b.example.com' is not a destination: 'a_b' is not a DNS label "
                        "(ASCII letters, digits and inner hyphens, at most 63)"),
    ("-a.example.com", "allow_network: '-a.example.com' is not a destination: '-a' is not a DNS label (ASCII "
                       "letters, digits and inner hyphens, at most 63)"),
    ("bücher.example", "allow_network: 'bücher.example' is not a destination: 'bücher.example' is not ASCII; "
                       "write an internationalised name in its xn-- form"),
    ("api.\u212aey.com", "allow_network: 'api.\u212aey.com' is not a destination: 'api.\u212aey.com' is not ASCII; "
                          "write an internationalised name in its xn-- form"),  # a Kelvin sign lowers to k
    (" api.example.com", "allow_network: ' api.example.com' is not a destination: ' api' is not a DNS label "
                         "(ASCII letters, digits and inner hyphens, at most 63)"),
    ("[::1]", "allow_network: '[::1]' is not a destination: brackets are for an IPv6 address with a port: "
              "write it without them"),
    ("[10.0.0.1]:80", "allow_network: '[10.0.0.1]:80' is not a destination: brackets hold an IPv6 address or "
                      "network"),
    ("[::1]x", "allow_network: '[::1]x' is not a destination: expected a name, *.suffix, an IP address or a "
               "CIDR, each optionally with :port"),
    ("fe80::1%eth0", "allow_network: 'fe80::1%eth0' is not a destination: an IPv6 zone (%...) names an "
                     "interface of the host, not a destination"),
    ("http://api.example.com", "allow_network: 'http://api.example.com' is not a destination: the port must "
                               "be a number from 1 to 65535"),
])
def test_the_grammar_refuses_with_the_entry_quoted(entry: str, message: str) -> None:
    assert refusal(parse_destination, entry) == message


def test_names_and_lists_are_bounded() -> None:
    longest = ".".join(["a" * 63] * 3 + ["b" * 61])  # 253 characters
    assert parse_destination(longest + ".:65535").port == 65535
    assert "a name is 1 to 253" in refusal(parse_destination, longest + "b")
    assert "is not a DNS label" in refusal(parse_destination, "a" * 64 + ".example.com")
    assert "is longer than 260 characters" in refusal(parse_destination, "a" * 261)
    assert refusal(parse_destination, 443) == "allow_network: destinations are strings, got int"
    many = [f"h{i}.example.com" for i in range(MAX_DESTINATIONS + 1)]
    assert refusal(parse_destinations, many) == "allow_network: 65 destinations; at most 64 are allowed"
    assert len(dests("a.example.com", "A.example.com.", "b.example.com")) == 2  # repeats dropped


# --------------------------------------------------------------------------- default-denied


@pytest.mark.parametrize("address", [
    "10.1.2.3", "172.16.0.1", "192.168.1.1", "100.64.0.1", "127.0.0.1", "169.254.169.254", "0.0.0.0",
    "224.0.0.1", "255.255.255.255", "::1", "::", "fe80::1", "fd00::1", "ff02::1", "::ffff:127.0.0.1",
    "::ffff:169.254.169.254", "64:ff9b::a00:1", "2002:a00:1::1", "168.63.129.16",
])
def test_the_default_denied_ranges(address: str) -> None:
    assert default_denied(ip(address)) is not None
    assert not Egress(public=True).allows(ip(address), 80)


@pytest.mark.parametrize("address", ["203.0.113.7", "8.8.8.8", "2001:db8::1", "2606:4700::1111", "::ffff:8.8.8.8"])
def test_public_addresses_are_not_default_denied(address: str) -> None:
    assert default_denied(ip(address)) is None
    assert Egress(public=True).allows(ip(address), 443)


def test_the_metadata_endpoint_says_why() -> None:
    assert "169.254.169.254" in str(default_denied(ip("169.254.169.254")))


# --------------------------------------------------------------------------- containment

CEILING = dests("api.example.com:443", "*.example.org", "10.1.0.0/16", "169.254.169.254:80",
                "[2001:db8::/32]:443", "198.51.100.0/24", "0.0.0.0/0:8443")


@pytest.mark.parametrize("entry", [
    "api.example.com:443", "x.example.org", "x.example.org:22", "*.a.example.org", "*.example.org",
    "10.1.2.0/24", "10.1.2.3", "169.254.169.254:80", "[2001:db8::1]:443", "198.51.100.7:443", "8.8.8.8:8443",
])
def test_a_list_within_the_ceiling_is_kept(entry: str) -> None:
    egress = resolve_egress(dests(entry), CEILING)
    assert egress is not None and not egress.public and [str(d) for d in egress.destinations] == [str(parse_destination(entry))]


@pytest.mark.parametrize(("entry", "why"), [
    ("api.example.com", "not within"),       # no port asks for every port; the ceiling has 443 only
    ("api.example.com:80", "not within"),
    ("example.org", "not within"),           # *.example.org is strictly below
    ("other.example.com:443", "not within"),
    ("10.0.0.0/8", "not within"),
    ("169.254.169.254", "not within"),       # every port; the ceiling opens port 80 only
    ("2001:db8::1", "not within"),
    ("10.2.0.1:8443", "denied by default"),  # 0.0.0.0/0:8443 covers it but names no private range
])
def test_a_list_beyond_the_ceiling_is_refused(entry: str, why: str) -> None:
    assert why in refusal(resolve_egress, dests(entry), CEILING)


def test_refusals_quote_the_entry_as_written_and_say_where_it_came_from() -> None:
    assert refusal(resolve_egress, dests("API.Example.com:80"), CEILING, " (from profile 'fetch')") == (
        "allow_network: 'API.Example.com:80' is not within the pool's [pool.limits] allow_network "
        "(from profile 'fetch')")
    assert refusal(resolve_egress, dests("127.0.0.1"), True) == (
        "allow_network: '127.0.0.1' is denied by default (loopback: services of the host the sandbox runs on) "
        "unless the pool's [pool.limits] allow_network names it")
    for ceiling in (False, ()):
        assert refusal(resolve_egress, True, ceiling) == "allow_network: the pool's [pool.limits] do not allow the network"


def test_true_asks_for_what_the_ceiling_allows() -> None:
    assert resolve_egress(True, True) == Egress(public=True)
    assert resolve_egress(True, None) == Egress(public=True)
    listed = resolve_egress(True, CEILING)
    assert listed is not None and listed.destinations == CEILING and not listed.public
    assert [str(d) for d in listed.opened] == ["10.1.0.0/16", "169.254.169.254:80"]
    for asked in (None, False, ()):
        assert resolve_egress(asked, CEILING) is None


def test_a_true_ceiling_covers_what_is_not_default_denied() -> None:
    egress = resolve_egress(dests("api.example.com", "0.0.0.0/0", "203.0.113.0/24:443"), True)
    assert egress is not None and len(egress.destinations) == 3 and egress.opened == ()
    assert not egress.allows(ip("10.0.0.1"), 80)  # 0.0.0.0/0 opens nothing denied
    assert "denied by default" in refusal(resolve_egress, dests("169.254.169.254"), True)


def test_no_ceiling_takes_a_list_as_written_and_its_addresses_open_what_they_name() -> None:
    egress = resolve_egress(dests("10.0.0.0/8", "api.example.com"), None)
    assert egress is not None and egress.allows(ip("10.9.9.9"), 5432)
    assert not egress.allows(ip("127.0.0.1"), 80)


# --------------------------------------------------------------------------- queries


def test_names_resolve_only_when_allowed_and_their_answers_keep_the_ports() -> None:
    egress = resolve_egress(True, CEILING)
    assert egress is not None
    assert egress.allows_name("API.example.com.") and egress.name_ports("api.example.com") == frozenset({443})
    assert egress.allows_name("a.b.example.org") and egress.name_ports("a.example.org") is None
    assert not egress.allows_name("example.org") and not egress.allows_name("evil.com")
    answer = ip("93.184.216.34")
    assert egress.allows(answer, 443, name="api.example.com")
    assert not egress.allows(answer, 80, name="api.example.com")
    assert not egress.allows(answer, 443)  # the address itself is not listed
    assert not egress.allows(answer, 443, name="evil.com")


def test_a_name_re_pointed_to_a_denied_address_stays_denied() -> None:
    egress = resolve_egress(True, CEILING)
    assert egress is not None
    assert not egress.allows(ip("169.254.169.254"), 443, name="api.example.com")
    assert not egress.allows(ip("127.0.0.1"), 443, name="api.example.com")
    assert not egress.allows(ip("::ffff:127.0.0.1"), 443, name="api.example.com")
    assert egress.allows(ip("169.254.169.254"), 80)  # named by the ceiling, on its port
    assert not egress.allows(ip("169.254.169.254"), 81)
    assert egress.allows(ip("10.1.200.1"), 5432) and not egress.allows(ip("10.2.0.1"), 5432)


def test_the_workers_own_addresses_open_only_to_a_single_address_entry() -> None:
    own = [ip("203.0.113.5"), ip("10.1.0.9")]
    broad = resolve_egress(True, dests("203.0.113.0/24", "10.1.0.0/16"))
    assert broad is not None
    assert broad.allows(ip("203.0.113.5"), 80) and not broad.for_worker(own).allows(ip("203.0.113.5"), 80)
    assert not broad.for_worker(own).allows(ip("10.1.0.9"), 80)
    assert broad.for_worker(own).allows(ip("10.1.0.10"), 80)
    assert not Egress(public=True).for_worker(own).allows(ip("::ffff:203.0.113.5"), 443)
    single = resolve_egress(True, dests("203.0.113.5:9000"))
    assert single is not None and single.for_worker(own).allows(ip("203.0.113.5"), 9000)


# --------------------------------------------------------------------------- laws

_NAMES = st.sampled_from(["example.com", "api.example.com", "a.api.example.com", "example.org", "x.example.org"])
_NETS = st.sampled_from(["0.0.0.0/0", "10.0.0.0/8", "10.1.0.0/16", "10.1.2.3", "169.254.169.254",
                         "203.0.113.0/24", "203.0.113.128/25", "127.0.0.0/8", "2001:db8::/32", "::/0", "fe80::/10"])
_PORTS = st.sampled_from(["", ":80", ":443"])
_ENTRY = st.one_of(
    st.builds(lambda w, n, p: ("*." if w else "") + n + p, st.booleans(), _NAMES, _PORTS),
    st.builds(lambda n, p: f"[{n}]{p}" if ":" in n and p else n + p, _NETS, _PORTS),
)
_ADDRESSES = st.sampled_from(["10.1.2.3", "10.9.0.1", "169.254.169.254", "203.0.113.7", "203.0.113.200",
                              "127.0.0.1", "8.8.8.8", "2001:db8::5", "fe80::1", "::ffff:10.1.2.3"])
_PROBES = st.tuples(_ADDRESSES, st.sampled_from([80, 443, 22]), st.sampled_from([None, "api.example.com",
                    "a.api.example.com", "example.org", "x.example.org", "evil.net"]))


@settings(max_examples=300, deadline=None)
@given(st.lists(_ENTRY, max_size=5), st.lists(_ENTRY, min_size=1, max_size=4), st.lists(_PROBES, max_size=8),
       st.sampled_from([(), ("10.1.2.3",), ("203.0.113.7",)]))
def test_a_covered_list_allows_nothing_its_ceiling_does_not(ceiling_entries, asked, probes, own) -> None:
    ceilings = [True, dests(*ceiling_entries)] if ceiling_entries else [True]
    for ceiling in ceilings:
        try:
            egress = resolve_egress(dests(*asked), ceiling)
        except RequestError:
            continue
        whole = resolve_egress(True, ceiling)
        assert egress is not None and whole is not None
        mine, theirs = egress.for_worker(map(ip, own)), whole.for_worker(map(ip, own))
        for address, port, name in probes:
            if mine.allows(ip(address), port, name=name):
                assert theirs.allows(ip(address), port, name=name), (asked, ceiling, address, port, name)
                if ceiling is True:  # `true` never opens a denied address, the worker's own included
                    plain = getattr(ip(address), "ipv4_mapped", None) or ip(address)
                    assert default_denied(plain) is None and plain not in mine.own
            if name is not None and mine.allows_name(name):
                assert theirs.allows_name(name)


@settings(max_examples=200, deadline=None)
@given(_ENTRY, _ENTRY)
def test_covering_is_the_containment_of_what_each_entry_allows(outer, inner) -> None:
    big, small = parse_destination(outer), parse_destination(inner)
    if big.covers(small):
        for address, port, name in [(a, p, n) for a in ["10.1.2.3", "203.0.113.7", "2001:db8::5", "8.8.8.8"]
                                    for p in (80, 443) for n in (None, "api.example.com", "x.example.org")]:
            mine, theirs = Egress((small,), opened=(small,)), Egress((big,), opened=(big,))
            if mine.allows(ip(address), port, name=name):
                assert theirs.allows(ip(address), port, name=name)
    assert big.covers(big)


@settings(max_examples=300, deadline=None)
@given(st.one_of(st.text(max_size=40), st.from_regex(r"\A[\[\]0-9a-fA-F:./*%x-]{1,30}\Z"), _ENTRY))
def test_any_text_is_a_destination_or_a_request_error_and_canonical_forms_are_fixed_points(text) -> None:
    try:
        destination = parse_destination(text)
    except RequestError as exc:
        assert exc.field == "allow_network"
        return
    again = parse_destination(str(destination))
    assert again == destination and str(again) == str(destination)
