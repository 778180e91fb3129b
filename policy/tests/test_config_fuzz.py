"""Fuzzing the config loader: any file gives a Config or a ConfigError, nothing else.

test_config_schema already holds each key's reader to the schema one value at
a time; this feeds the whole loader (UTF-8, TOML, tables, the checks across
keys, profiles) with arbitrary bytes and with documents made of the real
keys, several at once, in every section, and with values nested thousands
deep (tomllib recurses into arrays and inline tables). The allowed failure is
:class:`ConfigError`; any other exception is a bug in the loader, and so is a
ConfigError that the loader's last resort made of one (it keeps the
exception as its ``__cause__``), which would otherwise hide such bugs here.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from readie_policy.config import parse_config
from readie_policy.config_keys import LIMITS, POOL, PROFILE
from readie_worker.errors import ConfigError

from conftest import fuzz_examples

FUZZ = settings(max_examples=fuzz_examples(300), deadline=None, suppress_health_check=[HealthCheck.too_slow])
CONFIG_PATH = Path("/nonexistent/readie-fuzz/readie.toml")  # where relative paths resolve; never read

LEAVES = st.one_of(
    st.booleans(),
    st.integers(-(2**64), 2**64),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=12),
    st.sampled_from(["30s", "1m", "512m", "2g", "/tmp", "/srv/data", "../x", "deny", "allow", "json", "-1s", "0", ""]),
)
VALUES = st.one_of(LEAVES, st.lists(LEAVES, max_size=3))


def table(section) -> st.SearchStrategy[dict[str, Any]]:
    """Some of ``section``'s keys, each with its example or any value, and now and then a stray key."""
    keys = {key.name: st.just(key.example) | VALUES for key in section.keys}
    return st.fixed_dictionaries({}, optional={**keys, "bogus": VALUES})


documents = st.fixed_dictionaries(
    {},
    optional={
        "pool": st.tuples(table(POOL), table(LIMITS) | st.just(None)),
        "profiles": st.dictionaries(st.sampled_from(["p", "fast", "", "a.b", "x" * 80]), table(PROFILE), max_size=3),
        "other": st.just({"x": 1}),
    },
)


def toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, float):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf") if math.isinf(value) else repr(value)
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(item) for item in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a TOML basic string (\uXXXX escapes included)
    return str(value)


def toml_text(document: dict[str, Any]) -> str:
    lines: list[str] = []

    def emit(header: str, values: dict[str, Any]) -> None:
        lines.append(f"[{header}]")
        lines.extend(f"{json.dumps(key)} = {toml_value(value)}" for key, value in values.items())

    if "pool" in document:
        pool, limits = document["pool"]
        emit("pool", pool)
        if limits is not None:
            emit("pool.limits", limits)
    for name, values in document.get("profiles", {}).items():
        emit(f"profiles.{json.dumps(name)}", values)
    if "other" in document:
        emit("other", document["other"])
    return "\n".join(lines) + "\n"


# Openers of arrays and inline tables, and what closes each.
OPENERS = {"[": "]", "{k = ": "}", "[0, ": "]", '{"q" = [': "]}", "[{a = 1}, ": "]"}


@st.composite
def nested_documents(draw: st.DrawFn) -> str:
    """A value nested 1 to 3000 deep, under a real key or a stray one, closed or cut short."""
    openers = draw(st.lists(st.sampled_from(sorted(OPENERS)), min_size=1, max_size=4))
    levels = [openers[i % len(openers)] for i in range(draw(st.integers(1, 3000)))]
    closed = "".join(OPENERS[opener] for opener in reversed(levels))
    tail = closed if draw(st.booleans()) else draw(st.sampled_from(["", "]", "}", closed[:-1], "x"]))
    key = draw(st.sampled_from(["a = ", "[pool]\npreload = ", "[pool.limits]\ntimeout = ", "[profiles.p]\nenv = "]))
    return key + "".join(levels) + "1" + tail + "\n"


def loads_or_refuses(data: bytes | str) -> None:
    try:
        parse_config(data, CONFIG_PATH)
    except ConfigError as exc:
        assert exc.__cause__ is None, f"an exception no check foresaw: {exc}"


@FUZZ
@given(st.binary(max_size=400))
def test_any_bytes_give_a_config_or_a_config_error(data: bytes) -> None:
    loads_or_refuses(data)


@FUZZ
@given(documents)
def test_any_document_of_real_keys_gives_a_config_or_a_config_error(document: dict[str, Any]) -> None:
    text = toml_text(document)
    try:
        import tomllib

        tomllib.loads(text)
    except tomllib.TOMLDecodeError:  # a value this renderer cannot spell (a huge integer): not the loader's case
        return
    loads_or_refuses(text)


@FUZZ
@given(nested_documents())
def test_any_nesting_gives_a_config_or_a_config_error(text: str) -> None:
    loads_or_refuses(text)


def test_the_renderer_writes_what_the_loader_reads() -> None:
    """The strategy reaches the loader's checks: a valid document loads, and a stray key is named."""
    config = parse_config(toml_text({"pool": ({"workers": 3}, {"timeout": "5s"})}), CONFIG_PATH)
    assert config.pool.workers == 3
    try:
        parse_config(toml_text({"pool": ({"bogus": 1}, None)}), CONFIG_PATH)
    except ConfigError as exc:
        assert "bogus" in str(exc)
    else:
        raise AssertionError("a stray key loaded")
