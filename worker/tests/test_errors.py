"""The error hierarchy and its single table to and from the error types results name."""

from __future__ import annotations

import ast
import builtins
from pathlib import Path

import pytest
import readie_executor
from readie_worker.errors import (
    ConfigError,
    PoolWorkerError,
    ReadieError,
    RequestError,
    SandboxSetupError,
    UnitError,
    ErrorType,
    error_type,
    family_of,
)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (RequestError("unknown field", "cwd"), "RequestError"),
        (UnitError("bad size"), "RequestError"),
        (SandboxSetupError("restore failed"), "SandboxSetupError"),
        (PoolWorkerError("worker died"), "PoolWorkerError"),
        (ConfigError("/etc/readie.toml", "pool.workers", "bad"), "PoolWorkerError"),
        (ReadieError("other"), "PoolWorkerError"),
        (RuntimeError("a bug"), "PoolWorkerError"),
    ],
)
def test_error_type(exc: BaseException, expected: str) -> None:
    assert error_type(exc) == expected


@pytest.mark.parametrize("family", [RequestError, SandboxSetupError, PoolWorkerError])
def test_each_family_is_raised_again_from_the_type_it_is_reported_as(family: type[ReadieError]) -> None:
    assert family_of(error_type(family("x"))) is family


@pytest.mark.parametrize("kind", [ErrorType.TIMEOUT, ErrorType.SIGNAL, "ValueError", "MemoryError"])
def test_the_jobs_own_errors_have_no_family(kind: str) -> None:
    assert family_of(kind) is None


def test_the_executor_reports_only_readies_own_error_types() -> None:
    """The executor writes the types with the standard library: each literal it names must be an ErrorType."""
    named = set()
    for source in Path(readie_executor.__file__).parent.rglob("*.py"):
        for call in ast.walk(ast.parse(source.read_text())):
            if (
                isinstance(call, ast.Call)
                and getattr(call.func, "id", None) == "ErrorReport"
                and call.args
                and isinstance(call.args[0], ast.Constant)
            ):
                named.add(call.args[0].value)
    # A Python exception it names (PermissionError with its hint) is the job's, not readie's.
    own = {name for name in named if name in set(ErrorType) or not hasattr(builtins, name)}
    assert {"RequestError", "SandboxSetupError", "TimeoutError"} <= own <= set(ErrorType), named


def test_families_share_one_base() -> None:
    for cls in (RequestError, UnitError, ConfigError, SandboxSetupError, PoolWorkerError):
        assert issubclass(cls, ReadieError)
    assert issubclass(UnitError, ValueError)


def test_request_error_names_its_field() -> None:
    error = RequestError("must be true", "stats")
    assert (str(error), error.field, error.reason) == ("stats: must be true", "stats", "must be true")
    bare = RequestError("line is not valid JSON")
    assert (str(bare), bare.field) == ("line is not valid JSON", None)


def test_config_error_names_file_key_and_reason() -> None:
    error = ConfigError("/etc/readie.toml", "pool.limits.memory", "negative")
    assert str(error) == "/etc/readie.toml: pool.limits.memory: negative"
    assert (error.path, error.key, error.reason) == ("/etc/readie.toml", "pool.limits.memory", "negative")
    assert str(ConfigError("/x.toml", None, "not valid TOML")) == "/x.toml: not valid TOML"
