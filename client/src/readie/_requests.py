"""Request values for ``readie pool``, without I/O: Python arguments in, the protocol's typed request out.

Each request is the value :mod:`readie_protocol` defines (a
:class:`~readie_protocol.requests.JobRequest`, a
:class:`~readie_protocol.requests.CancelJob`, ...), which the pool parses
its line back into; :class:`~readie_protocol.connection.PoolConnection`
writes its line. Only what the caller set goes on the wire, so the pool's
defaults and a named profile apply to everything else (an explicit
``"allow_network": false`` would override a profile that grants it), and
the id is the line's first key: the pool recovers the id of a line it
cannot parse from its first key only.

Two checks, one definition each. This module converts Python conveniences
(paths, ``timedelta``, float seconds) and raises TypeError for a Python
mistake (a string where a list belongs, a bool for a size). What a value may
be (a duration's units and range, a size, both or neither of code and
script) is :func:`readie_protocol.requests.build_job`'s, the pool parser's
own checks, so a request the pool would refuse for its shape raises
:class:`~readie.RequestError` here, naming the field. Whether the pool
grants a request is the pool's decision.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Mapping
from datetime import timedelta
from typing import Any, TypeAlias

from readie_protocol import MAX_LINE_BYTES, RequestId
from readie_protocol.errors import RequestError
from readie_protocol.transfers import DownloadChunk, ListFiles, UploadChunk
from readie_protocol.workspace import check_files, encode_bytes
from readie_protocol.requests import (
    AttachSession,
    CancelJob,
    CloseSession,
    ForkSession,
    HibernateSession,
    JobRequest,
    StatsRequest,
    build_job,
)

__all__ = [
    "MAX_LINE_BYTES",
    "AnsweredRequest",
    "Duration",
    "Files",
    "PathArg",
    "RequestId",
    "Size",
    "cancel_request",
    "close_request",
    "job_request",
    "session_setup",
    "stats_request",
    "step_request",
]

PathArg: TypeAlias = str | os.PathLike[str]
#: int: seconds (as the pool reads a bare number); float and timedelta are
#: converted to whole milliseconds, rounded up; str is read as the pool reads it ("250ms", "5s").
Duration: TypeAlias = int | float | timedelta | str
#: int: bytes; str is read as the pool reads it ("512m", "64k").
Size: TypeAlias = int | str
#: Files a job or a step writes into its workspace before its code runs: workspace path to bytes.
Files: TypeAlias = Mapping[str, bytes | bytearray | memoryview]
#: A request the pool answers by its id (a host function's reply is answered by nothing).
AnsweredRequest: TypeAlias = (
    JobRequest | StatsRequest | CancelJob | CloseSession | HibernateSession | ForkSession
    | UploadChunk | DownloadChunk | ListFiles
)


def job_request(id: RequestId, code: str | None = None, **fields: Any) -> JobRequest:
    """One job request (``fields`` as :func:`_job_fields` takes them); raises :class:`RequestError`
    for what the pool would refuse as a line (both or neither of code and script, a timeout of no
    duration, ...)."""
    return build_job(id, _job_fields(code, **fields))


def _job_fields(
    code: str | None = None,
    *,
    script: PathArg | None = None,
    name: str | None = None,
    args: Iterable[str] = (),
    allow_read: Iterable[PathArg] = (),
    allow_write: Iterable[PathArg] = (),
    package_dirs: Iterable[PathArg] = (),
    env: Mapping[str, str] | None = None,
    allow_network: bool | Iterable[str] = False,
    timeout: Duration | None = None,
    memory: Size | None = None,
    max_output: Size | None = None,
    max_file_size: Size | None = None,
    profile: str | None = None,
    packages: Iterable[str] = (),
    functions: Iterable[str] = (),
    stream: bool = False,
    report_files: bool = False,
    files: Files | None = None,
    collect: Iterable[str] = (),
) -> dict[str, Any]:
    """The fields a job's line carries beside its id, as JSON values: only those the caller set."""
    request: dict[str, Any] = {}
    if code is not None:
        request["code"] = _text(code, "code")
    if script is not None:
        request["script"] = _path(script, "script")
    if name is not None:
        request["name"] = _text(name, "name")
    _put_list(request, "args", args, lambda item: _text(item, "args"))
    _put_list(request, "allow_read", allow_read, lambda item: _path(item, "allow_read"))
    _put_list(request, "allow_write", allow_write, lambda item: _path(item, "allow_write"))
    _put_list(request, "package_dirs", package_dirs, lambda item: _path(item, "package_dirs"))
    if env is not None:
        if not isinstance(env, Mapping):
            raise TypeError(f"env: expected a mapping of strings, got {type(env).__name__}")
        request["env"] = dict(env)
    if isinstance(allow_network, bool):
        if allow_network:
            request["allow_network"] = True
    elif not isinstance(allow_network, Iterable):
        raise TypeError(f"allow_network: expected True, False or a list of destinations, got {type(allow_network).__name__}")
    else:  # destinations (decision 35); an empty list is False: nothing sent
        _put_list(request, "allow_network", allow_network, lambda item: _text(item, "allow_network"))
    _put(request, "timeout", timeout, _duration)
    _put(request, "memory", memory, _size)
    _put(request, "max_output", max_output, _size)
    _put(request, "max_file_size", max_file_size, _size)
    if profile is not None:
        request["profile"] = _text(profile, "profile")
    _put_list(request, "packages", packages, lambda item: _text(item, "packages"))
    _put_list(request, "functions", functions, lambda item: _text(item, "functions"))
    if stream:
        request["stream"] = True
    if not isinstance(report_files, bool):
        raise TypeError(f"report_files: expected True or False, got {type(report_files).__name__}")
    if report_files:
        request["report_files"] = True
    if files:
        request["files"] = _files(files)
    _put_list(request, "collect", collect, lambda item: _text(item, "collect"))
    return request


