"""The TOML configuration: the spec's file verbatim, defaults, and every refusal naming its key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from readie_policy.config import (
    CLI_SOURCE,
    MAX_CONFIG_BYTES,
    DEFAULT_MAX_SESSIONS,
    DEFAULT_SESSION_IDLE_MS,
    DEFAULT_WORKERS,
    CliOverrides,
    Config,
    PoolSettings,
    apply_cli,
    load_config,
    parse_config,
)
from readie_executor.jobs import bounds
from readie_protocol.requests import MAX_TIMEOUT_MS
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES
from readie_worker.errors import ConfigError
from readie_policy.policy import NO_LIMITS, Limits, Profile
from readie_policy.sandbox_memory import MAX_JOB_MEMORY
from structlog.testing import capture_logs

SPEC_CONFIG = """\
[pool]
workers = 4
preload = ["pandas"]
package_dirs = ["/srv/agent/site-packages"]
max_sessions = 32
session_idle = "15m"
log = "json"

[pool.limits]
allow_read = ["/srv/agent/data"]
allow_write = ["/srv/agent/work"]
allow_network = false
timeout = "30s"
memory = "1g"
max_output = 1048576
max_file_size = "256m"

[profiles.analysis]
allow_read = ["/srv/agent/data"]
allow_write = ["/srv/agent/work"]

[profiles.fetch]
allow_network = true
"""

# The spec's ready event names this file; nothing here touches the disk.
SPEC_PATH = Path("/etc/readie/prod.toml")


def lexical(path: str) -> str:
    """A resolver that follows no symlinks, so tests do not depend on this machine's /srv."""
    return os.path.normpath(path)


def parse(text: str, path: Path = SPEC_PATH) -> Config:
    return parse_config(text, path, resolve=lexical)


def refusal(text: str, path: Path = SPEC_PATH) -> ConfigError:
    with pytest.raises(ConfigError) as info:
        parse(text, path)
    return info.value


def test_spec_config() -> None:
    # Loads verbatim, though [profiles.fetch] asks for the network its own
    # ceiling denies: the ceiling applies per request, after the profile.
    config = parse(SPEC_CONFIG)
    assert config == Config(
        path=SPEC_PATH,
        pool=PoolSettings(
            workers=4,
            preload=("pandas",),
            package_dirs=(Path("/srv/agent/site-packages"),),
            max_sessions=32,
            session_idle_ms=15 * 60 * 1000,
            log="json",
        ),
        limits=Limits(
            allow_read=(Path("/srv/agent/data"),),
            allow_write=(Path("/srv/agent/work"),),
            allow_network=False,
            timeout_ms=30_000,
            memory_bytes=1024**3,
            max_output=1048576,
            max_file_size=256 * 1024**2,
        ),
        profiles=(
            Profile(
                name="analysis",
                allow_read=(Path("/srv/agent/data"),),
                allow_write=(Path("/srv/agent/work"),),
            ),
            Profile(name="fetch", allow_network=True),
        ),
    )
    assert config.profile_names == ("analysis", "fetch")
    assert set(config.profile_map) == {"analysis", "fetch"}


def test_empty_file_gives_defaults_and_no_ceiling() -> None:
    config = parse("")
    assert config == Config(path=SPEC_PATH)
    assert config.pool == PoolSettings(
        workers=DEFAULT_WORKERS,
        max_sessions=DEFAULT_MAX_SESSIONS,
        session_idle_ms=DEFAULT_SESSION_IDLE_MS,
        log="none",
    )
    assert DEFAULT_MAX_SESSIONS == 16 and DEFAULT_SESSION_IDLE_MS == 600_000
    assert config.limits is NO_LIMITS


def test_a_limits_table_is_a_full_ceiling() -> None:
    config = parse('[pool.limits]\ntimeout = "10s"\n')
    assert config.limits == Limits(
        allow_read=(), allow_write=(), allow_network=False, timeout_ms=10_000
    )


def test_integers_are_bytes_and_seconds() -> None:
    config = parse("[pool]\nsession_idle = 90\n[pool.limits]\ntimeout = 5\nmemory = 1048576\n")
    assert config.pool.session_idle_ms == 90_000
    assert (config.limits.timeout_ms, config.limits.memory_bytes) == (5000, 1048576)


