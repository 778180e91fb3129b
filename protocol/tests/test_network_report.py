"""Decision 35's result: a result line's ``network`` (what the egress policy refused), written
and read back, and every line no worker writes refused as the pool breaking the protocol. No
pool: the pure protocol layer."""

from __future__ import annotations

import json
from typing import Any

import pytest
from conftest import fuzz_examples
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_protocol import NetworkReport as ExportedReport
from readie_protocol.errors import PoolError
from readie_protocol.events import (
    MAX_REFUSED_NAMES, MAX_REFUSED_REPORTED, NetworkReport, RefusedConnection, Result, parse_result,
)
from readie_protocol.network import MAX_ADDRESS_CHARS, MAX_DNS_NAME_CHARS, MAX_REFUSED_COUNT
from readie_protocol.schema import event_schemas

REPORT = NetworkReport(
    refused_connections=5,
    refused=(RefusedConnection("169.254.169.254", 80, 3), RefusedConnection("2001:db8::1", 443, 1)),
    refused_lookups=2,
    refused_names=("tracker.example.net", "_dmarc.a\\032b.example"),
    allowed_connections=7,
)
# The line the pool writes for REPORT, spelt out: what a client in another language parses.
REPORT_JSON = {
    "refused_connections": 5,
    "refused": [{"address": "169.254.169.254", "port": 80, "count": 3}, {"address": "2001:db8::1", "port": 443, "count": 1}],
    "refused_lookups": 2,
    "refused_names": ["tracker.example.net", "_dmarc.a\\032b.example"],
    "allowed_connections": 7,
}


def _line(**network: Any) -> dict[str, Any]:
    return {"id": 1, "exit": 0, "stdout": "", "stderr": "", "error": None, "stdout_truncated": False,
            "stderr_truncated": False, "duration_ms": 0, "duration_us": 0, "queue_us": 0, "runtime": None,
            "policy": None, "network": {**REPORT_JSON, **network}}


def test_a_result_with_the_network_carries_its_report_and_reads_it_back() -> None:
    result = Result(id=1, exit=0, network=REPORT)
    line = json.loads(json.dumps(result.to_json()))
    assert line["network"] == REPORT_JSON
    assert parse_result(line) == result
    assert parse_result(_line()).network == REPORT
    assert ExportedReport is NetworkReport


def test_nothing_refused_is_a_report_of_zeros_and_no_network_is_no_key() -> None:
    quiet = Result(id=1, exit=0, network=NetworkReport())
    assert quiet.to_json()["network"] == {"refused_connections": 0, "refused": [], "refused_lookups": 0, "refused_names": [], "allowed_connections": 0}
    assert parse_result(quiet.to_json()) == quiet
    offline = Result(id=2, exit=0).to_json()
    assert "network" not in offline and parse_result(offline).network is None
    assert parse_result({**offline, "network": None}).network is None


def test_an_address_is_kept_as_python_writes_it() -> None:
    parsed = parse_result(_line(refused=[{"address": "2001:DB8:0:0::1", "port": 443, "count": 1}]))
    assert parsed.network is not None and parsed.network.refused[0].address == "2001:db8::1"


def _entries(count: int) -> list[dict[str, Any]]:
    return [{"address": f"203.0.113.{i}", "port": 443, "count": 1} for i in range(count)]


