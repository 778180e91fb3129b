"""The job dict the worker sends, checked and turned into frozen values.

The dict is trusted (the worker built it), but a wrong type here would
otherwise surface as a confusing failure half-way through the job, after
limits were already applied; checking first makes it a RequestError before
anything runs.
"""

from __future__ import annotations

import ipaddress
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .. import hostwire
from ._bounds import MAX_OUTPUT_LIMIT

# Name of an inline job that does not set one, as ``python -c`` reports it.
DEFAULT_INLINE_NAME = "<string>"
# Where a job that names no working directory runs: where this process started (a sandbox's
# "/"). Read once: a job's cwd is not put back after it (decision 33), so the process's own
# cwd says nothing by the next job.
STARTED_IN = os.getcwd()
_KNOWN_FIELDS = frozenset(
    {"code", "script_path", "name", "args", "env", "cwd", "links", "limits", "session", "functions",
     "stream", "files", "nameserver", "phases"}
)
_LIMIT_FIELDS = frozenset({"memory_bytes", "max_file_size", "max_output", "subprocesses", "timeout_ms"})
_LINK_FIELDS = frozenset({"path", "target", "writable"})


class JobSpecError(Exception):
    """The job dict does not describe a runnable job."""


@dataclass(frozen=True, slots=True)
class Link:
    """A host path the job sees, as a symlink to the grant mounted at ``target``."""

    path: str
    target: str
    writable: bool


@dataclass(frozen=True, slots=True)
class ProcessLimits:
    """The limits the job's own process puts on itself in the sandbox (rlimits, output cut,
    subprocesses, deadline), as the worker's spec dict asks; ``readie_policy`` chose them."""

    memory_bytes: int | None
    max_file_size: int | None
    max_output: int
    subprocesses: bool
    # Where the job's code is stopped from inside (a TimeoutError with its
    # output so far); the worker kills the sandbox a little later regardless.
    timeout_ms: int | None = None


@dataclass(frozen=True, slots=True)
class JobSpec:
    code: str | None
    script_path: str | None
    name: str
    args: tuple[str, ...]
    env: Mapping[str, str]
    cwd: str | None
    links: tuple[Link, ...]
    limits: ProcessLimits
    session: bool
    # Host functions readie_host offers (decision 8); empty: none.
    functions: tuple[str, ...] = ()
    # Send output frames while the job runs (decision 16).
    stream: bool = False
    # Written into the workspace (the working directory) before the code runs (decision 31):
    # workspace paths the worker checked, and their bytes.
    files: tuple[tuple[str, bytes], ...] = ()
    # A networked sandbox's resolver (readie's, on its gateway: decision 36), named in
    # /etc/resolv.conf before the code runs; None: no network, nothing written.
    nameserver: str | None = None
    # Time the runner's phases and send them with the result (``._phases``: the bench's breakdown).
    phases: bool = False

    @property
    def workspace(self) -> str:
        """The job's working directory: its own, else the one the process started in."""
        return self.cwd or STARTED_IN

    @property
    def writable_links(self) -> tuple[Link, ...]:
        return tuple(link for link in self.links if link.writable)


def parse_job(job: object) -> JobSpec:
    if not isinstance(job, dict):
        raise JobSpecError(f"job must be a dict, got {type(job).__name__}")
    _refuse_unknown(job, _KNOWN_FIELDS, "job")
    code = _optional_str(job, "code")
    script_path = _absolute_path(job, "script_path")
    if (code is None) == (script_path is None):
        raise JobSpecError("job needs exactly one of code and script_path")
    default_name = script_path if script_path is not None else DEFAULT_INLINE_NAME
    name = _optional_str(job, "name") or default_name
    return JobSpec(
        code=code,
        script_path=script_path,
        name=name,
        args=_str_list(job.get("args", []), "args"),
        env=_env(job.get("env", {})),
        cwd=_absolute_path(job, "cwd"),
        links=tuple(
            _link(entry, index) for index, entry in enumerate(_list(job.get("links", []), "links"))
        ),
        limits=_limits(job.get("limits")),
        session=_bool(job.get("session", False), "session"),
        functions=_functions(job.get("functions", [])),
        stream=_bool(job.get("stream", False), "stream"),
        files=_files(job.get("files", [])),
        nameserver=_nameserver(job.get("nameserver")),
        phases=_bool(job.get("phases", False), "phases"),
    )


def _absolute_path(job: dict[str, Any], key: str) -> str | None:
    """An absolute path or None: a relative one would be read against whatever cwd the last job
    left the process in (the runner does not put it back)."""
    path = _optional_str(job, key)
    if path is not None and (not os.path.isabs(path) or "\0" in path):
        raise JobSpecError(f"{key} must be an absolute path without NUL, got {path!r}")
    return path


def _nameserver(raw: object) -> str | None:
    if raw is None:
        return None
    try:
        return str(ipaddress.IPv4Address(raw if isinstance(raw, str) else ""))
    except ValueError:
        raise JobSpecError("nameserver must be an IPv4 address") from None


