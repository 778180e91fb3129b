"""The committed schema and field reference are what the code generates (python -m readie_pool.reference)."""

from __future__ import annotations

import json

from readie_protocol.requests import JOB_FIELDS
from readie_pool.reference import REFERENCE_PATH, SCHEMA_PATH, field_reference, schema_json


def test_the_committed_schema_is_the_generated_one() -> None:
    assert SCHEMA_PATH.read_text() == schema_json(), "run: python -m readie_pool.reference"
    assert json.loads(SCHEMA_PATH.read_text())["$defs"]["request"]["oneOf"]


def test_the_committed_field_reference_is_the_generated_one() -> None:
    assert REFERENCE_PATH.read_text() == field_reference(), "run: python -m readie_pool.reference"


def test_the_reference_lists_every_field_once_with_the_pools_defaults() -> None:
    page = field_reference()
    rows = [line for line in page.splitlines() if line.startswith("| `")]
    assert [row.split("`")[1] for row in rows] == [field.name for field in JOB_FIELDS]
    assert "30000 ms" in next(row for row in rows if row.startswith("| `timeout`"))


def test_readie_pool_prints_the_schema_and_exits(capsys) -> None:
    from readie_pool.cli import main

    assert main(["pool", "--schema"]) == 0
    assert capsys.readouterr().out == schema_json()
