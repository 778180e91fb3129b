"""The committed config schema and docs/config.md are what the code generates (python -m readie_pool.reference)."""

from __future__ import annotations

import json

from readie_pool.reference import (
    CONFIG_REFERENCE_PATH,
    CONFIG_SCHEMA_PATH,
    config_reference,
    config_schema_json,
    schema_json,
)
from readie_policy.config_keys import LIMITS, POOL, PROFILE


def test_the_committed_config_schema_is_the_generated_one() -> None:
    assert CONFIG_SCHEMA_PATH.read_text() == config_schema_json(), "run: python -m readie_pool.reference"
    assert json.loads(CONFIG_SCHEMA_PATH.read_text())["$schema"].endswith("/2020-12/schema")


def test_the_committed_config_reference_is_the_generated_one() -> None:
    assert CONFIG_REFERENCE_PATH.read_text() == config_reference(), "run: python -m readie_pool.reference"


def test_the_reference_lists_every_key_once_per_section() -> None:
    page = config_reference()
    for section in (POOL, LIMITS, PROFILE):
        part = page.split(f"## `[{section.name}]`\n", 1)[1].split("\n## ", 1)[0]
        rows = [line for line in part.splitlines() if line.startswith("| `")]
        assert [row.split("`")[1] for row in rows] == [key.name for key in section.keys]
    assert "| `workers` | integer, 1 to 256 | 2 | `--workers` |" in page


def test_readie_pool_prints_the_config_schema_and_exits(capsys) -> None:
    from readie_pool.cli import main

    assert main(["pool", "--config-schema"]) == 0
    assert capsys.readouterr().out == config_schema_json()
    assert main(["pool", "--schema"]) == 0  # the protocol's, unchanged
    assert capsys.readouterr().out == schema_json()