def stats_request(id: RequestId) -> StatsRequest:
    return StatsRequest(id)


def session_setup(
    *,
    allow_read: Iterable[PathArg] = (),
    allow_write: Iterable[PathArg] = (),
    package_dirs: Iterable[PathArg] = (),
    env: Mapping[str, str] | None = None,
    allow_network: bool | Iterable[str] = False,
    timeout: Duration | None = None,
    memory: Size | None = None,
    max_output: Size | None = None,
    max_file_size: Size | None = None,
    profile: str | None = None,
    packages: Iterable[str] = (),
    functions: Iterable[str] = (),
) -> dict[str, Any]:
    """The fields a session's first request carries (its permissions, limits, environment and
    host function names) as JSON values, checked now as that request will be."""
    fields = _job_fields(
        allow_read=allow_read, allow_write=allow_write, package_dirs=package_dirs, env=env,
        allow_network=allow_network, timeout=timeout, memory=memory, max_output=max_output,
        max_file_size=max_file_size, profile=profile, packages=packages, functions=functions,
    )
    build_job(0, {"code": "", **fields})
    return fields


def step_request(
    id: RequestId,
    session: str,
    code: str,
    *,
    name: str | None = None,
    args: Iterable[str] = (),
    timeout: Duration | None = None,
    max_output: Size | None = None,
    setup: Mapping[str, Any] | None = None,
    stream: bool = False,
    report_files: bool = False,
    files: Files | None = None,
    collect: Iterable[str] = (),
) -> JobRequest:
    """One step of ``session``; the first carries ``setup`` (from :func:`session_setup`), later ones must not."""
    fields = _job_fields(
        code, name=name, args=args, stream=stream, report_files=report_files, files=files, collect=collect,
    )
    fields["session"] = _text(session, "session")
    fields.update(setup or {})
    # The step's own timeout and max_output go over the session's.
    _put(fields, "timeout", timeout, _duration)
    _put(fields, "max_output", max_output, _size)
    return build_job(id, fields)


def cancel_request(id: RequestId, target: RequestId) -> CancelJob:
    """Stop job ``target`` and free its sandbox (answered by a cancelled event)."""
    return CancelJob(id, target)


def close_request(id: RequestId, session: str) -> CloseSession:
    return CloseSession(id, _text(session, "session"))


def attach_request(id: RequestId, session: str, key: str) -> AttachSession:
    """Continue the stored session ``key`` as ``session`` (decision 32); the pool checks the key."""
    return AttachSession(id, _text(session, "name"), _text(key, "key"))


# --------------------------------------------------------------------------- conversions


def _put(request: dict[str, Any], key: str, value: Any, convert: Any) -> None:
    if value is not None:
        request[key] = convert(value, key)


def _put_list(request: dict[str, Any], key: str, values: Iterable[Any], convert: Any) -> None:
    # A lone string is iterable too: "data" would become ["d", "a", "t", "a"].
    if isinstance(values, str | bytes | os.PathLike):
        raise TypeError(f"{key}: expected a list, got a single {type(values).__name__}; write {key}=[{values!r}]")
    items = [convert(item) for item in values]
    if items:
        request[key] = items


def _text(value: Any, key: str) -> str:
    if not isinstance(value, str):
        raise TypeError(f"{key}: expected a str, got {type(value).__name__}")
    return value


def _path(value: Any, key: str) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, os.PathLike):
        path = os.fspath(value)
        if isinstance(path, str):
            return path
    raise TypeError(f"{key}: expected a str or a path, got {type(value).__name__}")


def _files(files: Any) -> dict[str, str]:
    """``files`` as the line carries them: each path (checked and normalised by the protocol, before
    anything is encoded) to its bytes in base64."""
    if not isinstance(files, Mapping):
        raise TypeError(f"files: expected a mapping of workspace paths to bytes, got {type(files).__name__}")
    pairs = []
    for path, data in files.items():
        if not isinstance(data, bytes | bytearray | memoryview):
            hint = "; encode text first (text.encode())" if isinstance(data, str) else ""
            raise TypeError(f"files[{path!r}]: expected bytes, got {type(data).__name__}{hint}")
        pairs.append((path, bytes(data)))
    try:
        checked = check_files(tuple(pairs))
    except ValueError as exc:  # the protocol's Invalid: what is wrong, without the field
        raise RequestError(str(exc), "files") from None
    return {path: encode_bytes(data) for path, data in checked}


def _duration(value: Any, key: str) -> int | str:
    if isinstance(value, bool):
        raise TypeError(f"{key}: expected seconds, a timedelta or a string like '5s', got a bool")
    if isinstance(value, int | str):
        return value
    if isinstance(value, timedelta):
        value = value.total_seconds()
    if isinstance(value, float):
        if not math.isfinite(value):
            raise TypeError(f"{key}: {value} is not a duration")
        # Rounded up (after rounding away float noise: 1.1 * 1000 is 1100.0000000000002):
        # a caller asking for 0.0001 s means "a very short time", not "none at all".
        return f"{max(0, math.ceil(round(value * 1000, 6)))}ms"
    raise TypeError(f"{key}: expected seconds, a timedelta or a string like '5s', got {type(value).__name__}")


def _size(value: Any, key: str) -> int | str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise TypeError(f"{key}: expected bytes (int) or a string like '512m', got {type(value).__name__}")
    return value
