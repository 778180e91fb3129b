"""``[pool] egress_netns`` and ``egress_dns`` (decision 36): read from the file and from flags, refused
naming the key before anything starts, and the published schema saying the same as the loader.

That these rules are ``readie_worker.egress_net.EgressConfig``'s, which checks the values again as the
worker opens the namespace, is held in worker/tests/test_egress_flags.py (this package does not see
the worker's).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jsonschema
import pytest
from readie_policy.cli_flags import comma_separated, egress_dns, egress_netns
from readie_policy.config import CLI_SOURCE, CliOverrides, PoolSettings, apply_cli, parse_config
from readie_policy.config_keys import MAX_EGRESS_DNS, config_schema
from readie_protocol.errors import ConfigError

CONFIG_PATH = Path("/etc/readie/readie.toml")
POOL_SCHEMA = config_schema()["properties"]["pool"]["properties"]


def pool_of(text: str) -> PoolSettings:
    return parse_config(f"[pool]\n{text}\n", CONFIG_PATH).pool


def refusal(text: str) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        pool_of(text)
    assert info.value.path == str(CONFIG_PATH)
    return info.value


def test_the_keys_are_read_from_the_file_and_unset_by_default() -> None:
    pool = pool_of('egress_netns = "readie-egress"\negress_dns = ["192.0.2.53", "198.51.100.7"]')
    assert (pool.egress_netns, pool.egress_dns) == ("readie-egress", ("192.0.2.53", "198.51.100.7"))
    # Unset: no namespace (networked jobs refused), and None for the host's /etc/resolv.conf.
    assert (pool_of("").egress_netns, pool_of("").egress_dns) == (None, None)
    assert pool_of('egress_dns = ["192.0.2.53", "192.0.2.53"]').egress_dns == ("192.0.2.53",)


@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ('egress_netns = "../x"', "pool.egress_netns", "'../x' is not a network namespace's name"),
        ('egress_netns = "/run/netns/x"', "pool.egress_netns", "is not a network namespace's name"),
        ('egress_netns = "my egress"', "pool.egress_netns", "'my egress' is not a network namespace's name"),
        ('egress_netns = ".."', "pool.egress_netns", "'..' is not a network namespace's name"),
        ('egress_netns = "."', "pool.egress_netns", "'.' is not a network namespace's name"),
        (f'egress_netns = "{"n" * 65}"', "pool.egress_netns", "1 to 64 ASCII letters"),
        ('egress_netns = "ns\\u00e9"', "pool.egress_netns", "is not a network namespace's name"),
        ('egress_netns = ""', "pool.egress_netns", "must not be empty"),
        ("egress_netns = 7", "pool.egress_netns", "expected a string, got an integer"),
        ('egress_dns = ["2001:db8::53"]', "pool.egress_dns[0]", "'2001:db8::53' is not an IPv4 address"),
        ('egress_dns = ["192.0.2.53", "dns.example"]', "pool.egress_dns[1]", "'dns.example' is not an IPv4 address"),
        ('egress_dns = ["192.0.2.053"]', "pool.egress_dns[0]", "is not an IPv4 address"),
        ('egress_dns = ["192.0.2.53:53"]', "pool.egress_dns[0]", "is not an IPv4 address"),
        ('egress_dns = ["192.0.2.256"]', "pool.egress_dns[0]", "is not an IPv4 address"),
        ('egress_dns = ["192.0.2.0/24"]', "pool.egress_dns[0]", "is not an IPv4 address"),
        ("egress_dns = [53]", "pool.egress_dns[0]", "expected a string, got an integer"),
        ('egress_dns = "192.0.2.53"', "pool.egress_dns", "expected an array of strings, got a string"),
        ("egress_dns = []", "pool.egress_dns", "names no resolver"),
        ("egress_dns = " + str([f"192.0.2.{i}" for i in range(MAX_EGRESS_DNS + 1)]), "pool.egress_dns",
         f"{MAX_EGRESS_DNS + 1} resolvers, at most {MAX_EGRESS_DNS}"),
    ],
)
def test_a_bad_value_is_refused_naming_the_key(text: str, key: str, reason: str) -> None:
    error = refusal(text)
    assert error.key == key and reason in error.reason


def test_flags_replace_the_files_values_and_are_checked_as_the_file_is() -> None:
    pool = pool_of('egress_netns = "from-file"\negress_dns = ["192.0.2.53"]')
    merged = apply_cli(pool, CliOverrides(egress_netns="from-flag", egress_dns=("198.51.100.1", "198.51.100.2")), cwd="/")
    assert (merged.egress_netns, merged.egress_dns) == ("from-flag", ("198.51.100.1", "198.51.100.2"))
    kept = apply_cli(pool, CliOverrides(), cwd="/")
    assert (kept.egress_netns, kept.egress_dns) == ("from-file", ("192.0.2.53",))
    for overrides, key, reason in [
        (CliOverrides(egress_netns="../x"), "--egress-netns", "is not a network namespace's name"),
        (CliOverrides(egress_dns=("192.0.2.53", "x")), "--egress-dns[1]", "'x' is not an IPv4 address"),
        (CliOverrides(egress_dns=()), "--egress-dns", "names no resolver"),
    ]:
        with pytest.raises(ConfigError) as info:
            apply_cli(pool, overrides, cwd="/")
        assert (info.value.path, info.value.key) == (CLI_SOURCE, key) and reason in info.value.reason


def test_the_flag_types_of_readie_worker_read_as_the_keys_do() -> None:
    assert comma_separated(" 192.0.2.53, ,198.51.100.1 ") == ("192.0.2.53", "198.51.100.1")
    assert egress_dns("192.0.2.53,198.51.100.1") == ("192.0.2.53", "198.51.100.1")
    assert egress_netns("readie-egress") == "readie-egress"
    for read, text, reason in [
        (egress_netns, "../x", "'../x' is not a network namespace's name"),
        (egress_netns, "a b", "'a b' is not a network namespace's name"),
        (egress_dns, "192.0.2.53,fe80::1", "'fe80::1' is not an IPv4 address"),
        (egress_dns, ",".join(["192.0.2.1"] * (MAX_EGRESS_DNS + 1)), f"at most {MAX_EGRESS_DNS}"),
        (egress_dns, "", "names no resolver"),
    ]:
        with pytest.raises(argparse.ArgumentTypeError, match=reason):
            read(text)


# Values near the rules' edges: the schema an editor checks with must agree with the loader on each.
NETNS_SAMPLES = ["readie-egress", "a", "A.b_c-9", "..x", "...", "n" * 64, "n" * 65, ".", "..", "../x", "a/b",
                 "a b", "ns\u00e9", "ns\x00", ""]
DNS_SAMPLES = [["192.0.2.53"], ["0.0.0.0"], ["255.255.255.255"], ["1.2.3.4"] * MAX_EGRESS_DNS,
               ["1.2.3.4"] * (MAX_EGRESS_DNS + 1), [], ["01.2.3.4"], ["1.2.3"], ["256.0.0.1"], ["1.2.3.4 "],
               ["::1"], ["1.2.3.4/32"], [""], "1.2.3.4"]


@pytest.mark.parametrize(("key", "value"), [("egress_netns", v) for v in NETNS_SAMPLES]
                         + [("egress_dns", v) for v in DNS_SAMPLES])
def test_the_schema_accepts_exactly_what_the_loader_accepts(key: str, value: object) -> None:
    try:
        apply_cli(PoolSettings(), CliOverrides(**{key: tuple(value) if isinstance(value, list) else value}), cwd="/")
        loads = True
    except ConfigError:
        loads = False
    assert jsonschema.Draft202012Validator(POOL_SCHEMA[key]).is_valid(value) == loads
