"""Every key of the pool's TOML file, in one table that the loader and the published schema both read.

A key names the attribute it fills, the check of its value (a :class:`ValueKind`,
which carries the JSON Schema of what the check accepts, as the protocol's
request checks do), its default, its command-line flag and what it means.
``config`` reads a file through these tables, :func:`config_schema`
publishes them (``docs/schema/config.schema.json``, ``readie pool
--config-schema``) and ``readie_pool.reference`` renders ``docs/config.md``
from them: a key added here is parsed, published and documented, and a key
not here is refused by all three.

A ``timeout``, ``memory`` or ``max_output`` past what any job can have
(:data:`OUT_OF_REACH_RULE`) is lowered with a warning in the ceiling and
refused in a profile, here at load, so that no job finds it out; so is a
ceiling's ``collect_bytes``, ``collect_files`` or ``transfer_bytes`` past
what decision 31 allows any result or transfer (profiles have none: the
operator bounds them, nobody asks for more). The kinds of value are
``config_values``'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from readie_protocol.schema import SCHEMA_DIALECT
from readie_protocol.units import format_duration_ms, format_size, parse_duration_ms

from .config_values import (
    PATH,
    one_of,
    CEILING_COLLECT_BYTES,
    CEILING_COLLECT_FILES,
    CEILING_MEMORY,
    CEILING_OUTPUT,
    CEILING_TIMEOUT,
    CEILING_TRANSFER_BYTES,
    COLLECT_BYTES_BOUND,
    DURATION,
    EGRESS,
    EGRESS_DNS,
    COLLECT_FILES_BOUND,
    ENV,
    JOB_MEMORY,
    JOB_OUTPUT,
    JOB_TIMEOUT,
    LOG,
    LOG_FORMATS,
    MAX_EGRESS_DNS,
    MEMORY_BOUND,
    MODULES,
    NETNS_NAME,
    OUTPUT_BOUND,
    PATHS,
    POSITIVE_DURATION,
    SIZE,
    TIMEOUT_BOUND,
    TRANSFER_BYTES_BOUND,
    Reading,
    ValueKind,
    integer,
    toml_type,
)
from .policy import scalar_defaults
from .sandbox_memory import SANDBOX_MEMORY_BACKSTOP

__all__ = [
    "DEFAULT_MAX_SESSIONS",
    "DEFAULT_SESSION_IDLE",
    "DEFAULT_SESSION_IDLE_MS",
    "DEFAULT_SESSION_PAUSE",
    "DEFAULT_SESSION_PAUSE_MS",
    "DEFAULT_WORKERS",
    "DOCUMENT",
    "LIMITS",
    "LOG_FORMATS",
    "MAX_EGRESS_DNS",
    "MAX_PROFILE_NAME",
    "MAX_SESSIONS",
    "MAX_WORKERS",
    "NETWORK_MAX_OUTPUT",
    "NETWORK_MAX_TIMEOUT_MS",
    "OUT_OF_REACH_RULE",
    "PERMISSIONS_ABOUT",
    "POOL",
    "PROFILE",
    "PROFILES_ABOUT",
    "PROFILE_NAME_SCHEMA",
    "ConfigKey",
    "Reading",
    "Section",
    "ValueKind",
    "check_profile_name",
    "config_schema",
    "toml_type",
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
#: The spec: "session_idle (default 10m)", as the file would write it.
DEFAULT_SESSION_IDLE = "10m"
DEFAULT_SESSION_IDLE_MS = parse_duration_ms(DEFAULT_SESSION_IDLE)
#: A session idle this long with its sandbox quiet waits paused (decision 33, "Idle sandboxes wait
#: paused"): past the gaps between an agent's quick steps, which never pay the resume, and well
#: before session_idle closes it.
DEFAULT_SESSION_PAUSE = "10s"
DEFAULT_SESSION_PAUSE_MS = parse_duration_ms(DEFAULT_SESSION_PAUSE)
#: An answer carries stdout and stderr, each up to max_output, and a few KiB
#: more: with 1 MiB each it fits the 4 MiB that gRPC client libraries receive
#: by default. A [pool.limits] max_output raises it (and clients must then too).
NETWORK_MAX_OUTPUT = 1024 * 1024
#: A request from the network that [pool.limits] does not bound runs at most an
#: hour: a slot held longer starves the worker's other callers. The ceiling's
#: own timeout replaces it (up to readie_protocol's MAX_TIMEOUT_MS, the bound of
#: every timeout).
NETWORK_MAX_TIMEOUT_MS = 3600 * 1000
#: ``[pool] session_checkpoint``: never after a step (the default), or after each one (decision 32).
SESSION_CHECKPOINTS = frozenset({"off", "step"})
#: Profile names are echoed in the ready event and named in requests.
MAX_PROFILE_NAME = 64

# What the checks below refuse inside strings, as ECMA-262 (and Python) regexes.


@dataclass(frozen=True, slots=True)
class ConfigKey:
    """One key of a section: TOML name, the attribute it fills (of ``PoolSettings``, ``Limits``
    or ``Profile``, whose defaults the loader keeps), its value, and for the docs and the schema
    its default as text, its meaning, an example value and the flag that overrides it."""

    name: str
    attr: str
    value: ValueKind
    default: str
    about: str
    example: Any
    flag: str | None = None

    def read(self, at: Reading, dotted: str, raw: Any) -> Any:
        return self.value.read(at, dotted, raw)

    def schema(self) -> dict[str, Any]:
        schema = dict(self.value.schema)
        # A unit's own description (how sizes and durations are written) follows the key's meaning.
        unit = schema.pop("description", None)
        about = self.about if unit is None else f"{self.about} Written as {unit}."
        return {**schema, "description": about, "examples": [self.example]}


@dataclass(frozen=True, slots=True)
class Section:
    """A TOML table: its keys, and the names of the tables it may hold (read by ``config``)."""

    name: str
    keys: tuple[ConfigKey, ...]
    about: str
    tables: tuple[str, ...] = ()

    def read(self, at: Reading, prefix: str | None, table: dict[str, Any]) -> dict[str, Any]:
        """The values ``table`` sets, by attribute; an unknown key is a ConfigError."""
        allowed = {key.name for key in self.keys} | set(self.tables)
        for name in table:
            if name not in allowed:
                dotted = f"{prefix}.{name}" if prefix else name
                raise at.fail(dotted, f"unknown key (expected one of {', '.join(sorted(allowed))})")
        dot = f"{prefix}." if prefix else ""
        return {key.attr: key.read(at, dot + key.name, table[key.name]) for key in self.keys if key.name in table}

    def schema(self, **tables: dict[str, Any]) -> dict[str, Any]:
        """The section as a JSON Schema, given the schema of each table it holds."""
        if set(tables) != set(self.tables):
            raise ValueError(f"[{self.name}] holds the tables {self.tables}, got {sorted(tables)}")
        properties = {key.name: key.schema() for key in self.keys} | tables
        schema: dict[str, Any] = {"type": "object", "properties": properties, "additionalProperties": False}
        return {"title": f"[{self.name}]", "description": self.about, **schema} if self.name else schema



#: What the loader does with a value no job could be served with (docs/config.md says it).
OUT_OF_REACH_RULE = (
    "A value no job could be served with is dealt with at load, never found out by a job. A "
    "ceiling's (`[pool.limits]`) `timeout`, `memory` or `max_output` past what any job may have is "
    "lowered to that bound, with a warning on stderr naming the key: the lowered ceiling admits "
    "exactly the requests that could run. A profile's, which jobs would be given, is refused: every "
    f"job naming the profile would fail. The bounds: a timeout of at most {TIMEOUT_BOUND.written}, which "
    "every request is held to too (the sandbox's timers take at most about 292 years, and every "
    f"deadline built on a timeout must stay far inside them); memory of at most {MEMORY_BOUND.written}, "
    f"the {format_size(SANDBOX_MEMORY_BACKSTOP)} memory backstop of every sandbox less the sandbox's "
    f"own share; output of at most {OUTPUT_BOUND.written} per stream, what a sandbox captures. The "
    "ceiling's `collect_bytes`, `collect_files` and `transfer_bytes` are lowered the same way, to "
    f"{COLLECT_BYTES_BOUND.written}, {COLLECT_FILES_BOUND.written} files and {TRANSFER_BYTES_BOUND.written}."
)

PROFILE_NAME_SCHEMA = {"type": "string", "pattern": f"^[A-Za-z0-9][A-Za-z0-9_-]{{0,{MAX_PROFILE_NAME - 1}}}$"}


def check_profile_name(at: Reading, key: str, name: str) -> None:
    ok = (
        0 < len(name) <= MAX_PROFILE_NAME
        and name.isascii()
        and name[0].isalnum()
        and all(c.isalnum() or c in "-_" for c in name)
    )
    if not ok:
        raise at.fail(
            key,
            f"profile names are 1-{MAX_PROFILE_NAME} ASCII letters, digits, '-' or '_', "
            "starting with a letter or digit",
        )


# --------------------------------------------------------------------------- the sections


def _unset(limit: str) -> str:
    """What a ceiling's limit means for a job that sets none (policy: the smaller of it and the default)."""
    default = scalar_defaults()[limit]
    if default == "none":
        return "a job that sets none gets it"
    return f"a job that sets none gets it or {default}, the smaller"


