"""The pool's TOML configuration: ``[pool]``, ``[pool.limits]``, ``[profiles.NAME]``.

Parsing is strict, like requests: an unknown key, a wrong type or a bad size
or duration is a :class:`ConfigError` naming the file, the dotted key and the
reason, so a typo never silently widens or drops a limit. Relative paths
resolve against the file's directory and then through ``realpath`` (see
``policy`` for why). A file beneath one of its own write grants is refused:
a job could rewrite the ceiling that confines it.

Absent ``[pool.limits]`` means no ceiling at all; present, it is a full
ceiling (see :class:`~readie_worker.policy.Limits`). Profiles are *not*
checked against the ceiling at load: the spec's own example pairs
``allow_network = false`` with a ``fetch`` profile that asks for the network,
and the spec says the ceiling applies after the profile. A request naming
such a profile fails with a RequestError that says the value came from it.

The ``[permissions]`` table belongs to the one-shot command line and does not
apply to the pool (the spec says so); it is accepted so one file can serve
both, and ignored. Command-line flags override ``[pool]`` through
:func:`apply_cli`.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .errors import ConfigError, UnitError
from .policy import (
    NO_LIMITS,
    NOTHING_GRANTED,
    Limits,
    Profile,
    Resolver,
    resolve_path,
)
from readie_protocol.units import parse_duration_ms, parse_size

__all__ = [
    "CLI_SOURCE",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_IDLE_MS",
    "DEFAULT_WORKERS",
    "LOG_FORMATS",
    "MAX_SESSIONS",
    "MAX_WORKERS",
    "CliOverrides",
    "Config",
    "PoolSettings",
    "apply_cli",
    "load_config",
    "parse_config",
]

#: The spec's starting example (``--workers=2``); each worker is a warm
#: sandbox holding its preloads, so the default stays small.
DEFAULT_WORKERS = 2
#: Each worker is a gVisor sandbox with its own Sentry and memory; past a few
#: hundred one pool process cannot keep them fed, and a typo like 20000 would
#: exhaust the host before the first job.
MAX_WORKERS = 256
#: The spec: "[pool] max_sessions (default 16)".
DEFAULT_MAX_SESSIONS = 16
#: Each session holds a template and a child; the bound keeps a typo from
#: reserving the host. 0 disables sessions.
MAX_SESSIONS = 4096
#: The spec: "session_idle (default 10m)".
DEFAULT_SESSION_IDLE_MS = 10 * 60 * 1000
#: ``json`` writes JSON logs and one line per finished job to stderr;
#: ``console`` readable logs and no job lines (``none`` is its first name, kept).
LOG_FORMATS = frozenset({"console", "json", "none"})
#: An answer carries stdout and stderr, each up to max_output, and a few KiB
#: more: with 1 MiB each it fits the 4 MiB that gRPC client libraries receive
#: by default. A [pool.limits] max_output raises it (and clients must then too).
NETWORK_MAX_OUTPUT = 1024 * 1024
#: What ConfigError names as the "file" for command-line values.
CLI_SOURCE = "command line"
#: Profile names are echoed in the ready event and named in requests.
_MAX_PROFILE_NAME = 64


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """``[pool]`` after defaults; package dirs are absolute and resolved."""

    workers: int = DEFAULT_WORKERS
    preload: tuple[str, ...] = ()
    package_dirs: tuple[Path, ...] = ()
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_ms: int = DEFAULT_SESSION_IDLE_MS
    log: str = "none"


@dataclass(frozen=True, slots=True)
class Config:
    """A loaded configuration; ``path`` is None for a pool started without ``--config``."""

    path: Path | None = None
    pool: PoolSettings = PoolSettings()
    limits: Limits = NO_LIMITS
    profiles: tuple[Profile, ...] = ()

    @property
    def network_limits(self) -> Limits:
        """The ceiling of requests that come over the network (a worker's or router's gRPC).

        The file's ``[pool.limits]``; without one, :data:`NOTHING_GRANTED`. A
        ``max_output`` it leaves unset is :data:`NETWORK_MAX_OUTPUT`, so that a
        client library's default receive limit holds any answer.
        """
        limits = NOTHING_GRANTED if self.limits is NO_LIMITS else self.limits
        return limits if limits.max_output is not None else replace(limits, max_output=NETWORK_MAX_OUTPUT)

    @property
    def profile_map(self) -> Mapping[str, Profile]:
        return {profile.name: profile for profile in self.profiles}

    @property
    def profile_names(self) -> tuple[str, ...]:
        """In file order, as the ready event lists them."""
        return tuple(profile.name for profile in self.profiles)


@dataclass(frozen=True, slots=True)
class CliOverrides:
    """Flags given on the command line; None means "not given, keep the file's"."""

    workers: int | None = None
    preload: tuple[str, ...] | None = None
    package_dirs: tuple[str, ...] | None = None
    log: str | None = None
    max_sessions: int | None = None
    session_idle: str | int | None = None


# --------------------------------------------------------------------------- loading


def load_config(path: str | os.PathLike[str], *, resolve: Resolver = os.path.realpath) -> Config:
    """Read and parse the TOML file at ``path``."""
    shown = os.fspath(path)
    try:
        given = Path(os.path.abspath(shown))
        # Where the name lives (its directory resolved) and the file it names:
        # if either is writable by a job, the job could swap the configuration.
        location = Path(resolve(str(given.parent))) / given.name
        real = Path(resolve(str(given)))
        data = real.read_bytes()
    except (OSError, ValueError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise ConfigError(shown, None, f"cannot read: {reason}") from None
    config = parse_config(data, real, resolve=resolve)
    _check_not_writable(config, location, str(real))
    return config


def parse_config(data: bytes | str, path: Path, *, resolve: Resolver = os.path.realpath) -> Config:
    """Parse TOML text that was read from ``path`` (absolute; relative paths resolve beside it)."""
    if not path.is_absolute():
        raise ValueError(f"config path must be absolute, got {path}")
    shown = str(path)
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        document = tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(shown, None, f"not valid UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(shown, None, f"not valid TOML: {exc}") from None
    reader = _Reader(shown, path.parent, resolve)
    config = reader.document(document)
    _check_not_writable(config, path, shown)
    return replace(config, path=path)


def apply_cli(
    pool: PoolSettings,
    overrides: CliOverrides,
    *,
    cwd: str | Path,
    resolve: Resolver = os.path.realpath,
) -> PoolSettings:
    """``pool`` with every flag that was given replacing the file's value.

    Lists replace rather than extend (``--preload`` names the whole list),
    since the spec has the command line override ``[pool]``; relative
    ``--package-dir`` values resolve against ``cwd``.
    """
    reader = _Reader(CLI_SOURCE, Path(cwd), resolve)
    changes: dict[str, Any] = {}
    flags: dict[str, tuple[str, Any, Callable[[str, Any], Any]]] = {
        "workers": ("--workers", overrides.workers, reader.workers),
        "preload": ("--preload", overrides.preload, reader.modules),
        "package_dirs": ("--package-dir", overrides.package_dirs, reader.paths),
        "log": ("--log", overrides.log, reader.log),
        "max_sessions": ("--max-sessions", overrides.max_sessions, reader.max_sessions),
        "session_idle_ms": ("--session-idle", overrides.session_idle, reader.positive_duration),
    }
    for attr, (flag, value, check) in flags.items():
        if value is not None:
            as_list = list(value) if isinstance(value, tuple) else value
            changes[attr] = check(flag, as_list)
    return replace(pool, **changes)


# --------------------------------------------------------------------------- the reader


class _Reader:
    """Typed accessors that raise ConfigError naming ``source`` and the dotted key."""

    def __init__(self, source: str, base: Path, resolve: Resolver) -> None:
        self.source = source
        self.base = base
        self.resolve = resolve

    def fail(self, key: str | None, reason: str) -> ConfigError:
        return ConfigError(self.source, key, reason)

    # -- structure

    def document(self, doc: dict[str, Any]) -> Config:
        self.known(doc, None, {"pool", "profiles", "permissions"})
        pool_table = self.table(doc, "pool")
        for name in ("profiles", "permissions"):
            self.table(doc, name)
        pool = self.pool(pool_table)
        limits = NO_LIMITS
        if "limits" in pool_table:
            limits = self.limits(self.table(pool_table, "limits", "pool.limits"))
        profiles = []
        for name, body in self.table(doc, "profiles").items():
            key = f"profiles.{name}"
            self.profile_name(key, name)
            if not isinstance(body, dict):
                raise self.fail(key, f"expected a table, got {_toml_type(body)}")
            profiles.append(self.profile(name, body))
        return Config(pool=pool, limits=limits, profiles=tuple(profiles))

    def known(self, table: dict[str, Any], prefix: str | None, allowed: set[str]) -> None:
        for key in table:
            if key not in allowed:
                dotted = f"{prefix}.{key}" if prefix else key
                raise self.fail(
                    dotted, f"unknown key (expected one of {', '.join(sorted(allowed))})"
                )

    def table(self, parent: dict[str, Any], name: str, dotted: str | None = None) -> dict[str, Any]:
        value = parent.get(name, {})
        if not isinstance(value, dict):
            raise self.fail(dotted or name, f"expected a table, got {_toml_type(value)}")
        return value

    def pool(self, table: dict[str, Any]) -> PoolSettings:
        self.known(
            table,
            "pool",
            {
                "workers",
                "preload",
                "package_dirs",
                "max_sessions",
                "session_idle",
                "log",
                "limits",
            },
        )
        readers: dict[str, tuple[str, Callable[[str, Any], Any]]] = {
            "workers": ("workers", self.workers),
            "preload": ("preload", self.modules),
            "package_dirs": ("package_dirs", self.paths),
            "max_sessions": ("max_sessions", self.max_sessions),
            "session_idle": ("session_idle_ms", self.positive_duration),
            "log": ("log", self.log),
        }
        values = {
            attr: read(f"pool.{key}", table[key])
            for key, (attr, read) in readers.items()
            if key in table
        }
        return PoolSettings(**values)

    def limits(self, table: dict[str, Any]) -> Limits:
        self.known(
            table,
            "pool.limits",
            {
                "allow_read",
                "allow_write",
                "allow_network",
                "timeout",
                "memory",
                "max_output",
                "max_file_size",
            },
        )
        get = _Getter(table, "pool.limits")
        return Limits(
            allow_read=get("allow_read", self.paths) or (),
            allow_write=get("allow_write", self.paths) or (),
            allow_network=bool(get("allow_network", self.boolean)),
            timeout_ms=get("timeout", self.positive_duration),
            memory_bytes=get("memory", self.positive_size),
            max_output=get("max_output", self.size),
            max_file_size=get("max_file_size", self.size),
        )

    def profile(self, name: str, table: dict[str, Any]) -> Profile:
        prefix = f"profiles.{name}"
        self.known(
            table,
            prefix,
            {
                "allow_read",
                "allow_write",
                "package_dirs",
                "env",
                "allow_network",
                "timeout",
                "memory",
                "max_output",
                "max_file_size",
            },
        )
        get = _Getter(table, prefix)
        return Profile(
            name=name,
            allow_read=get("allow_read", self.paths),
            allow_write=get("allow_write", self.paths),
            package_dirs=get("package_dirs", self.paths),
            env=get("env", self.env),
            allow_network=get("allow_network", self.boolean),
            timeout_ms=get("timeout", self.positive_duration),
            memory_bytes=get("memory", self.positive_size),
            max_output=get("max_output", self.size),
            max_file_size=get("max_file_size", self.size),
        )

    # -- values

    def workers(self, key: str, value: Any) -> int:
        return self.integer(key, value, 1, MAX_WORKERS)

    def max_sessions(self, key: str, value: Any) -> int:
        return self.integer(key, value, 0, MAX_SESSIONS)

    def integer(self, key: str, value: Any, low: int, high: int) -> int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise self.fail(key, f"expected an integer, got {_toml_type(value)}")
        if not low <= value <= high:
            raise self.fail(key, f"must be from {low} to {high}, got {value}")
        return value

    def boolean(self, key: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise self.fail(key, f"expected true or false, got {_toml_type(value)}")
        return value

    def string(self, key: str, value: Any) -> str:
        if not isinstance(value, str):
            raise self.fail(key, f"expected a string, got {_toml_type(value)}")
        if not value:
            raise self.fail(key, "must not be empty")
        if "\x00" in value:
            raise self.fail(key, "contains a NUL character")
        return value

    def strings(self, key: str, value: Any) -> tuple[str, ...]:
        if not isinstance(value, list):
            raise self.fail(key, f"expected an array of strings, got {_toml_type(value)}")
        return tuple(self.string(f"{key}[{i}]", item) for i, item in enumerate(value))

    def modules(self, key: str, value: Any) -> tuple[str, ...]:
        names = self.strings(key, value)
        for i, name in enumerate(names):
            if not all(part.isascii() and part.isidentifier() for part in name.split(".")):
                raise self.fail(f"{key}[{i}]", f"{name!r} is not a module name")
        return tuple(dict.fromkeys(names))

    def paths(self, key: str, value: Any) -> tuple[Path, ...]:
        resolved = []
        for i, text in enumerate(self.strings(key, value)):
            try:
                resolved.append(resolve_path(text, self.base, self.resolve))
            except (OSError, ValueError) as exc:
                raise self.fail(f"{key}[{i}]", f"cannot resolve {text!r}: {exc}") from None
        return tuple(dict.fromkeys(resolved))

    def env(self, key: str, value: Any) -> tuple[tuple[str, str], ...]:
        if not isinstance(value, dict):
            raise self.fail(key, f"expected a table of strings, got {_toml_type(value)}")
        pairs = []
        for name, item in value.items():
            if not name or "=" in name or "\x00" in name:
                raise self.fail(f"{key}.{name}", "not a variable name (empty, '=' or NUL)")
            if not isinstance(item, str) or "\x00" in item:
                raise self.fail(
                    f"{key}.{name}", f"expected a string without NUL, got {_toml_type(item)}"
                )
            pairs.append((name, item))
        return tuple(pairs)

    def log(self, key: str, value: Any) -> str:
        text = self.string(key, value)
        if text not in LOG_FORMATS:
            raise self.fail(key, f"expected one of {', '.join(sorted(LOG_FORMATS))}, got {text!r}")
        return text

    def size(self, key: str, value: Any) -> int:
        return self.unit(key, value, parse_size, allow_zero=True)

    def positive_size(self, key: str, value: Any) -> int:
        return self.unit(key, value, parse_size, allow_zero=False)

    def positive_duration(self, key: str, value: Any) -> int:
        return self.unit(key, value, parse_duration_ms, allow_zero=False)

    def unit(self, key: str, value: Any, parse: Callable[[Any], int], *, allow_zero: bool) -> int:
        try:
            result = parse(value)
        except UnitError as exc:
            raise self.fail(key, str(exc)) from None
        if result == 0 and not allow_zero:
            raise self.fail(key, "must be greater than zero")
        return result

    def profile_name(self, key: str, name: str) -> None:
        ok = (
            0 < len(name) <= _MAX_PROFILE_NAME
            and name.isascii()
            and name[0].isalnum()
            and all(c.isalnum() or c in "-_" for c in name)
        )
        if not ok:
            raise self.fail(
                key,
                f"profile names are 1-{_MAX_PROFILE_NAME} ASCII letters, digits, '-' or '_', "
                "starting with a letter or digit",
            )


class _Getter:
    """``get(key, read)``: None when the key is absent, else ``read(dotted, value)``."""

    def __init__(self, table: dict[str, Any], prefix: str) -> None:
        self.table = table
        self.prefix = prefix

    def __call__(self, key: str, read: Callable[[str, Any], Any]) -> Any:
        if key not in self.table:
            return None
        return read(f"{self.prefix}.{key}", self.table[key])


def _check_not_writable(config: Config, path: Path, shown: str) -> None:
    grants = [("pool.limits.allow_write", config.limits.allow_write or ())]
    grants += [(f"profiles.{p.name}.allow_write", p.allow_write or ()) for p in config.profiles]
    for key, paths in grants:
        for grant in paths:
            if path.is_relative_to(grant):
                raise ConfigError(
                    shown,
                    key,
                    f"grants writes to {str(grant)!r}, which holds this file; "
                    "a job could rewrite the limits that confine it",
                )


def _toml_type(value: Any) -> str:
    names = {
        bool: "a boolean",
        int: "an integer",
        float: "a float",
        str: "a string",
        list: "an array",
        dict: "a table",
    }
    return names.get(type(value), type(value).__name__)