def test_relative_paths_resolve_against_the_file_directory() -> None:
    config = parse(
        '[pool]\npackage_dirs = ["site", "../shared/site"]\n'
        '[pool.limits]\nallow_read = ["data", "./data", "/abs"]\nallow_write = ["work/../out"]\n'
        '[profiles.p]\nallow_read = ["data/sub"]\n',
        Path("/srv/agent/conf/readie.toml"),
    )
    assert config.pool.package_dirs == (Path("/srv/agent/conf/site"), Path("/srv/agent/shared/site"))
    # Duplicates after resolution collapse.
    assert config.limits.allow_read == (Path("/srv/agent/conf/data"), Path("/abs"))
    assert config.limits.allow_write == (Path("/srv/agent/conf/out"),)
    assert config.profiles[0].allow_read == (Path("/srv/agent/conf/data/sub"),)


def test_symlinked_paths_resolve(tmp_path: Path) -> None:
    real = tmp_path / "real"
    real.mkdir()
    (tmp_path / "link").symlink_to(real)
    config = parse_config('[pool.limits]\nallow_read = ["link"]\n', tmp_path / "c.toml")
    assert config.limits.allow_read == (real.resolve(),)


@pytest.mark.parametrize(
    "text",
    [
        '[pool.limits]\nallow_write = ["."]\n',
        '[pool.limits]\nallow_write = ["/etc"]\n',
        '[pool.limits]\nallow_write = ["/"]\n',
    ],
)
def test_file_beneath_its_own_limits_write_grant_is_refused(text: str) -> None:
    error = refusal(text)
    assert error.key == "pool.limits.allow_write"
    assert "holds this file" in error.reason


def test_file_beneath_a_profile_write_grant_is_refused() -> None:
    error = refusal('[profiles.w]\nallow_write = ["/etc/readie"]\n')
    assert error.key == "profiles.w.allow_write"


def test_sibling_directory_is_not_beneath() -> None:
    parse('[pool.limits]\nallow_write = ["/etc/readie-work"]\n')  # no error


def test_load_config_reads_and_checks_the_real_file(tmp_path: Path) -> None:
    path = tmp_path / "readie.toml"
    path.write_text('[pool]\nworkers = 3\n[pool.limits]\nallow_read = ["data"]\n')
    config = load_config(path)
    assert config.path == path.resolve()
    assert config.pool.workers == 3
    assert config.limits.allow_read == ((tmp_path / "data").resolve(),)


def test_load_config_refuses_a_symlink_in_a_writable_directory(tmp_path: Path) -> None:
    safe = tmp_path / "safe"
    work = tmp_path / "work"
    safe.mkdir()
    work.mkdir()
    (safe / "readie.toml").write_text(f'[pool.limits]\nallow_write = ["{work}"]\n')
    (work / "readie.toml").symlink_to(safe / "readie.toml")
    assert load_config(safe / "readie.toml").limits.allow_write == (work.resolve(),)
    # Through the link, a job writing in work/ could repoint the file it names.
    with pytest.raises(ConfigError, match="holds this file"):
        load_config(work / "readie.toml")


def test_load_config_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path / "nope.toml")
    assert info.value.path == str(tmp_path / "nope.toml")
    assert "cannot read" in info.value.reason


def test_load_config_refuses_what_is_not_a_regular_file_without_waiting(tmp_path: Path) -> None:
    """A FIFO would block open() until a writer came: it is refused before a byte is read."""
    fifo = tmp_path / "readie.toml"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match=r"cannot read: not a regular file \(a FIFO\)"):
        load_config(fifo)
    with pytest.raises(ConfigError, match=r"not a regular file \(a directory\)"):
        load_config(tmp_path)
    with pytest.raises(ConfigError, match=r"not a regular file \(a character device\)"):
        load_config("/dev/zero")  # would read without end


def test_load_config_refuses_a_file_past_the_bound(tmp_path: Path) -> None:
    path = tmp_path / "readie.toml"
    path.write_text("# " + "x" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigError, match=f"more than the {MAX_CONFIG_BYTES} allowed"):
        load_config(path)


