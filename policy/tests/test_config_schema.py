"""The config file's JSON Schema says what the loader does: one key table (readie_policy.config_keys) feeds both.

Checked three ways: every example config in the repository (docs, example
files, tests) is valid for the schema and loads; the bad configs the loader
refuses, the schema refuses too; and for random values of every key the
loader and the schema agree.
"""

from __future__ import annotations

import ast
import os
import re
import tomllib
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from readie_protocol.requests import JOB_FIELDS
from readie_pool.reference import config_example
from readie_policy.config import CliOverrides, load_config, parse_config
from readie_policy.config_keys import DOCUMENT, LIMITS, POOL, PROFILE, Reading, Section, config_schema
from readie_worker.errors import ConfigError

from conftest import REPO
from policy.tests.test_config import BAD_CONFIGS

SCHEMA = config_schema()
VALIDATOR = jsonschema.Draft202012Validator(SCHEMA)
# Where examples load from in memory: no grant of theirs holds it, nothing is read from it.
NOWHERE = Path("/nonexistent-readie-examples/readie.toml")
SKIPPED_DIRS = {".venv", ".git", "build", "node_modules"}
# A line opening one of the pool's tables: what makes a string an example config.
POOL_TABLE = re.compile(r"^\[(pool|profiles)[.\]]", re.MULTILINE)
TOML_BLOCK = re.compile(r"^```toml\n(.*?)^```", re.MULTILINE | re.DOTALL)


def ours(pattern: str) -> list[Path]:
    return sorted(p for p in REPO.rglob(pattern) if not SKIPPED_DIRS & set(p.relative_to(REPO).parts))


def doc_examples() -> dict[str, str]:
    """Every ```toml block of the docs and READMEs, by file and position."""
    return {
        f"{path.relative_to(REPO)}#{i}": block
        for path in ours("*.md")
        for i, block in enumerate(TOML_BLOCK.findall(path.read_text()))
    }


def file_and_test_examples() -> dict[str, str]:
    """Example configs kept as files, and as module-level strings in code and tests (``CONFIG = \"\"\"...``).

    Strings inside test functions and parameter lists are left out: those are
    the deliberately bad ones. A string with ``{{`` is a ``str.format`` template,
    and is taken as its code formats it.
    """
    found = {}
    for path in ours("*.toml"):
        text = path.read_text()
        if POOL_TABLE.search(text):
            found[str(path.relative_to(REPO))] = text
    for path in ours("*.py"):
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
                text = node.value.value
                if POOL_TABLE.search(text):
                    name = ",".join(target.id for target in node.targets if isinstance(target, ast.Name))
                    found[f"{path.relative_to(REPO)}:{name}"] = text.format() if "{{" in text else text
    return found


EXAMPLES = {**doc_examples(), **file_and_test_examples()}


def test_the_examples_are_found() -> None:
    names = set(EXAMPLES)
    assert "examples/demo/readie.toml" in names
    assert "policy/tests/test_config.py:SPEC_CONFIG" in names
    assert "rpc/src/readie_rpc/testing.py:TEST_CEILING" in names
    assert {"docs/config.md#0", "docs/pool.md#0"} <= names


@pytest.mark.parametrize("name", sorted(EXAMPLES))
def test_every_example_config_is_valid_and_loads(name: str) -> None:
    text = EXAMPLES[name]
    VALIDATOR.validate(tomllib.loads(text))
    parse_config(text, NOWHERE, resolve=os.path.normpath)


@pytest.mark.parametrize("name", sorted(doc_examples()))
def test_the_docs_examples_load_from_a_file(name: str, tmp_path: Path) -> None:
    path = tmp_path / "readie.toml"
    path.write_text(doc_examples()[name])
    assert load_config(path).path == path.resolve()


def test_the_generated_example_sets_every_key() -> None:
    document = tomllib.loads(config_example())
    assert set(document["pool"]) == {key.name for key in POOL.keys} | {"limits"}
    assert set(document["pool"]["limits"]) == {key.name for key in LIMITS.keys}
    (profile,) = document["profiles"].values()
    assert set(profile) == {key.name for key in PROFILE.keys}


# --------------------------------------------------------------------------- refusals


def test_a_typo_and_a_bad_size_are_refused_by_both() -> None:
    for text, key in [
        ("[pool]\nworker = 4\n", "pool.worker"),
        ("[pool.limits]\nmemroy = '1g'\n", "pool.limits.memroy"),
        ("[profiles.a]\nallow_reads = ['data']\n", "profiles.a.allow_reads"),
        ("[pool.limits]\nmemory = '1.5g'\n", "pool.limits.memory"),
        ("[pool.limits]\nmax_output = '64 k'\n", "pool.limits.max_output"),
        ("[profiles.a]\nmax_file_size = '1mb'\n", "profiles.a.max_file_size"),
    ]:
        assert not VALIDATOR.is_valid(tomllib.loads(text)), text
        with pytest.raises(ConfigError) as info:
            parse_config(text, NOWHERE)
        assert info.value.key == key


def whole_floats(value: Any) -> bool:
    """A float like 4.0 anywhere: JSON Schema counts it an integer, the loader does not (noted in the schema)."""
    if isinstance(value, dict):
        return any(whole_floats(item) for item in value.values())
    if isinstance(value, list):
        return any(whole_floats(item) for item in value)
    return isinstance(value, float) and value.is_integer()


