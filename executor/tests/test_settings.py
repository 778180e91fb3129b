"""Settings.from_environ and the capture handover parsers, in process."""

from __future__ import annotations

import dataclasses
import os
import threading
from pathlib import Path

import pytest

from readie_executor._checkpoint import (
    CapturePointError,
    parse_handover,
    parse_spec_environ,
    template_census,
)
from readie_executor._settings import Mode, Settings, SettingsError
from readie_executor.framing import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE

BASE = {"EXECUTOR_DIR": "/run/rx"}


def settings(**overrides: str) -> Settings:
    return Settings.from_environ({**BASE, **overrides})


# --- Settings.from_environ ----------------------------------------------------------------------


@pytest.mark.parametrize("environ", [{}, {"EXECUTOR_DIR": ""}, {"EXECUTOR_MODE": "sandbox"}])
def test_executor_dir_is_required(environ: dict[str, str]) -> None:
    with pytest.raises(SettingsError, match="EXECUTOR_DIR is not set"):
        Settings.from_environ(environ)


def test_defaults() -> None:
    assert Settings.from_environ(BASE) == Settings(
        executor_dir=Path("/run/rx"),
        mode=Mode.SANDBOX,
        chunk_size=DEFAULT_CHUNK_SIZE,
        preimport=(),
    )


def test_socket_path_is_in_the_executor_dir() -> None:
    assert settings().socket_path == Path("/run/rx/executor.sock")


def test_settings_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        settings().chunk_size = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "mode"),
    [
        ("capture", Mode.CAPTURE),
        ("measure", Mode.MEASURE),
        ("sandbox", Mode.SANDBOX),
        (" Capture\n", Mode.CAPTURE),
        ("MEASURE", Mode.MEASURE),
        ("", Mode.SANDBOX),
        ("restore", Mode.SANDBOX),
        ("capture,measure", Mode.SANDBOX),
    ],
)
def test_modes_and_unknown_values_fall_back_to_sandbox(raw: str, mode: Mode) -> None:
    assert settings(EXECUTOR_MODE=raw).mode is mode


@pytest.mark.parametrize(
    ("raw", "size"),
    [
        ("1", 1),
        ("6", 6),
        ("65536", 65536),
        (" 4096 ", 4096),
        (str(MAX_CHUNK_SIZE), MAX_CHUNK_SIZE),
        ("", DEFAULT_CHUNK_SIZE),
    ],
)
def test_chunk_size(raw: str, size: int) -> None:
    assert settings(EXECUTOR_CHUNK_SIZE=raw).chunk_size == size


@pytest.mark.parametrize(
    ("raw", "complaint"),
    [
        ("0", "must be between 1 and 67108864, got 0"),
        ("-1", "must be between 1 and 67108864, got -1"),
        (str(MAX_CHUNK_SIZE + 1), f"must be between 1 and 67108864, got {MAX_CHUNK_SIZE + 1}"),
        ("1.5", "must be a positive integer, got '1.5'"),
        ("1MiB", "must be a positive integer, got '1MiB'"),
        ("0x100", "must be a positive integer, got '0x100'"),
        ("   ", "must be a positive integer, got '   '"),
    ],
)
def test_chunk_size_errors(raw: str, complaint: str) -> None:
    with pytest.raises(SettingsError) as info:
        settings(EXECUTOR_CHUNK_SIZE=raw)
    assert str(info.value) == f"EXECUTOR_CHUNK_SIZE {complaint}"


@pytest.mark.parametrize(
    ("raw", "modules"),
    [
        ("", ()),
        ("numpy", ("numpy",)),
        ("numpy, pandas,numpy,,  scipy ,pandas", ("numpy", "pandas", "scipy")),
        ("b,a,b,c,a", ("b", "a", "c")),
        (" , ,", ()),
    ],
)
def test_preimport_is_deduplicated_in_first_order(raw: str, modules: tuple[str, ...]) -> None:
    assert settings(READIE_PREIMPORT=raw).preimport == modules


def test_unrelated_variables_are_ignored() -> None:
    assert settings(PATH="/usr/bin", EXECUTOR_SOMETHING="x") == settings()


# --- the capture handover -----------------------------------------------------------------------


def test_handover_line() -> None:
    line = b'{"env": {"EXECUTOR_DIR": "/run/new", "EMPTY": "", "UNI": "\\u00e9t\\u00e9"}}\n'
    assert parse_handover(line) == {"EXECUTOR_DIR": "/run/new", "EMPTY": "", "UNI": "été"}


def test_handover_with_an_empty_environment() -> None:
    # Accepted here; the startup sequence then fails on the missing EXECUTOR_DIR.
    assert parse_handover(b'{"env": {}}') == {}


def test_handover_ignores_other_keys() -> None:
    assert parse_handover(b'{"env": {"A": "1"}, "note": [1, 2]}') == {"A": "1"}


@pytest.mark.parametrize(
    "line",
    [b"", b"not json", b"{\"env\": ", b"\xff\xfe{}", b"[]", b'"env"', b"null"],
    ids=["empty", "not-json", "cut-short", "not-utf8", "list", "string", "null"],
)
def test_handover_that_is_not_a_json_object(line: bytes) -> None:
    with pytest.raises(CapturePointError):
        parse_handover(line)


@pytest.mark.parametrize(
    "line",
    [
        b"{}",
        b'{"environ": {"A": "1"}}',
        b'{"env": null}',
        b'{"env": ["A=1"]}',
        b'{"env": {"A": 1}}',
        b'{"env": {"A": null}}',
        b'{"env": {"A": ["1"]}}',
        b'{"env": {"": "1"}}',
        b'{"env": {"A=B": "1"}}',
        b'{"env": {"A": "1\\u0000"}}',
        b'{"env": {"A\\u0000": "1"}}',
    ],
)
def test_handover_env_must_be_names_to_strings(line: bytes) -> None:
    with pytest.raises(CapturePointError, match="handover line must be"):
        parse_handover(line)


def test_spec_environ() -> None:
    raw = b"A=1\0B=2=3\0C=\0\0=nameless\0NOEQUALS\0PATH=/usr/bin:/bin\0"
    assert parse_spec_environ(raw) == {"A": "1", "B": "2=3", "C": "", "PATH": "/usr/bin:/bin"}


def test_spec_environ_keeps_undecodable_bytes() -> None:
    environ = parse_spec_environ(b"RAW=\xff\xfe\0")
    assert os.fsencode(environ["RAW"]) == b"\xff\xfe"


def test_spec_environ_empty() -> None:
    assert parse_spec_environ(b"") == {}
    assert parse_spec_environ(b"\0") == {}


def test_template_census_sees_os_threads_and_descriptors() -> None:
    stop = threading.Event()
    helper = threading.Thread(target=stop.wait, name="census-helper")
    helper.start()
    try:
        census = template_census()
    finally:
        stop.set()
        helper.join()
    tids = {thread["tid"] for thread in census["threads"]}
    assert {threading.get_native_id(), helper.native_id} <= tids
    with open(os.devnull) as devnull:
        fds = {entry["fd"]: entry["target"] for entry in template_census()["fds"]}
        assert fds[devnull.fileno()] == os.devnull