def test_a_ceiling_past_what_a_job_can_have_is_lowered_with_a_warning() -> None:
    """The ceiling then admits exactly the requests that could run; before, a 10**8 h timeout
    failed every job that got it with OverflowError, 64g of memory every job naming none, and 1t of
    max_output every job naming none over the network."""
    text = '[pool.limits]\ntimeout = "100000000h"\nmemory = "64g"\nmax_output = "1t"\n'
    with capture_logs() as logs:
        config = parse(text)
    assert (config.limits.timeout_ms, config.limits.memory_bytes) == (MAX_TIMEOUT_MS, MAX_JOB_MEMORY)
    assert config.limits.max_output == bounds.MAX_OUTPUT_LIMIT
    lowered = {entry["key"]: entry for entry in logs if entry["event"] == "config value lowered"}
    assert set(lowered) == {"pool.limits.timeout", "pool.limits.memory", "pool.limits.max_output"}
    assert lowered["pool.limits.timeout"]["used"] == "24h" and lowered["pool.limits.memory"]["given"] == "64g"
    assert all(entry["log_level"] == "warning" and entry["file"] == str(SPEC_PATH) for entry in lowered.values())
    with capture_logs() as logs:  # at the bound: kept, and nothing said
        config = parse('[pool.limits]\ntimeout = "24h"\nmemory = "3840m"\nmax_output = "16m"\n')
    assert (config.limits.timeout_ms, config.limits.memory_bytes) == (MAX_TIMEOUT_MS, MAX_JOB_MEMORY)
    assert config.limits.max_output == bounds.MAX_OUTPUT_LIMIT
    assert logs == []


def test_what_comes_back_and_moves_is_lowered_to_decision_31s_bounds() -> None:
    """collect_bytes, collect_files and transfer_bytes are ceiling-only, lowered as timeout is."""
    with capture_logs() as logs:
        config = parse('[pool.limits]\ncollect_bytes = "1g"\ncollect_files = 100000\ntransfer_bytes = "1t"\n')
    limits = config.limits
    assert (limits.collect_bytes, limits.collect_files, limits.transfer_bytes) == (
        MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES)
    lowered = {entry["key"] for entry in logs if entry["event"] == "config value lowered"}
    assert lowered == {"pool.limits.collect_bytes", "pool.limits.collect_files", "pool.limits.transfer_bytes"}
    config = parse('[pool.limits]\ncollect_bytes = "1m"\ncollect_files = 0\ntransfer_bytes = 0\n')
    assert (config.limits.collect_bytes, config.limits.collect_files, config.limits.transfer_bytes) == (2**20, 0, 0)
    assert parse("[pool.limits]\n").limits.collect_bytes is None  # unset: the hard maximum, in the policy