POOL = Section(
    "pool",
    (
        ConfigKey("workers", "workers", integer(1, MAX_WORKERS), str(DEFAULT_WORKERS),
                  "Jobs run at once, and warm sandboxes kept of the checkpoint.", 2, "--workers"),
        ConfigKey("preload", "preload", MODULES, "none (the `base` checkpoint)",
                  "Modules every job finds imported; picks the checkpoint whose preimport is this set "
                  "(order does not matter).", ["pandas"], "--preload"),
        ConfigKey("package_dirs", "package_dirs", PATHS, "none",
                  "site-packages directories mounted read-only into every job and listed in the ready "
                  "event; they must exist and fit the package slots planned at capture.",
                  ["site-packages"], "--package-dir"),
        ConfigKey("max_sessions", "max_sessions", integer(0, MAX_SESSIONS), str(DEFAULT_MAX_SESSIONS),
                  "Sessions open at once; 0 disables sessions.", DEFAULT_MAX_SESSIONS, "--max-sessions"),
        ConfigKey("session_idle", "session_idle_ms", POSITIVE_DURATION, DEFAULT_SESSION_IDLE,
                  "A session idle this long is closed.", DEFAULT_SESSION_IDLE, "--session-idle"),
        ConfigKey("session_hibernate", "session_hibernate_ms", POSITIVE_DURATION, "off",
                  "A session idle this long is checkpointed to disk and its sandbox freed; its next step "
                  "resumes it first (about a restore's time). Shorter than session_idle.", "2m", "--session-hibernate"),
        ConfigKey("session_pause", "session_pause_ms", DURATION, DEFAULT_SESSION_PAUSE,
                  "A session idle this long with its sandbox quiet (under a tenth of a core: no code of its own "
                  "running) waits paused, taking no CPU; its next request resumes it first (about 0.5 ms). A "
                  "thread it left sleeping on a timer waits too. Never a networked session. 0: never; under a "
                  "second, quick steps pay the resume. Through --router, each readie worker takes its own "
                  "--session-pause.", "1m",
                  "--session-pause"),
        ConfigKey("session_store", "session_store", PATH, "none (the pool's own state dir: a restart forgets)",
                  "A directory of session images shared with later pools and workers (decision 32): on SIGTERM "
                  "the pool's sessions are detached into it, and a new pool attaches to them by key. Give "
                  "session_store_key with it.", "/var/lib/readie/sessions", "--session-store"),
        ConfigKey("session_store_key", "session_store_key", PATH, "none (a key made at start)",
                  "A file holding the key that signs the store's images; every pool and worker sharing the "
                  "store reads the same one. Keep it 0600.", "/etc/readie/session-store.key", "--session-store-key"),
        ConfigKey("session_checkpoint", "session_checkpoint", one_of(SESSION_CHECKPOINTS), '`"off"`',
                  "step: write each session into the store after each step, in the background, so a crash "
                  "costs at most the step in flight; off: only when it is detached.", "step",
                  "--session-checkpoint"),
        ConfigKey("egress_netns", "egress_netns", NETNS_NAME, "none: jobs asking for the network are refused",
                  "The network namespace that stands for the outside world, through which every networked "
                  "sandbox's traffic leaves (decision 36): readie wires each such sandbox into it (a veth, "
                  "routes, NAT, its firewall rules and a resolver: made and removed by readie). Required for any "
                  "job with the network. Make it yourself (ip netns add NAME) and give it its way out; never the "
                  "host's own namespace, since readie turns on ip_forward in it. One worker per namespace.",
                  "readie-egress", "--egress-netns"),
        ConfigKey("egress_dns", "egress_dns", EGRESS_DNS, "the IPv4 nameservers of the host's /etc/resolv.conf",
                  "The upstream resolvers readie's own resolver asks, in order, for the names a job may reach "
                  "(other names get NXDOMAIN). They are asked from inside egress_netns, so a resolver on the "
                  "host's loopback (127.0.0.53) is out of reach. The flag takes them comma-separated.",
                  ["192.0.2.53"], "--egress-dns"),
        ConfigKey("log", "log", LOG, '`"none"`',
                  "json: JSON logs and one line per finished job on stderr; console (none is its first "
                  "name): readable logs, no job lines.", "json", "--log"),
    ),
    "How the pool runs. A flag given on the command line replaces the file's value (a list whole).",
    tables=("limits",),
)

