"""``readie worker --egress-netns NAME --egress-dns IP[,IP...]`` (decision 36): the flags reach the
worker's config, a bad one stops the start naming the flag, and the check they (and ``[pool]
egress_netns`` / ``egress_dns``) go through agrees with ``EgressConfig``, which checks them again as
the worker opens the namespace: one rule, so a value the file accepts never fails at start.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import structlog
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_policy.config_values import EGRESS_DNS, NETNS_NAME, Reading
from readie_protocol.errors import ConfigError
from readie_worker import cli
from readie_policy.config import Config, load_config
from readie_worker.core import WorkerConfig
from readie_worker.egress_net import EgressConfig

AT = Reading("test", Path("/"), os.path.realpath)


@pytest.fixture(autouse=True)
def _structlog_defaults():
    yield  # main() points structlog at this test's captured stderr
    structlog.reset_defaults()


def started_with(monkeypatch, tmp_path: Path, *flags: str) -> WorkerConfig:
    """The WorkerConfig ``readie worker`` would start with; nothing is entered, started or served."""
    seen: list[WorkerConfig] = []
    monkeypatch.setattr(cli, "enter_mount_namespace", lambda: None)
    monkeypatch.setattr(cli, "_serve", lambda config, args, stop: seen.append(config) or 0)
    assert cli.main(["worker", "--checkpoints", str(tmp_path), *flags]) == 0
    (config,) = seen
    return config


def test_the_flags_reach_the_worker_config(monkeypatch, tmp_path):
    config = started_with(monkeypatch, tmp_path, "--egress-netns", "readie-egress", "--egress-dns", "192.0.2.53, 198.51.100.1")
    assert (config.egress_netns, config.egress_dns) == ("readie-egress", ("192.0.2.53", "198.51.100.1"))
    unset = started_with(monkeypatch, tmp_path)
    assert (unset.egress_netns, unset.egress_dns) == (None, None)  # the network refused; the host's resolv.conf
    assert not unset.egress_own_netns and not config.egress_own_netns
    own = started_with(monkeypatch, tmp_path, "--egress-netns", "readie-egress", "--egress-own-netns")
    assert (own.egress_netns, own.egress_own_netns) == ("readie-egress", True)


@pytest.mark.parametrize(
    ("flags", "said"),
    [
        (["--egress-netns", "../x"], "argument --egress-netns: '../x' is not a network namespace's name"),
        (["--egress-netns", "my egress"], "argument --egress-netns: 'my egress' is not a network namespace's name"),
        (["--egress-dns", "192.0.2.53,2001:db8::53"], "argument --egress-dns: '2001:db8::53' is not an IPv4 address"),
        (["--egress-dns", "192.0.2.1,192.0.2.2,192.0.2.3,192.0.2.4"], "argument --egress-dns: 4 resolvers, at most 3"),
        (["--egress-own-netns"], "--egress-own-netns names the namespace --egress-netns gives"),
    ],
)
def test_a_bad_flag_stops_the_start_naming_it(monkeypatch, tmp_path, capsys, flags, said):
    monkeypatch.setattr(cli, "_serve", lambda *args: pytest.fail("served with a bad flag"))
    with pytest.raises(SystemExit) as exited:
        cli.main(["worker", "--checkpoints", str(tmp_path), *flags])
    assert exited.value.code == 2 and said in capsys.readouterr().err


def loader_accepts(kind, value) -> bool:
    try:
        kind.read(AT, "key", value)
    except ConfigError:
        return False
    return True


def egress_config_accepts(**fields) -> bool:
    try:
        EgressConfig(**fields)
    except ConfigError:
        return False
    return True


NAMES = ["readie-egress", "a", "A.b_c-9", "..x", "n" * 64, "n" * 65, ".", "..", "../x", "a/b", "a b", "ns\u00e9", "ns\n"]
ADDRESSES = ["192.0.2.53", "0.0.0.0", "255.255.255.255", "01.2.3.4", "1.2.3", "256.0.0.1", " 1.2.3.4", "::1",
             "1.2.3.4/32", "1.2.3.4%eth0", "dns.example"]


@pytest.mark.parametrize("name", NAMES)
def test_a_namespace_name_is_accepted_by_the_loader_exactly_when_egress_config_accepts_it(name):
    assert loader_accepts(NETNS_NAME, name) == egress_config_accepts(netns=name, upstreams=())


@pytest.mark.parametrize("address", ADDRESSES)
def test_an_upstream_is_accepted_by_the_loader_exactly_when_egress_config_accepts_it(address):
    assert loader_accepts(EGRESS_DNS, [address]) == egress_config_accepts(netns="readie-egress", upstreams=(address,))


@settings(max_examples=300, deadline=None)
@given(name=st.text(alphabet="aZ09._-/ \n\x00\u00e9", max_size=70))
def test_any_name_gets_the_same_answer_from_both(name):
    assert loader_accepts(NETNS_NAME, name) == egress_config_accepts(netns=name, upstreams=())


def test_egress_starts_only_where_the_ceiling_can_grant_the_network(tmp_path):
    """A worker's ceiling without allow_network (or no ceiling: nothing granted) leaves egress
    unstarted: no forwarding, resolver or warm networked sandbox that no job could use."""
    config = WorkerConfig(manifest=tmp_path / "manifest.json", egress_netns="readie-egress", egress_own_netns=True)
    granting = tmp_path / "granting.toml"
    granting.write_text('[pool.limits]\nallow_network = ["api.example.com:443"]\n')
    denying = tmp_path / "denying.toml"
    denying.write_text("[pool.limits]\nallow_network = false\n")
    assert cli.egress_if_granted(config, load_config(granting)) is config
    for ceiling in (Config(), load_config(denying)):
        kept = cli.egress_if_granted(config, ceiling)
        assert (kept.egress_netns, kept.egress_own_netns) == (None, False)