def _files(raw: object) -> tuple[tuple[str, bytes], ...]:
    files = []
    for entry in _list(raw, "files"):
        if not (isinstance(entry, (list, tuple)) and len(entry) == 2 and isinstance(entry[0], str) and isinstance(entry[1], bytes)):
            raise JobSpecError("files must be a list of [path, bytes] pairs")
        files.append((entry[0], entry[1]))
    return tuple(files)


def _functions(raw: object) -> tuple[str, ...]:
    names = _list(raw, "functions")
    if len(names) > hostwire.MAX_FUNCTIONS:
        raise JobSpecError(f"functions: at most {hostwire.MAX_FUNCTIONS} may be declared")
    for name in names:
        problem = hostwire.function_name_problem(name)
        if problem is not None:
            raise JobSpecError(f"functions: {problem}")
    if len(set(names)) != len(names):
        raise JobSpecError("functions: a name is declared twice")
    return tuple(names)


def _limits(raw: object) -> ProcessLimits:
    if not isinstance(raw, dict):
        raise JobSpecError(f"limits must be a dict, got {type(raw).__name__}")
    _refuse_unknown(raw, _LIMIT_FIELDS, "limits")
    max_output = raw.get("max_output")
    if not _is_int(max_output) or not 0 <= max_output <= MAX_OUTPUT_LIMIT:
        raise JobSpecError(f"limits.max_output must be an integer in 0..{MAX_OUTPUT_LIMIT}")
    return ProcessLimits(
        memory_bytes=_optional_positive_int(raw.get("memory_bytes"), "limits.memory_bytes"),
        max_file_size=_optional_positive_int(raw.get("max_file_size"), "limits.max_file_size"),
        max_output=max_output,
        subprocesses=_bool(raw.get("subprocesses", False), "limits.subprocesses"),
        timeout_ms=_optional_positive_int(raw.get("timeout_ms"), "limits.timeout_ms"),
    )


def _link(raw: object, index: int) -> Link:
    where = f"links[{index}]"
    if not isinstance(raw, dict):
        raise JobSpecError(f"{where} must be a dict, got {type(raw).__name__}")
    _refuse_unknown(raw, _LINK_FIELDS, where)
    path, target = raw.get("path"), raw.get("target")
    for field, value in (("path", path), ("target", target)):
        if not isinstance(value, str) or not os.path.isabs(value) or "\0" in value:
            raise JobSpecError(f"{where}.{field} must be an absolute path")
    return Link(
        path=os.path.normpath(path),
        target=os.path.normpath(target),
        writable=_bool(raw.get("writable", False), f"{where}.writable"),
    )


def _env(raw: object) -> dict[str, str]:
    if not isinstance(raw, dict):
        raise JobSpecError(f"env must be a dict, got {type(raw).__name__}")
    for key, value in raw.items():
        if not isinstance(key, str) or not key or "=" in key or "\0" in key or not _encodable(key):
            raise JobSpecError(f"env has an invalid variable name: {key!r}")
        if not isinstance(value, str) or "\0" in value or not _encodable(value):
            raise JobSpecError(f"env[{key!r}] must be a string without NUL")
    return dict(raw)


def _encodable(text: str) -> bool:
    """Can the process's environment hold it (os.fsencode: a lone surrogate cannot)?"""
    try:
        os.fsencode(text)
    except UnicodeEncodeError:
        return False
    return True


def _refuse_unknown(raw: dict[Any, Any], known: frozenset[str], where: str) -> None:
    # A field this runner does not know would be silently ignored; for a
    # policy field that means a limit the worker believes is applied is not.
    unknown = sorted(str(key) for key in raw if key not in known)
    if unknown:
        raise JobSpecError(f"{where} has unknown fields: {', '.join(unknown)}")


def _optional_str(raw: dict[str, Any], field: str) -> str | None:
    value = raw.get(field)
    if value is not None and not isinstance(value, str):
        raise JobSpecError(f"{field} must be a string, got {type(value).__name__}")
    return value


def _list(raw: object, field: str) -> list[Any]:
    if not isinstance(raw, list):
        raise JobSpecError(f"{field} must be a list, got {type(raw).__name__}")
    return raw


def _str_list(raw: object, field: str) -> tuple[str, ...]:
    items = _list(raw, field)
    if not all(isinstance(item, str) for item in items):
        raise JobSpecError(f"{field} must be a list of strings")
    return tuple(items)


def _bool(raw: object, field: str) -> bool:
    if not isinstance(raw, bool):
        raise JobSpecError(f"{field} must be true or false, got {type(raw).__name__}")
    return raw


def _optional_positive_int(raw: object, field: str) -> int | None:
    if raw is None:
        return None
    if not _is_int(raw) or raw <= 0:
        raise JobSpecError(f"{field} must be a positive integer or null")
    return raw


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
