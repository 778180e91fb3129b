"""From a request to the policy a job runs under: profile, request, ceiling.

The order is the spec's: the named profile's fields first, the request's own
fields on top, then the ``[pool.limits]`` ceiling. "On top" means:

* path lists (``allow_read``, ``allow_write``, ``package_dirs``) are the
  profile's followed by the request's, duplicates dropped: a request adds
  grants to its profile, it cannot silently lose the profile's;
* ``env`` is the profile's mapping updated with the request's;
* single values (``allow_network``, ``timeout``, ``memory``, ``max_output``,
  ``max_file_size``) are the request's when it sets them, else the profile's.

Then the ceiling: every path must lie beneath a ceiling path (``allow_read``
beneath a ceiling read *or* write path, since writing implies reading;
``allow_write`` beneath a ceiling write path; ``package_dirs`` beneath either,
or beneath one of the pool's own package dirs), ``allow_network``'s destinations
must lie within the ceiling's (``egress``: ``true`` asks for what the ceiling
allows), and the four numbers may not exceed it. What a result may bring
back with ``collect`` and the largest file a session moves are the
ceiling's alone (``collect_bytes``, ``collect_files``, ``transfer_bytes``),
at most decision 31's hard maxima. A value left unset takes
the smaller of the default below and the ceiling, so the ceiling's
``max_file_size`` (or ``memory``, or ``timeout``) applies to a request that
does not set one.

Paths: relative request paths resolve against the caller's working directory
(the pool's, itself resolved), profile and ceiling paths against the config
file's directory (``config`` does that, following the operator's symlinks).
A path a *request* names may not pass through a symlink at all: anything
that can write beneath a grant (a job) can plant one, and readie never
follows it (``readie_worker.paths``). Such a path is refused here, and again
by the worker when the job takes its slot, which opens each grant without
following symlinks and holds it (``readie_worker.grants``): this check is the
early, friendly one, the worker's the one that counts. A path with no symlink
in it means what it says lexically, so ``..`` is removed lexically and
neither ``data/../../etc`` nor a symlink ``data/escape -> /etc`` passes as
"beneath data". The policy holds those absolute paths.

A write grant may not cover, or lie inside, one of the pool's own package
dirs (the spec: "no job may write over preloaded runtime paths"). A
``script`` must lie beneath a ceiling path too (:func:`resolve_script`).

A refusal raises :class:`RequestError` naming the request field and quoting
the path as the request wrote it, never what it resolves to (a refusal must
not tell a client where a symlink leads, or the pool's own files); when the
value at fault came from the profile, the message says so.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, TypeVar, overload

from readie_protocol.errors import RequestError
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_TRANSFER_BYTES

from ._grant_paths import Named as _Named
from ._grant_paths import beneath as _beneath
from ._grant_paths import join as _join
from ._grant_paths import merge as _merge
from ._grant_paths import named as _named
from ._grant_paths import not_over as _not_over
from ._grant_paths import refuse_symlinks, request_path, resolve_path
from .egress import Ceiling, Destination, Egress, parse_destinations, resolve_egress

__all__ = [
    "scalar_defaults",
    "DEFAULT_MAX_FILE_SIZE",
    "DEFAULT_MAX_OUTPUT",
    "DEFAULT_MEMORY_BYTES",
    "DEFAULT_TIMEOUT_MS",
    "NO_LIMITS",
    "NOTHING_GRANTED",
    "Limits",
    "Policy",
    "PolicyRequest",
    "Profile",
    "Resolver",
    "check_step",
    "call_timeout",
    "refuse_symlinks",
    "request_path",
    "resolve_path",
    "resolve_policy",
    "resolve_script",
]

#: A job that sets no timeout still ends: 30 s is the spec's example ceiling
#: and long enough for a data-analysis step, short enough for an agent loop.
DEFAULT_TIMEOUT_MS = 30_000
#: No memory limit of our own: gVisor's sandbox and the host's cgroup bound a
#: job already, and any number here would be wrong for someone's preloads.
DEFAULT_MEMORY_BYTES: int | None = None
#: Captured stdout and stderr are each cut at 1 MiB: the size of one protocol
#: line, and the spec's example ceiling.
DEFAULT_MAX_OUTPUT = 1024 * 1024
#: No file-size limit unless the request or the ceiling sets one.
DEFAULT_MAX_FILE_SIZE: int | None = None

_T = TypeVar("_T")

#: Turns a path into its absolute, symlink-free form; injectable for tests.
#: None: paths are checked lexically only, because they name another host's
#: files (a router's requests, the worker's; the worker opens them without
#: following symlinks itself).
Resolver = Callable[[str], str] | None


class PolicyRequest(Protocol):
    """What a request says about its policy: the pool protocol's ``JobRequest`` or a gRPC
    ``RunJobRequest`` read through ``_convert``. None means "not set"."""

    @property
    def profile(self) -> str | None: ...
    @property
    def allow_read(self) -> tuple[str, ...] | None: ...
    @property
    def allow_write(self) -> tuple[str, ...] | None: ...
    @property
    def package_dirs(self) -> tuple[str, ...] | None: ...
    @property
    def env(self) -> tuple[tuple[str, str], ...] | None: ...
    @property
    def allow_network(self) -> bool | tuple[str, ...] | None: ...
    @property
    def timeout_ms(self) -> int | None: ...
    @property
    def memory_bytes(self) -> int | None: ...
    @property
    def max_output(self) -> int | None: ...
    @property
    def max_file_size(self) -> int | None: ...
    @property
    def script(self) -> str | None: ...
    @property
    def packages(self) -> tuple[str, ...] | None: ...


@dataclass(frozen=True, slots=True)
class Limits:
    """The ``[pool.limits]`` ceiling. None means no bound on that dimension.

    :data:`NO_LIMITS` is the pool without a ``[pool.limits]`` table: the
    client that starts the pool is trusted to grant what it likes. With the
    table, ``config`` fills absent path lists with ``()`` and an absent
    ``allow_network`` with False: a ceiling that forgot a key grants nothing
    of that kind. ``allow_network``: True (the public internet), False, or
    destinations (``egress``); None, no ceiling: a request's ``true`` is the
    public internet and its list is taken as written.
    """

    allow_read: tuple[Path, ...] | None = None
    allow_write: tuple[Path, ...] | None = None
    allow_network: Ceiling = None
    timeout_ms: int | None = None
    memory_bytes: int | None = None
    max_output: int | None = None
    max_file_size: int | None = None
    # What may come back with a result's ``collect``, and the largest file a session's upload or
    # download moves (decision 31); None: the hard maxima of ``readie_protocol.workspace``.
    # Ceiling-only: no request or profile asks for these.
    collect_bytes: int | None = None
    collect_files: int | None = None
    transfer_bytes: int | None = None


NO_LIMITS = Limits()
#: The ceiling of a request that came over the network when the operator set
#: none: no grant, no package dir, no script, no network. The stdio pool's
#: client started the pool and is trusted (NO_LIMITS); a peer on the wire is not.
NOTHING_GRANTED = Limits(allow_read=(), allow_write=(), allow_network=False)


@dataclass(frozen=True, slots=True)
class Profile:
    """A ``[profiles.NAME]`` preset; paths are absolute (resolved by ``config``)."""

    name: str
    allow_read: tuple[Path, ...] | None = None
    allow_write: tuple[Path, ...] | None = None
    package_dirs: tuple[Path, ...] | None = None
    env: tuple[tuple[str, str], ...] | None = None
    allow_network: bool | tuple[Destination, ...] | None = None
    timeout_ms: int | None = None
    memory_bytes: int | None = None
    max_output: int | None = None
    max_file_size: int | None = None


@dataclass(frozen=True, slots=True)
class Policy:
    """What one job (or session) may do, after profile, request and ceiling."""

    allow_read: tuple[Path, ...] = ()
    allow_write: tuple[Path, ...] = ()
    package_dirs: tuple[Path, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    network: bool = False  # whether it has a network at all: ``egress`` is not None
    egress: Egress | None = None
    timeout_ms: int = DEFAULT_TIMEOUT_MS
    memory_bytes: int | None = DEFAULT_MEMORY_BYTES
    max_output: int = DEFAULT_MAX_OUTPUT
    max_file_size: int | None = DEFAULT_MAX_FILE_SIZE
    collect_bytes: int = MAX_COLLECTED_BYTES
    collect_files: int = MAX_COLLECTED_FILES
    transfer_bytes: int = MAX_TRANSFER_BYTES


def resolve_policy(
    request: PolicyRequest,
    *,
    cwd: str | Path,
    limits: Limits = NO_LIMITS,
    profiles: Mapping[str, Profile] | None = None,
    protected: Iterable[Path] = (),
    resolve: Resolver = os.path.realpath,
) -> Policy:
    """The effective policy for ``request``, or RequestError naming the field.

    ``protected`` are paths no job may write beneath or over: the pool's own
    package dirs (the spec: "no job may write over preloaded runtime paths").
    """
    if request.packages is not None and limits is not NO_LIMITS:
        # The ceiling has no key for packages (installed on the host, as root):
        # one that does not name a kind of grant grants none of it.
        raise RequestError("the [pool.limits] ceiling does not allow per-request packages", "packages")
    profile = _profile(request.profile, profiles or {})
    # Profiles are not held to the ceiling at load (see _config), so a value
    # from one can fail here; the message says so, since the request's own
    # field is named but the request never set that value.
    note = f" (from profile {profile.name!r})"
    own = _RequestPaths(request, cwd)
    pool_dirs = tuple(protected)
    readable = _join(limits.allow_read, limits.allow_write)
    ceilings = {
        "allow_read": readable,
        "allow_write": limits.allow_write,
        "package_dirs": _join(readable, pool_dirs),
    }
    merged: dict[str, tuple[Path, ...]] = {}
    for field, ceiling in ceilings.items():
        theirs = _named(getattr(profile, field))
        mine: tuple[_Named, ...] = getattr(own, field) or ()
        _beneath(field, theirs, ceiling, note)
        _beneath(field, mine, ceiling)
        for shown, path in mine:
            if resolve is not None:
                refuse_symlinks(field, shown, path, cwd, resolve)
        merged[field] = _merge(tuple(p for _, p in theirs), tuple(p for _, p in mine))
    _not_over(_named(profile.allow_write), pool_dirs, note)
    _not_over(own.allow_write or (), pool_dirs)
    # A path granted both ways is a write grant (writing implies reading).
    merged["allow_read"] = tuple(p for p in merged["allow_read"] if p not in merged["allow_write"])

    mine = request.allow_network
    asked, origin = _pick(parse_destinations(mine) if isinstance(mine, tuple) else mine, profile.allow_network, note)
    egress = resolve_egress(asked, limits.allow_network, origin)

    env = dict(profile.env or ())
    env.update(request.env or ())
    return Policy(
        allow_read=merged["allow_read"],
        allow_write=merged["allow_write"],
        package_dirs=merged["package_dirs"],
        env=tuple(env.items()),
        network=egress is not None,
        egress=egress,
        **_workspace_bounds(limits),
        **{
            attribute: _limited(field, _pick(getattr(request, attribute), getattr(profile, attribute), note),
                                getattr(limits, attribute), default, show)
            for field, attribute, default, show in _SCALARS
        },
    )


def _workspace_bounds(limits: Limits) -> dict[str, int]:
    """What may come back and move (decision 31): the ceiling's, never past the hard maxima."""
    bounds = {"collect_bytes": MAX_COLLECTED_BYTES, "collect_files": MAX_COLLECTED_FILES,
              "transfer_bytes": MAX_TRANSFER_BYTES}
    return {name: most if getattr(limits, name) is None else min(most, getattr(limits, name))
            for name, most in bounds.items()}


