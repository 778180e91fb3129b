"""The error hierarchy and its single mapping to pool error types."""

from __future__ import annotations

import pytest
from readie_router._errors import (
    ConfigError,
    PoolWorkerError,
    ReadieError,
    RequestError,
    SandboxSetupError,
    UnitError,
    pool_error_type,
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
def test_pool_error_type(exc: BaseException, expected: str) -> None:
    assert pool_error_type(exc) == expected


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