LIMITS = Section(
    "pool.limits",
    (
        ConfigKey("allow_read", "allow_read", PATHS, "nothing",
                  "What requests may read: a request's (or its profile's) allow_read, package_dirs and "
                  "script must lie beneath one of these or of allow_write.", ["data"]),
        ConfigKey("allow_write", "allow_write", PATHS, "nothing",
                  "Directories requests may write: a request's allow_write must lie beneath one. The "
                  "file itself may not lie beneath one, since a job could then rewrite its ceiling.",
                  ["out"]),
        ConfigKey("allow_network", "allow_network", EGRESS, "false",
                  "Where requests' jobs may connect: false (nowhere), true (the public internet), or a list of "
                  "destinations (api.example.com, *.example.com, 203.0.113.0/24, [2001:db8::1]:443; each "
                  "optionally with :port) a request's list must lie within; a request's true gets this list. "
                  "Private, loopback, link-local (169.254.169.254) and the worker's own addresses are denied "
                  "even under true, unless an address or network listed here names them (decision 35). "
                  "Networked jobs also need [pool] egress_netns (decision 36).", ["api.example.com:443", "*.pypi.org"]),
        ConfigKey("timeout", "timeout_ms", CEILING_TIMEOUT,
                  f"no bound (over the network: {format_duration_ms(NETWORK_MAX_TIMEOUT_MS)})",
                  f"The longest timeout a request may set; {_unset('timeout')}.", "30s"),
        ConfigKey("memory", "memory_bytes", CEILING_MEMORY, "no bound",
                  f"The most memory a request may set; {_unset('memory')}.", "1g"),
        ConfigKey("max_output", "max_output", CEILING_OUTPUT, f"no bound (over the network: {NETWORK_MAX_OUTPUT} bytes)",
                  f"The most stdout, and stderr, a request may keep; {_unset('max_output')}.", "1m"),
        ConfigKey("max_file_size", "max_file_size", SIZE, "no bound",
                  f"The largest file a request may let its job write; {_unset('max_file_size')}.", "256m"),
        ConfigKey("collect_bytes", "collect_bytes", CEILING_COLLECT_BYTES, COLLECT_BYTES_BOUND.written,
                  "The most bytes one result brings back with collect, all files together; a file past it "
                  "is left out (reason size). Only the ceiling sets it: not a request, not a profile.", "8m"),
        ConfigKey("collect_files", "collect_files", CEILING_COLLECT_FILES, COLLECT_FILES_BOUND.written,
                  "The most files one result brings back with collect; the rest are left out (reason count). "
                  "Only the ceiling sets it.", 16),
        ConfigKey("transfer_bytes", "transfer_bytes", CEILING_TRANSFER_BYTES, TRANSFER_BYTES_BOUND.written,
                  "The largest file one session upload or download moves; a larger one is refused before its "
                  "first byte. Only the ceiling sets it.", "64m"),
    ),
    "The operator's ceiling: every request, with the profile it names, must stay within it, or it "
    "is refused before anything runs. Without this table the stdio pool's own client may grant "
    "anything, and requests over the network (`readie worker`, `readie router`) get nothing; with "
    "it, a key left out grants nothing of its kind.",
)