def check_step(timeout_ms: int | None, max_output: int | None, limits: Limits) -> None:
    """RequestError if a session step's own ``timeout`` or ``max_output`` exceeds the ceiling.

    A step takes the session's grants; the session manager refuses any other
    setup field before this, and the session's job fills what the step leaves
    unset (``readie_policy.jobs.CodeJob.step``).
    """
    if timeout_ms is not None:
        _within("timeout", timeout_ms, limits.timeout_ms, _ms)
    if max_output is not None:
        _within("max_output", max_output, limits.max_output, _bytes)


def call_timeout(timeout_ms: int | None, limits: Limits = NO_LIMITS) -> int:
    """The timeout of a call that has no policy of its own (a remote function's ``Execute``): the
    asked one (else the default), at most the ceiling's.

    Cut, not refused, as a caller's deadline cuts it: a remote call always asks for its client's
    timeout (30 s unless set), and a worker whose ceiling is shorter must still serve it, for at
    most as long as its operator allows; the call then ends with its own TimeoutError.
    """
    asked = DEFAULT_TIMEOUT_MS if timeout_ms is None else timeout_ms
    return asked if limits.timeout_ms is None else min(asked, limits.timeout_ms)


def resolve_script(
    request: PolicyRequest,
    *,
    cwd: str | Path,
    limits: Limits = NO_LIMITS,
    resolve: Resolver = os.path.realpath,
) -> Path | None:
    """The absolute path of ``request.script``, which must lie beneath a ceiling path.

    The pool reads the script for the job, so a job need not be granted the
    script's directory (the spec runs ``app.py`` with only ``data`` readable);
    but the script is a path the request asks for, so the ceiling applies.
    """
    if request.script is None:
        return None
    path = request_path("script", request.script, cwd)
    _beneath("script", ((request.script, path),), _join(limits.allow_read, limits.allow_write))
    if resolve is not None:
        refuse_symlinks("script", request.script, path, cwd, resolve)
    return path


