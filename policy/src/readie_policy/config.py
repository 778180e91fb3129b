"""The pool's TOML configuration: ``[pool]``, ``[pool.limits]``, ``[profiles.NAME]``.

Parsing is strict, like requests: an unknown key, a wrong type or a bad size
or duration is a :class:`ConfigError` naming the file, the dotted key and the
reason, so a typo never silently widens or drops a limit. Relative paths
resolve against the file's directory and then through ``realpath`` (see
``policy`` for why). A file beneath one of its own write grants is refused:
a job could rewrite the ceiling that confines it.

Absent ``[pool.limits]`` means no ceiling at all; present, it is a full
ceiling (see :class:`~readie_policy.policy.Limits`). Profiles are *not*
checked against the ceiling at load: the spec's own example pairs
``allow_network = false`` with a ``fetch`` profile that asks for the network,
and the spec says the ceiling applies after the profile. A request naming
such a profile fails with a RequestError that says the value came from it.

The ``[permissions]`` table belongs to the one-shot command line and does not
apply to the pool (the spec says so); it is accepted so one file can serve
both, and ignored. Command-line flags override ``[pool]`` through
:func:`apply_cli`.

Nothing else escapes the loader: a file nested deeper than ``tomllib`` can
follow (its RecursionError), one that is not a regular file or is larger
than :data:`MAX_CONFIG_BYTES`, and any exception a check did not foresee all
end as a ConfigError, which every command reports in one line and exits 2
with. A ceiling or a profile value no job could be served with is lowered or
refused here, at load (``config_keys``), never found out by a job.

Every key, with its check, default and meaning, is in one table,
``config_keys``, which the published JSON Schema and docs/config.md are
generated from too; this module reads the file's structure through it.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from .config_keys import (
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_MS,
    DEFAULT_SESSION_PAUSE_MS,
    DEFAULT_WORKERS,
    DOCUMENT,
    LIMITS,
    LOG_FORMATS,
    MAX_SESSIONS,
    MAX_WORKERS,
    NETWORK_MAX_OUTPUT,
    NETWORK_MAX_TIMEOUT_MS,
    POOL,
    PROFILE,
    Reading,
    check_profile_name,
    toml_type,
)
from readie_protocol.errors import ConfigError

from .operator_files import read_regular
from .policy import NO_LIMITS, NOTHING_GRANTED, Limits, Profile, Resolver

__all__ = [
    "CLI_SOURCE",
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_IDLE_MS",
    "DEFAULT_SESSION_PAUSE_MS",
    "DEFAULT_WORKERS",
    "LOG_FORMATS",
    "MAX_CONFIG_BYTES",
    "MAX_SESSIONS",
    "MAX_WORKERS",
    "NETWORK_MAX_OUTPUT",
    "NETWORK_MAX_TIMEOUT_MS",
    "CliOverrides",
    "Config",
    "PoolSettings",
    "apply_cli",
    "load_config",
    "parse_config",
    "read_toml",
    "toml_document",
]

#: What ConfigError names as the "file" for command-line values.
CLI_SOURCE = "command line"
#: A file of every key with long path lists is a few KiB; past a MiB it is not
#: a config, and tomllib holds the whole text and its tree in memory.
MAX_CONFIG_BYTES = 1024 * 1024


@dataclass(frozen=True, slots=True)
class PoolSettings:
    """``[pool]`` after defaults; package dirs are absolute and resolved."""

    workers: int = DEFAULT_WORKERS
    preload: tuple[str, ...] = ()
    package_dirs: tuple[Path, ...] = ()
    max_sessions: int = DEFAULT_MAX_SESSIONS
    session_idle_ms: int = DEFAULT_SESSION_IDLE_MS
    session_hibernate_ms: int | None = None  # off
    session_pause_ms: int = DEFAULT_SESSION_PAUSE_MS  # 0: never
    # Decision 32: where sessions outlive the pool, the key that signs them, and when they are written.
    session_store: Path | None = None
    session_store_key: Path | None = None
    session_checkpoint: str = "off"
    # Decision 36: the namespace networked sandboxes are wired into (None: the network is refused),
    # and the upstream resolvers (None: the host's /etc/resolv.conf).
    egress_netns: str | None = None
    egress_dns: tuple[str, ...] | None = None
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
        client library's default receive limit holds any answer, and a
        ``timeout`` :data:`NETWORK_MAX_TIMEOUT_MS`.
        """
        limits = NOTHING_GRANTED if self.limits is NO_LIMITS else self.limits
        return replace(
            limits,
            max_output=NETWORK_MAX_OUTPUT if limits.max_output is None else limits.max_output,
            timeout_ms=NETWORK_MAX_TIMEOUT_MS if limits.timeout_ms is None else limits.timeout_ms,
        )

    @property
    def profile_map(self) -> Mapping[str, Profile]:
        return {profile.name: profile for profile in self.profiles}

    @property
    def profile_names(self) -> tuple[str, ...]:
        """In file order, as the ready event lists them."""
        return tuple(profile.name for profile in self.profiles)