PROFILE = Section(
    "profiles.NAME",
    (
        ConfigKey("allow_read", "allow_read", PATHS, "none", "Paths the job may read; the request's are added.",
                  ["data"]),
        ConfigKey("allow_write", "allow_write", PATHS, "none",
                  "Existing directories the job may write; the request's are added.", ["out"]),
        ConfigKey("package_dirs", "package_dirs", PATHS, "none",
                  "site-packages directories put on the job's sys.path, read-only; the request's are added.",
                  ["site-packages"]),
        ConfigKey("env", "env", ENV, "none", "Environment variables of the job; the request's env updates them.",
                  {"MODE": "analysis"}),
        ConfigKey("allow_network", "allow_network", EGRESS, "none",
                  "The job's network, unless the request says: false, true (what the ceiling allows) or a "
                  "list of destinations within the ceiling's.", False),
        ConfigKey("timeout", "timeout_ms", JOB_TIMEOUT, "none", "The job's timeout, unless the request sets one.",
                  "10s"),
        ConfigKey("memory", "memory_bytes", JOB_MEMORY, "none",
                  "The job's memory limit, unless the request sets one.", "512m"),
        ConfigKey("max_output", "max_output", JOB_OUTPUT, "none",
                  "Bytes of stdout, and of stderr, kept, unless the request sets it.", "64k"),
        ConfigKey("max_file_size", "max_file_size", SIZE, "none",
                  "The largest file the job may write, unless the request sets it.", "16m"),
    ),
    "A preset of request fields that a request names with `\"profile\"`: the request's own fields go "
    "on top, then the ceiling applies. Profiles are not held to the ceiling at load; a request naming "
    "one that asks for more is refused, saying the value came from the profile.",
)