# --------------------------------------------------------------------------- helpers


class _RequestPaths:
    """The request's own path lists, resolved against the caller's directory."""

    def __init__(self, request: PolicyRequest, cwd: str | Path) -> None:
        def each(field: str, paths: tuple[str, ...] | None) -> tuple[_Named, ...] | None:
            if paths is None:
                return None
            return tuple((p, request_path(field, p, cwd)) for p in paths)

        self.allow_read = each("allow_read", request.allow_read)
        self.allow_write = each("allow_write", request.allow_write)
        self.package_dirs = each("package_dirs", request.package_dirs)


def _profile(name: str | None, profiles: Mapping[str, Profile]) -> Profile:
    if name is None:
        return Profile(name="")
    try:
        return profiles[name]
    except KeyError:
        known = ", ".join(sorted(profiles)) or "none are configured"
        raise RequestError(f"unknown profile {name!r} (known: {known})", "profile") from None


def _pick(mine: _T | None, theirs: _T | None, note: str) -> tuple[_T | None, str]:
    """The request's value if set, else the profile's; with the note to add to an error."""
    if mine is not None:
        return mine, ""
    if theirs is not None:
        return theirs, note
    return None, ""


def _ms(value: int) -> str:
    return f"{value} ms"


def _bytes(value: int) -> str:
    return f"{value} bytes"