def test_an_exception_no_check_foresaw_is_still_a_config_error(monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug in a check ends as the file's ConfigError, naming the exception, not as a traceback."""
    import readie_policy.config

    def broken(*args: object) -> None:
        raise KeyError("a bug")

    monkeypatch.setattr(readie_policy.config, "_check_timers", broken)
    with pytest.raises(ConfigError) as info:
        parse("[pool]\nworkers = 2\n")
    assert info.value.key is None and "cannot be loaded (KeyError: 'a bug')" in info.value.reason
    assert isinstance(info.value.__cause__, KeyError)  # kept for whoever debugs it


def test_parse_config_needs_an_absolute_path() -> None:
    with pytest.raises(ValueError):
        parse_config("", Path("relative.toml"))


# (toml, key named, text in the reason)
BAD_CONFIGS: list[tuple[str | bytes, str | None, str]] = [
    ("[pool\n", None, "not valid TOML"),
    ("workers = = 4\n", None, "not valid TOML"),
    ("[pool]\nworkers = 1\nworkers = 2\n", None, "not valid TOML"),
    (b"[pool]\nlog = \"\xff\"\n", None, "not valid UTF-8"),
    ("bogus = 1\n", "bogus", "unknown key"),
    ("[limits]\ntimeout = 1\n", "limits", "unknown key"),
    ("pool = 3\n", "pool", "expected a table, got an integer"),
    ("profiles = []\n", "profiles", "expected a table, got an array"),
    ("permissions = 1\n", "permissions", "expected a table"),
    ("[pool]\nworker = 4\n", "pool.worker", "unknown key"),
    ("[pool]\nworkers = 0\n", "pool.workers", "from 1 to 256"),
    ("[pool]\nworkers = 100000\n", "pool.workers", "from 1 to 256"),
    ("[pool]\nworkers = true\n", "pool.workers", "got a boolean"),
    ('[pool]\nworkers = "4"\n', "pool.workers", "got a string"),
    ("[pool]\nworkers = 4.0\n", "pool.workers", "got a float"),
    ('[pool]\npreload = "pandas"\n', "pool.preload", "expected an array"),
    ('[pool]\npreload = ["pandas", 3]\n', "pool.preload[1]", "expected a string"),
    ('[pool]\npreload = ["not a module"]\n', "pool.preload[0]", "not a module name"),
    ('[pool]\npreload = ["os."]\n', "pool.preload[0]", "not a module name"),
    ('[pool]\npackage_dirs = [""]\n', "pool.package_dirs[0]", "must not be empty"),
    ("[pool]\nmax_sessions = -1\n", "pool.max_sessions", "from 0 to"),
    ('[pool]\nsession_idle = "0s"\n', "pool.session_idle", "greater than zero"),
    ('[pool]\nsession_idle = "1.5h"\n', "pool.session_idle", "whole numbers"),
    ('[pool]\nsession_idle = "10 m"\n', "pool.session_idle", "spaces"),
    ('[pool]\nlog = "text"\n', "pool.log", "expected one of console, json, none"),
    ("[pool]\nlimits = 1\n", "pool.limits", "expected a table"),
    ("[pool.limits]\nnetwork = false\n", "pool.limits.network", "unknown key"),
    ('[pool.limits]\nallow_read = "/srv"\n', "pool.limits.allow_read", "expected an array"),
    ('[pool.limits]\nallow_network = "no"\n', "pool.limits.allow_network",
     "expected true, false or an array of destinations, got a string"),
    ('[pool.limits]\ntimeout = "30"\nmemory = "1.5g"\n', "pool.limits.memory", "whole numbers"),
    ('[pool.limits]\nmemory = "0"\n', "pool.limits.memory", "greater than zero"),
    ('[pool.limits]\nmax_output = -1\n', "pool.limits.max_output", "negative"),
    ('[pool.limits]\nmax_file_size = "256mb"\n', "pool.limits.max_file_size", "unknown unit 'mb'"),
    ('[pool.limits]\ntimeout = 1.5\n', "pool.limits.timeout", "float"),
    ("[profiles]\nx = 1\n", "profiles.x", "expected a table, got an integer"),
    ('[profiles."bad name"]\n', 'profiles.bad name', "profile names are"),
    ('[profiles."-x"]\n', "profiles.-x", "profile names are"),
    ('[profiles.a]\ncode = "x"\n', "profiles.a.code", "unknown key"),
    ('[profiles.a]\nprofile = "b"\n', "profiles.a.profile", "unknown key"),
    ("[profiles.a.b]\n", "profiles.a.b", "unknown key"),
    ('[profiles.a]\nenv = {A = 1}\n', "profiles.a.env.A", "expected a string"),
    ('[profiles.a]\nenv = {"A=B" = "1"}\n', "profiles.a.env.A=B", "not a variable name"),
    ('[profiles.a]\nenv = ["A"]\n', "profiles.a.env", "expected a table"),
    ('[profiles.a]\ntimeout = "forever"\n', "profiles.a.timeout", "expected digits"),
    # Values jobs would be given that no job could be served with (a ceiling's are lowered instead).
    ('[profiles.a]\ntimeout = "100000000h"\n', "profiles.a.timeout", "too large: at most 24h"),
    ('[profiles.a]\ntimeout = 86401\n', "profiles.a.timeout", "too large: at most 24h"),
    ('[profiles.a]\nmemory = "5g"\n', "profiles.a.memory", "too large: at most 3840m"),
    ('[profiles.a]\nmax_output = "8388607t"\n', "profiles.a.max_output", "too large: at most 16m"),
    ('[pool.limits]\ncollect_files = -1\n', "pool.limits.collect_files", "must be from 0"),
    ('[pool.limits]\ncollect_files = "3"\n', "pool.limits.collect_files", "expected an integer"),
    ('[pool.limits]\ntransfer_bytes = "1.5g"\n', "pool.limits.transfer_bytes", ""),
    # Ceiling-only: a profile cannot set what comes back or moves.
    ('[profiles.a]\ncollect_bytes = "1m"\n', "profiles.a.collect_bytes", "unknown key"),
    ('[profiles.a]\ntransfer_bytes = "1m"\n', "profiles.a.transfer_bytes", "unknown key"),
    # tomllib recurses into arrays and inline tables: past a few hundred levels, RecursionError.
    ("a = " + "[" * 5000 + "]" * 5000 + "\n", None, "nested too deeply"),
    ("a = " + "{b = " * 5000 + "1" + "}" * 5000 + "\n", None, "nested too deeply"),
    ("[pool]\npreload = " + "[" * 5000 + "\n", None, "nested too deeply"),  # not even closed
]


@pytest.mark.parametrize(("text", "key", "reason"), BAD_CONFIGS)
def test_bad_configs(text: str | bytes, key: str | None, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(text, SPEC_PATH, resolve=lexical)
    error = info.value
    assert (error.path, error.key) == (str(SPEC_PATH), key)
    assert reason in error.reason
    prefix = f"{SPEC_PATH}: {key}: " if key else f"{SPEC_PATH}: "
    assert str(error).startswith(prefix)


def test_permissions_section_is_ignored() -> None:
    config = parse('[permissions]\nallow_write = ["/etc"]\nanything = 1\n')
    assert config.limits is NO_LIMITS


def test_profiles_are_not_held_to_the_ceiling_at_load() -> None:
    config = parse(
        '[pool.limits]\nallow_read = ["/srv/data"]\ntimeout = "30s"\n'
        '[profiles.wide]\nallow_read = ["/"]\ntimeout = "1h"\nenv = {LANG = "C.UTF-8"}\n'
    )
    assert config.profiles[0] == Profile(
        name="wide", allow_read=(Path("/"),), timeout_ms=3_600_000, env=(("LANG", "C.UTF-8"),)
    )


# --------------------------------------------------------------------------- command line


def test_cli_overrides_replace_file_values() -> None:
    pool = parse(SPEC_CONFIG).pool
    merged = apply_cli(
        pool,
        CliOverrides(workers=2, preload=("numpy", "pandas"), package_dirs=("site",), log="none"),
        cwd="/home/me",
        resolve=lexical,
    )
    assert merged == PoolSettings(
        workers=2,
        preload=("numpy", "pandas"),
        package_dirs=(Path("/home/me/site"),),
        max_sessions=32,
        session_idle_ms=15 * 60 * 1000,
        log="none",
    )


def test_cli_without_flags_keeps_the_file() -> None:
    pool = PoolSettings(workers=7, log="json")
    assert apply_cli(pool, CliOverrides(), cwd="/") == pool


def test_cli_empty_list_clears() -> None:
    pool = PoolSettings(preload=("pandas",))
    assert apply_cli(pool, CliOverrides(preload=()), cwd="/").preload == ()


def test_cli_sessions() -> None:
    merged = apply_cli(PoolSettings(), CliOverrides(max_sessions=0, session_idle="30s"), cwd="/")
    assert (merged.max_sessions, merged.session_idle_ms) == (0, 30_000)


@pytest.mark.parametrize(
    ("overrides", "key", "reason"),
    [
        (CliOverrides(workers=0), "--workers", "from 1 to"),
        (CliOverrides(preload=("a b",)), "--preload[0]", "not a module name"),
        (CliOverrides(log="xml"), "--log", "expected one of"),
        (CliOverrides(package_dirs=("",)), "--package-dir[0]", "must not be empty"),
        (CliOverrides(session_idle="soon"), "--session-idle", "expected digits"),
    ],
)
def test_cli_refusals(overrides: CliOverrides, key: str, reason: str) -> None:
    with pytest.raises(ConfigError) as info:
        apply_cli(PoolSettings(), overrides, cwd="/")
    assert (info.value.path, info.value.key) == (CLI_SOURCE, key)
    assert reason in info.value.reason


# --------------------------------------------------------------------------- the session store (decision 32)


def test_the_session_store_and_its_key_resolve_beside_the_file_and_flags_beside_the_cwd() -> None:
    pool = parse("[pool]\nsession_store = 'store'\nsession_store_key = 'keys/store.key'\nsession_checkpoint = 'step'\n").pool
    assert (pool.session_store, pool.session_store_key, pool.session_checkpoint) == (
        Path("/etc/readie/store"), Path("/etc/readie/keys/store.key"), "step")
    merged = apply_cli(pool, CliOverrides(session_store="s", session_store_key="k", session_checkpoint="off"),
                       cwd="/home/me", resolve=lexical)
    assert (merged.session_store, merged.session_store_key, merged.session_checkpoint) == (
        Path("/home/me/s"), Path("/home/me/k"), "off")
    assert PoolSettings().session_store is None and PoolSettings().session_checkpoint == "off"


@pytest.mark.parametrize(
    "text, key, message",
    [
        ("session_store = 'store'", "pool.session_store_key", "required with session_store"),
        ("session_checkpoint = 'always'", "pool.session_checkpoint", "expected one of off, step, got 'always'"),
        ("session_store = ''", "pool.session_store", "must not be empty"),
        ("session_store_key = 7", "pool.session_store_key", "expected a string, got an integer"),
    ],
)
def test_a_bad_session_store_setting_is_refused_naming_the_key(text: str, key: str, message: str) -> None:
    error = refusal(f"[pool]\n{text}\n")
    assert error.key == key and message in str(error)
