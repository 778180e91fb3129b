"""Executor settings, built from an environment mapping.

Built twice in capture mode: once at start, and again from the environment the
restored sandbox was given, so that nothing derived from the captured
environment (socket dir, chunk size) outlives the restore.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from .framing import DEFAULT_CHUNK_SIZE, MAX_CHUNK_SIZE
from .sockets import SOCKET_NAME



class SettingsError(Exception):
    """The environment does not describe a usable executor."""


class Mode(enum.Enum):
    CAPTURE = "capture"
    MEASURE = "measure"
    SANDBOX = "sandbox"

    @classmethod
    def parse(cls, value: str | None) -> Mode:
        # The spec: any unknown value falls back to sandbox.
        try:
            return cls((value or "").strip().lower())
        except ValueError:
            return cls.SANDBOX


@dataclass(frozen=True, slots=True)
class Settings:
    executor_dir: Path
    mode: Mode
    chunk_size: int
    preimport: tuple[str, ...]

    @property
    def socket_path(self) -> Path:
        return self.executor_dir / SOCKET_NAME

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> Settings:
        executor_dir = environ.get("EXECUTOR_DIR", "")
        if not executor_dir:
            raise SettingsError("EXECUTOR_DIR is not set: it must name the directory for executor.sock")
        return cls(
            executor_dir=Path(executor_dir),
            mode=Mode.parse(environ.get("EXECUTOR_MODE")),
            chunk_size=_parse_chunk_size(environ.get("EXECUTOR_CHUNK_SIZE")),
            preimport=parse_preimport(environ.get("READIE_PREIMPORT", "")),
        )


def _parse_chunk_size(raw: str | None) -> int:
    if raw is None or raw == "":
        return DEFAULT_CHUNK_SIZE
    try:
        value = int(raw.strip(), 10)
    except ValueError:
        raise SettingsError(f"EXECUTOR_CHUNK_SIZE must be a positive integer, got {raw!r}") from None
    if not 0 < value <= MAX_CHUNK_SIZE:
        raise SettingsError(
            f"EXECUTOR_CHUNK_SIZE must be between 1 and {MAX_CHUNK_SIZE}, got {value}"
        )
    return value


def parse_preimport(raw: str) -> tuple[str, ...]:
    """Comma-separated module names, de-duplicated, in their first order."""
    names = (name.strip() for name in raw.split(","))
    return tuple(dict.fromkeys(name for name in names if name))