@dataclass(frozen=True, slots=True)
class CliOverrides:
    """Flags given on the command line; None means "not given, keep the file's".

    Each field is named as the ``[pool]`` key it overrides (``config_keys.POOL``).
    """

    workers: int | None = None
    preload: tuple[str, ...] | None = None
    package_dirs: tuple[str, ...] | None = None
    log: str | None = None
    max_sessions: int | None = None
    session_idle: str | int | None = None
    session_hibernate: str | int | None = None
    session_pause: str | int | None = None
    session_store: str | None = None
    session_store_key: str | None = None
    session_checkpoint: str | None = None
    egress_netns: str | None = None
    egress_dns: tuple[str, ...] | None = None


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
    except (OSError, ValueError) as exc:
        raise _unreadable(shown, exc) from None
    config = parse_config(_read(real, shown), real, resolve=resolve)
    _check_not_writable(config, location, str(real))
    return config


def parse_config(data: bytes | str, path: Path, *, resolve: Resolver = os.path.realpath) -> Config:
    """Parse TOML text that was read from ``path`` (absolute; relative paths resolve beside it).

    Raises only ConfigError: an exception no check foresaw becomes one too,
    naming its type (and kept as its ``__cause__``), so that a bad file never
    ends in a traceback.
    """
    if not path.is_absolute():
        raise ValueError(f"config path must be absolute, got {path}")
    shown = str(path)
    try:
        config = _document(Reading(shown, path.parent, resolve), toml_document(data, shown))
        _check_not_writable(config, path, shown)
    except ConfigError:
        raise
    except Exception as exc:  # a bug of the loader's: still the operator's file to fix or report
        raise ConfigError(shown, None, f"cannot be loaded ({type(exc).__name__}: {exc})") from exc
    return replace(config, path=path)


def read_toml(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The document of any TOML file the operator names (as the config is read); ConfigError otherwise."""
    shown = os.fspath(path)
    return toml_document(_read(shown, shown), shown)


def toml_document(data: bytes | str, shown: str) -> dict[str, Any]:
    """``data`` as TOML; a ConfigError naming ``shown`` for whatever ``tomllib`` cannot read."""
    try:
        text = data.decode("utf-8") if isinstance(data, bytes) else data
        return tomllib.loads(text)
    except UnicodeDecodeError as exc:
        raise ConfigError(shown, None, f"not valid UTF-8 (byte {exc.start})") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(shown, None, f"not valid TOML: {exc}") from None
    except RecursionError:
        # tomllib parses arrays and inline tables recursively, a few hundred levels deep at most.
        raise ConfigError(shown, None, "nested too deeply: arrays or inline tables within each other, "
                          "deeper than a TOML reader follows") from None


def _read(path: str | os.PathLike[str], shown: str) -> bytes:
    try:
        return read_regular(path, MAX_CONFIG_BYTES)
    except OSError as exc:
        raise _unreadable(shown, exc) from None


def _unreadable(shown: str, exc: OSError | ValueError) -> ConfigError:
    reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
    return ConfigError(shown, None, f"cannot read: {reason}")


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
    at = Reading(CLI_SOURCE, Path(cwd), resolve)
    changes: dict[str, Any] = {}
    for key in POOL.keys:
        value = getattr(overrides, key.name, None)
        if key.flag is not None and value is not None:
            changes[key.attr] = key.read(at, key.flag, list(value) if isinstance(value, tuple) else value)
    return _check_store(at, _check_timers(at, replace(pool, **changes)))


def _check_store(at: Reading, pool: PoolSettings) -> PoolSettings:
    """A shared store needs its key: a key made at start would sign images no later pool could read."""
    if pool.session_store is not None and pool.session_store_key is None:
        raise at.fail("pool.session_store_key", "required with session_store: the file of the key that signs "
                      "its images, shared by every pool and worker using the store")
    return pool


def _check_timers(at: Reading, pool: PoolSettings) -> PoolSettings:
    """A session hibernates before it would be closed for idleness, or never."""
    if pool.session_hibernate_ms is not None and pool.session_hibernate_ms >= pool.session_idle_ms:
        raise at.fail(
            "pool.session_hibernate",
            f"{pool.session_hibernate_ms} ms is not shorter than session_idle ({pool.session_idle_ms} ms): "
            "an idle session would be closed before it hibernates",
        )
    return pool


# --------------------------------------------------------------------------- the sections


def _document(at: Reading, doc: dict[str, Any]) -> Config:
    DOCUMENT.read(at, None, doc)  # refuses unknown top-level keys; its tables are read below
    pool_table = _table(at, doc, "pool")
    for name in ("profiles", "permissions"):  # [permissions] is the one-shot CLI's: ignored
        _table(at, doc, name)
    pool = _check_store(at, _check_timers(at, PoolSettings(**POOL.read(at, "pool", pool_table))))
    limits = NO_LIMITS
    if "limits" in pool_table:
        # A ceiling starts from nothing granted: a key it leaves out grants nothing of its kind.
        ceiling = _table(at, pool_table, "limits", "pool.limits")
        limits = replace(NOTHING_GRANTED, **LIMITS.read(at, "pool.limits", ceiling))
    profiles = []
    for name, body in _table(at, doc, "profiles").items():
        key = f"profiles.{name}"
        check_profile_name(at, key, name)
        if not isinstance(body, dict):
            raise at.fail(key, f"expected a table, got {toml_type(body)}")
        profiles.append(Profile(name=name, **PROFILE.read(at, key, body)))
    return Config(pool=pool, limits=limits, profiles=tuple(profiles))


def _table(at: Reading, parent: dict[str, Any], name: str, dotted: str | None = None) -> dict[str, Any]:
    value = parent.get(name, {})
    if not isinstance(value, dict):
        raise at.fail(dotted or name, f"expected a table, got {toml_type(value)}")
    return value


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