@pytest.mark.parametrize(("network", "message"), [
    ({"refused": _entries(MAX_REFUSED_REPORTED + 1), "refused_connections": 100}, "at most 32"),
    ({"refused_names": [f"n{i}.example" for i in range(MAX_REFUSED_NAMES + 1)], "refused_lookups": 100}, "at most 32"),
    ({"refused": [{"address": "203.0.113.1", "port": 0, "count": 1}]}, "port of 0"),
    ({"refused": [{"address": "203.0.113.1", "port": 65536, "count": 1}]}, "port of 65536"),
    ({"refused": [{"address": "203.0.113.1", "port": True, "count": 1}]}, "port has the wrong type"),
    ({"refused": [{"address": "203.0.113.1", "port": 80, "count": 0}]}, "count of 0"),
    ({"refused": [{"address": "metadata.google.internal", "port": 80, "count": 1}]}, "not an IP address"),
    ({"refused": [{"address": "fe80::1%eth0", "port": 80, "count": 1}]}, "not an IP address"),
    ({"refused": [{"address": "1" * (MAX_ADDRESS_CHARS + 1), "port": 80, "count": 1}]}, "not an IP address"),
    ({"refused": [{"address": "203.0.113.1", "port": "80", "count": 1}]}, "wrong type"),
    ({"refused": [{"address": "203.0.113.1", "count": 1}]}, "lacks 'port'"),
    ({"refused": ["203.0.113.1:80"]}, "not a JSON object"),
    ({"refused": _entries(2) + _entries(1)}, "twice"),
    ({"refused": [{"address": "203.0.113.1", "port": 80, "count": 1},
                  {"address": "203.0.113.2", "port": 80, "count": 2}], "refused_connections": 3}, "out of order"),
    ({"refused_connections": 3}, "more refused connections than its total of 3"),
    ({"refused_connections": -1}, "refused_connections of -1"),
    ({"refused_connections": MAX_REFUSED_COUNT + 1}, "refused_connections of 4294967296"),
    ({"refused_lookups": 1}, "names 2 refused lookups but counts 1"),
    ({"refused_names": ["a" * (MAX_DNS_NAME_CHARS + 1)]}, "no DNS name"),
    ({"refused_names": [""]}, "no DNS name"),
    ({"refused_names": ["evil name.example"]}, "no DNS name"),
    ({"refused_names": ["\u00e9t\u00e9.example"]}, "no DNS name"),
    ({"refused_names": [7]}, "no DNS name"),
    ({"refused_names": ["a.example", "a.example"]}, "twice"),
    ({"refused": {"203.0.113.1": 1}}, "wrong type"),
])
def test_a_report_no_worker_writes_breaks_the_protocol(network: dict[str, Any], message: str) -> None:
    with pytest.raises(PoolError, match=message):
        parse_result(_line(**network))


def test_a_name_of_the_longest_dns_length_is_read() -> None:
    name = ".".join(["a" * 63] * 3 + ["a" * 61])
    assert len(name) == MAX_DNS_NAME_CHARS
    assert parse_result(_line(refused_names=[name], refused_lookups=1)).network.refused_names == (name,)


def test_the_schema_publishes_the_report_and_its_bounds() -> None:
    network = event_schemas()["result"]["properties"]["network"]["anyOf"][0]
    assert network["properties"]["refused"]["maxItems"] == MAX_REFUSED_REPORTED
    assert network["properties"]["refused_names"]["maxItems"] == MAX_REFUSED_NAMES
    assert network["properties"]["refused_names"]["items"]["maxLength"] == MAX_DNS_NAME_CHARS
    entry = network["properties"]["refused"]["items"]["properties"]
    assert (entry["port"]["minimum"], entry["port"]["maximum"]) == (1, 65535)
    assert "network" not in event_schemas()["result"]["required"]


# JSON values near the report's shape: right keys, any values (names and addresses included).
_json = st.recursive(
    st.none() | st.booleans() | st.integers(-2, 2**33) | st.sampled_from(["203.0.113.1", "::1", "a.example", "", "x y"]),
    lambda inner: st.lists(inner, max_size=40) | st.dictionaries(st.sampled_from(["address", "port", "count"]), inner),
    max_leaves=60,
)


@settings(max_examples=fuzz_examples(300))
@given(st.fixed_dictionaries({}, optional={key: _json for key in REPORT_JSON}))
def test_garbage_for_a_network_report_is_a_report_within_bounds_or_a_pool_error(network: dict[str, Any]) -> None:
    try:
        report = parse_result({**_line(), "network": network}).network
    except PoolError:
        return
    assert report is not None
    assert len(report.refused) <= MAX_REFUSED_REPORTED and len(report.refused_names) <= MAX_REFUSED_NAMES
    assert sum(entry.count for entry in report.refused) <= report.refused_connections
    assert all(1 <= entry.port <= 65535 for entry in report.refused)
