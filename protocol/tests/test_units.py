"""Sizes and durations: exact values, and a refusal with a reason for everything else."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from readie_protocol.errors import ReadieError, UnitError
from readie_protocol.units import MAX_VALUE, parse_duration_ms, parse_size

KIB = 1024
MIB = 1024 * KIB
GIB = 1024 * MIB
TIB = 1024 * GIB


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0", 0),
        ("1", 1),
        ("65536", 65536),
        ("64k", 64 * KIB),
        ("64K", 64 * KIB),
        ("512m", 512 * MIB),  # the spec's request example
        ("512M", 512 * MIB),
        ("1g", GIB),  # the spec's [pool.limits] memory
        ("256m", 256 * MIB),  # the spec's max_file_size
        ("2t", 2 * TIB),
        ("007k", 7 * KIB),
        (1048576, 1048576),  # the spec's max_output, a TOML/JSON integer
        (0, 0),
        (str(MAX_VALUE), MAX_VALUE),
        (MAX_VALUE, MAX_VALUE),
        ("8388607t", 8388607 * TIB),  # the largest whole number of TiB
    ],
)
def test_size_values(text: object, expected: int) -> None:
    assert parse_size(text) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty"),
        ("-1", "sign"),
        ("+1", "sign"),
        (-1, "negative"),
        ("1.5g", "whole numbers"),
        (".5g", "whole numbers"),
        ("1e9", "whole numbers"),
        (1.5, "float"),
        (1.0, "float"),
        ("5 m", "spaces"),
        (" 5m", "spaces"),
        ("5m ", "spaces"),
        ("5m\n", "spaces"),
        ("5\tm", "spaces"),
        ("5mb", "unknown unit 'mb'"),
        ("5kib", "unknown unit"),
        ("5b", "unknown unit 'b'"),
        ("5p", "unknown unit 'p'"),
        ("m", "expected digits"),
        ("k5", "expected digits"),
        ("5m5", "expected digits"),
        ("0x10", "expected digits"),
        ("1_000", "expected digits"),
        ("١٢", "expected digits"),  # Arabic-Indic digits: int() would take them
        ("８", "expected digits"),  # fullwidth digit
        ("64\u212a", "expected digits"),  # the Kelvin sign: lower() makes it an ASCII k
        (str(MAX_VALUE + 1), "too large"),
        (MAX_VALUE + 1, "too large"),
        ("8388608t", "too large"),
        ("9" * 30, "too large"),
        ("9" * 100_000, "too large"),
        (True, "boolean"),
        (False, "boolean"),
        (None, "NoneType"),
        ([1], "list"),
    ],
)
def test_size_refusals(value: object, reason: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_size(value)
    assert reason in str(info.value)
    assert isinstance(info.value, ReadieError) and isinstance(info.value, ValueError)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("5s", 5_000),  # the spec's request example
        ("30s", 30_000),  # the spec's [pool.limits] timeout
        ("15m", 15 * 60_000),  # the spec's session_idle
        ("10m", 600_000),
        ("250ms", 250),
        ("250MS", 250),
        ("1h", 3_600_000),
        ("1H", 3_600_000),
        ("0s", 0),
        ("5", 5_000),  # a bare number is seconds
        (5, 5_000),
        (0, 0),
        (str(MAX_VALUE) + "ms", MAX_VALUE),
    ],
)
def test_duration_values(text: object, expected: int) -> None:
    assert parse_duration_ms(text) == expected


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("", "empty"),
        ("1.5s", "whole numbers"),
        ("-5s", "sign"),
        (-5, "negative"),
        (2.5, "float"),
        ("5 s", "spaces"),
        ("5sec", "unknown unit 'sec'"),
        ("5d", "unknown unit 'd'"),
        ("5us", "unknown unit 'us'"),
        ("1h30m", "expected digits"),
        ("s", "expected digits"),
        ("forever", "expected digits"),
        (str(MAX_VALUE) + "s", "too large"),
        (MAX_VALUE, "too large"),  # seconds, times 1000
        (True, "boolean"),
        ({"s": 5}, "dict"),
    ],
)
def test_duration_refusals(value: object, reason: str) -> None:
    with pytest.raises(UnitError) as info:
        parse_duration_ms(value)
    assert reason in str(info.value)


def test_messages_quote_the_value() -> None:
    with pytest.raises(UnitError, match=r"'1\.5g' is not a size: whole numbers only \(write e\.g\. '1536m'\)"):
        parse_size("1.5g")
    with pytest.raises(UnitError, match=r"'5sec' is not a duration: unknown unit 'sec'; use ms, s, m or h"):
        parse_duration_ms("5sec")


@given(st.integers(min_value=0, max_value=MAX_VALUE // TIB), st.sampled_from("kKmMgGtT"))
def test_size_suffixes_are_powers_of_1024(number: int, suffix: str) -> None:
    power = "kmgt".index(suffix.lower()) + 1
    assert parse_size(f"{number}{suffix}") == number * 1024**power


@given(st.text(max_size=30) | st.integers() | st.floats() | st.none() | st.booleans())
def test_only_unit_errors_escape(value: object) -> None:
    for parse in (parse_size, parse_duration_ms):
        try:
            result = parse(value)
        except UnitError:
            continue
        assert isinstance(result, int) and not isinstance(result, bool)
        assert 0 <= result <= MAX_VALUE
