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


def test_the_json_examples_are_lines_the_pool_accepts_or_writes() -> None:
    """docs/requests.md's examples: each request line parses, each answer is described by its event's schema."""
    import re

    import jsonschema
    from readie_protocol.requests import Refused, parse_request
    from readie_protocol.schema import SCHEMA_DIALECT, event_schemas

    schemas = event_schemas()
    blocks = re.findall(r"^```json\n(.*?)^```", field_reference(), re.MULTILINE | re.DOTALL)
    lines = [line for block in blocks for line in block.splitlines()]
    assert len(lines) >= 9
    for line in lines:
        obj = json.loads(line)
        if "event" in obj or "exit" in obj or "attached" in obj:
            schema = schemas["attached" if "attached" in obj else obj.get("event", "result")]
            if "exit" in obj:  # shown in part: the fields the section is about
                schema = {**schema, "required": [name for name in schema["required"] if name in obj]}
            assert jsonschema.Draft202012Validator({"$schema": SCHEMA_DIALECT, **schema}).is_valid(obj), line
        else:
            assert not isinstance(parse_request(line), Refused), line