PROFILES_ABOUT = (
    f"Profiles by name, which is 1-{MAX_PROFILE_NAME} ASCII letters, digits, '-' or '_', starting with a "
    "letter or digit; the ready event lists the names in file order."
)
#: The spec gives [permissions] to the one-shot command line; one file may serve both.
PERMISSIONS_ABOUT = "The one-shot command line's permissions; accepted so one file serves both, and ignored by the pool."

#: The file itself: no keys of its own, only tables.
DOCUMENT = Section("", (), "", tables=("pool", "profiles", "permissions"))


def config_schema() -> dict[str, Any]:
    """The JSON Schema of the whole file, as TOML parses it (``tomllib``)."""
    profiles = {
        "type": "object",
        "description": PROFILES_ABOUT,
        "propertyNames": PROFILE_NAME_SCHEMA,
        "additionalProperties": PROFILE.schema(),
    }
    return {
        "$schema": SCHEMA_DIALECT,
        "title": "readie pool configuration (TOML)",
        "description": "The file `--config` names, as TOML parses it. Unknown keys are refused; relative "
        "paths resolve against the file's directory. Integers are TOML integers: 4.0 is refused where an "
        "integer is expected, though JSON Schema allows it.",
        **DOCUMENT.schema(
            pool=POOL.schema(limits=LIMITS.schema()),
            profiles=profiles,
            permissions={"type": "object", "description": PERMISSIONS_ABOUT},
        ),
    }