#: The policy's numbers: (name in messages, attribute of request, profile, ceiling and
#: policy, default when none sets it, how a value reads in a refusal).
_SCALARS: tuple[tuple[str, str, int | None, Callable[[int], str]], ...] = (
    ("timeout", "timeout_ms", DEFAULT_TIMEOUT_MS, _ms),
    ("memory", "memory_bytes", DEFAULT_MEMORY_BYTES, _bytes),
    ("max_output", "max_output", DEFAULT_MAX_OUTPUT, _bytes),
    ("max_file_size", "max_file_size", DEFAULT_MAX_FILE_SIZE, _bytes),
)


def scalar_defaults() -> dict[str, str]:
    """What a job gets for each limit that no request, profile or ceiling sets, as text (wire name -> value)."""
    return {name: "none" if default is None else show(default) for name, _, default, show in _SCALARS}


@overload
def _limited(
    field: str,
    picked: tuple[int | None, str],
    ceiling: int | None,
    default: int,
    show: Callable[[int], str],
) -> int: ...
@overload
def _limited(
    field: str,
    picked: tuple[int | None, str],
    ceiling: int | None,
    default: None,
    show: Callable[[int], str],
) -> int | None: ...
def _limited(
    field: str,
    picked: tuple[int | None, str],
    ceiling: int | None,
    default: int | None,
    show: Callable[[int], str],
) -> int | None:
    """The value if set (and within the ceiling), else the smaller of default and ceiling."""
    value, note = picked
    if value is not None:
        return _within(field, value, ceiling, show, note)
    if default is None:
        return ceiling
    if ceiling is None:
        return default
    return min(default, ceiling)


def _within(
    field: str, value: int, ceiling: int | None, show: Callable[[int], str], note: str = ""
) -> int:
    if ceiling is not None and value > ceiling:
        raise RequestError(
            f"{show(value)} exceeds the pool's [pool.limits] {field} of {show(ceiling)}{note}",
            field,
        )
    return value