def test_the_schema_refuses_what_the_loader_refuses() -> None:
    documents = []
    for text, _key, reason in BAD_CONFIGS:
        try:
            document = tomllib.loads(text.decode() if isinstance(text, bytes) else text)
        except (tomllib.TOMLDecodeError, UnicodeDecodeError, RecursionError):
            continue  # not TOML tomllib can read: nothing for a schema to see
        if "too large" in reason and isinstance(text, str) and '"' in text:
            continue  # a string past a bound once converted: no pattern says so (its integer form is checked)
        documents.append(document)
    accepted = [document for document in documents if VALIDATOR.is_valid(document)]
    assert len(documents) > 30 and all(whole_floats(document) for document in accepted), accepted


# --------------------------------------------------------------------------- one table


def section_schema(section: Section) -> dict[str, Any]:
    pool = SCHEMA["properties"]["pool"]
    return {
        DOCUMENT.name: SCHEMA,
        POOL.name: pool,
        LIMITS.name: pool["properties"]["limits"],
        PROFILE.name: SCHEMA["properties"]["profiles"]["additionalProperties"],
    }[section.name]


@pytest.mark.parametrize("section", [DOCUMENT, POOL, LIMITS, PROFILE], ids=lambda s: s.name or "document")
def test_the_schema_has_every_key_the_loader_reads_and_no_other(section: Section) -> None:
    schema = section_schema(section)
    assert set(schema["properties"]) == {key.name for key in section.keys} | set(section.tables)
    assert schema["additionalProperties"] is False


def documents(section: Section, table: dict[str, Any]) -> dict[str, Any]:
    """``table`` placed where ``section`` lives in a file."""
    return {
        POOL.name: {"pool": table},
        LIMITS.name: {"pool": {"limits": table}},
        PROFILE.name: {"profiles": {"p": table}},
    }[section.name]


KEYS = [(section, key) for section in (POOL, LIMITS, PROFILE) for key in section.keys]


@pytest.mark.parametrize(("section", "key"), KEYS, ids=[f"{s.name}.{k.name}" for s, k in KEYS])
def test_each_key_with_its_example_is_accepted_by_both(section: Section, key: Any) -> None:
    table = {key.name: key.example}
    assert VALIDATOR.is_valid(documents(section, table))
    assert set(section.read(Reading("test", Path("/srv"), os.path.normpath), section.name, table)) == {key.attr}


@pytest.mark.parametrize("section", [POOL, LIMITS, PROFILE], ids=lambda s: s.name)
def test_an_unknown_key_is_refused_by_both(section: Section) -> None:
    assert not VALIDATOR.is_valid(documents(section, {"bogus": 1}))
    with pytest.raises(ConfigError, match="unknown key"):
        section.read(Reading("test", Path("/srv"), os.path.normpath), section.name, {"bogus": 1})


def test_profile_keys_are_request_fields() -> None:
    fields = {field.name: field.attr for field in JOB_FIELDS}
    assert {key.name: key.attr for key in PROFILE.keys}.items() <= fields.items()


def test_every_pool_key_has_a_flag_and_an_override() -> None:
    assert all(key.flag for key in POOL.keys)
    assert set(CliOverrides.__dataclass_fields__) == {key.name for key in POOL.keys}


# Values of every shape TOML can hold, and strings that look like sizes, durations and names.
UNITS = "([kmgtKMGT]|ms|MS|mS|[smhSMH]|mb|)"
LEAVES = st.one_of(
    st.booleans(),
    st.integers(min_value=-3, max_value=5000),
    st.integers(min_value=-3, max_value=2**64),
    st.floats(allow_nan=False, allow_infinity=False),
    st.text(max_size=8),
    st.from_regex(rf"\A[0-9]{{1,3}}{UNITS}\Z"),
    st.from_regex(rf"\A[0-9]{{16,22}}{UNITS}\Z"),
    st.from_regex(r"\A[A-Za-z_.0-9][A-Za-z0-9_.=-]{0,4}\Z"),
    st.sampled_from(["console", "json", "none", "", "a=b", "\x00", "0s", "000"]),
)
VALUES = st.one_of(
    st.sampled_from([key.example for _, key in KEYS]),
    LEAVES,
    st.lists(LEAVES, max_size=3),
    st.dictionaries(st.text(max_size=4) | st.from_regex(r"\A[A-Z_=]{0,3}\Z"), LEAVES, max_size=3),
)


def ends_with_newline(value: Any) -> bool:
    """Python's ``$`` also matches before a final newline, ECMA-262's (JSON Schema's) does not."""
    if isinstance(value, dict):
        return any(ends_with_newline(item) for item in [*value, *value.values()])
    if isinstance(value, list):
        return any(ends_with_newline(item) for item in value)
    return isinstance(value, str) and value.endswith("\n")


@settings(max_examples=300, deadline=None)
@given(index=st.integers(min_value=0, max_value=len(KEYS) - 1), value=VALUES)
def test_the_loader_and_the_schema_agree_on_any_value(index: int, value: Any) -> None:
    section, key = KEYS[index]
    if whole_floats(value) or ends_with_newline(value):
        return
    try:
        key.read(Reading("test", Path("/srv"), os.path.normpath), key.name, value)
        loads = True
    except ConfigError as exc:
        if "too large" in exc.reason:  # a size past 2**63 once converted: no regex says so
            return
        if "is not a destination" in exc.reason:  # the destination grammar (strict CIDRs, DNS labels):
            return                                # the schema says its shape, the loader the rest
        loads = False
    assert VALIDATOR.is_valid(documents(section, {key.name: value})) == loads
