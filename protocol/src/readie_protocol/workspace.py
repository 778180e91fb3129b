"""Files in a job's workspace: the paths a request names, the limits on what moves, and the values
every layer passes for them (decision 31).

The workspace is the job's working directory inside the sandbox (``/tmp``
unless a gRPC caller set ``cwd``): nothing of the host. A request names files
in it by relative paths, checked here once for both wires (the JSONL parser
and ``readie_rpc``'s): relative, normalised, UTF-8, bounded, no ``..``, no NUL,
no duplicates after normalising. What a sandbox sends back about its files
(names, sizes, bytes, counts) is hostile; the worker checks it against these
same limits before anyone reads it (``readie_worker._workspace``).

Every limit here is the most any request may have; the operator's ceiling
(``[pool.limits]``: ``collect_bytes``, ``collect_files``, ``transfer_bytes``)
can lower the last three.
"""

from __future__ import annotations

import base64
import binascii
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from ._fields import short
from ._values import Invalid, with_schema
from .lines import MAX_LINE_BYTES
from .wire import json_type

__all__ = [
    "DOWNLOAD_CHUNK_BYTES",
    "LEFT_OUT_REASONS",
    "MAX_COLLECTED_BYTES",
    "MAX_COLLECTED_FILES",
    "MAX_COLLECT_PATTERNS",
    "MAX_LEFT_OUT",
    "MAX_LISTED_ENTRIES",
    "MAX_REQUEST_FILES",
    "MAX_REQUEST_FILES_BYTES",
    "MAX_TRANSFER_BYTES",
    "MAX_WORKSPACE_NAME_BYTES",
    "MAX_WORKSPACE_PATH_BYTES",
    "UPLOAD_CHUNK_BYTES",
    "Collected",
    "FileChunk",
    "FileEntry",
    "FileKind",
    "LeftOut",
    "LeftOutReason",
    "FileListing",
    "check_collect",
    "check_files",
    "collect_pattern",
    "collect_value",
    "decode_bytes",
    "encode_bytes",
    "files_value",
    "is_pattern",
    "workspace_dir",
    "workspace_path",
]

#: A path in the workspace, in UTF-8 bytes: far more than any real name, and
#: short enough that the sandbox's cwd plus it stays inside PATH_MAX (4096).
MAX_WORKSPACE_PATH_BYTES = 1024
#: Linux's NAME_MAX: no longer component can be created.
MAX_WORKSPACE_NAME_BYTES = 255
#: Files one request may carry (``files``): each is a create in the sandbox and
#: an entry of its spec; a model's tool call names a few.
MAX_REQUEST_FILES = 64
#: Bytes of ``files`` one request may carry, all files together: what one pool
#: request line (at most MAX_LINE_BYTES, the spec's 1 MiB) can hold as base64,
#: held on the gRPC wire too so that a job is expressible on both. Larger
#: files go into a session with an upload (``upload``).
MAX_REQUEST_FILES_BYTES = MAX_LINE_BYTES * 3 // 4
#: Patterns one request may ``collect``: each is a walk of the workspace.
MAX_COLLECT_PATTERNS = 16
#: Files one result may bring back (``collect``), and the most a ceiling's
#: ``collect_files`` may allow: a chart, a table and a report, many times over.
MAX_COLLECTED_FILES = 64
#: Bytes one result may bring back, all files together, and the most a
#: ceiling's ``collect_bytes`` may allow: a result is one line and one gRPC
#: message, held whole by the pool, the router and the client (as base64 in a
#: line: 4/3 of it). Larger files come back with a session's ``download``.
MAX_COLLECTED_BYTES = 32 * 1024 * 1024
#: The largest file one upload or download moves, and the most a ceiling's
#: ``transfer_bytes`` may allow: the issue's 256 MiB. It moves in chunks, so
#: no line or message holds more than a chunk of it.
MAX_TRANSFER_BYTES = 256 * 1024 * 1024
#: Bytes of file in one upload request: as base64 (4/3) with the request's
#: other fields, under the 1 MiB line limit.
UPLOAD_CHUNK_BYTES = 512 * 1024
#: Bytes of file in one download answer: an answer is read whole by the
#: client (the pool's lines out are not bound to 1 MiB, its lines in are).
DOWNLOAD_CHUNK_BYTES = 1024 * 1024
#: Entries one listing holds (``list``); ``truncated`` says when there were more.
MAX_LISTED_ENTRIES = 1000
#: Entries of ``left_out`` one result holds: past it, the count says the rest.
MAX_LEFT_OUT = 64

FileKind = Literal["file", "dir", "link", "other"]
FILE_KINDS: tuple[FileKind, ...] = ("file", "dir", "link", "other")
#: Why a file that matched a ``collect`` pattern is not in ``collected``:
#: ``size`` it would pass the result's bytes; ``count`` the result's files;
#: ``link`` it is a symbolic link (never followed); ``not_file`` a directory,
#: device or socket; ``changed`` it grew, shrank or was replaced while it was
#: read; ``unreadable`` it could not be opened or read.
LeftOutReason = Literal["size", "count", "link", "not_file", "changed", "unreadable"]
LEFT_OUT_REASONS: tuple[LeftOutReason, ...] = ("size", "count", "link", "not_file", "changed", "unreadable")

_GLOB_CHARACTERS = frozenset("*?[")


# --------------------------------------------------------------------------- values


@dataclass(frozen=True, slots=True)
class LeftOut:
    """A file a ``collect`` pattern matched that its result does not carry, and why."""

    path: str
    reason: LeftOutReason
    size: int | None = None  # when known

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "reason": self.reason, "size": self.size}


@dataclass(frozen=True, slots=True)
class Collected:
    """What a job's ``collect`` brought back: each file's bytes by its workspace path, in the order
    found, and what matched but was left out (at most :data:`MAX_LEFT_OUT`; ``left_out_more``
    counts the rest)."""

    files: Mapping[str, bytes] = field(default_factory=dict)
    left_out: tuple[LeftOut, ...] = ()
    left_out_more: int = 0


@dataclass(frozen=True, slots=True)
class FileEntry:
    """One entry of a listing: its name in the directory listed, its size, and what it is."""

    name: str
    size: int
    kind: FileKind

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "size": self.size, "kind": self.kind}


@dataclass(frozen=True, slots=True)
class FileListing:
    """A directory of the workspace: at most :data:`MAX_LISTED_ENTRIES` entries, sorted by name."""

    path: str
    entries: tuple[FileEntry, ...]
    truncated: bool = False


@dataclass(frozen=True, slots=True)
class FileChunk:
    """Bytes ``offset`` to ``offset + len(data)`` of a workspace file that holds ``size`` bytes.

    ``size`` and ``modified_ns`` are the file's when this chunk was read: a
    download that sees either change between chunks reports the file
    changed instead of joining two versions of it.
    """

    path: str
    offset: int
    size: int
    modified_ns: int
    data: bytes

    @property
    def end(self) -> int:
        return self.offset + len(self.data)

    @property
    def last(self) -> bool:
        return self.end >= self.size


# --------------------------------------------------------------------------- paths


def workspace_path(value: Any) -> str:
    """``value`` as a normalised relative path in the workspace; :class:`Invalid` says why not."""
    return _normalised(value, glob=False, here=False)


def workspace_dir(value: Any) -> str:
    """Like :func:`workspace_path`, but ``"."`` (the workspace itself) is allowed too."""
    return _normalised(value, glob=False, here=True)


def collect_pattern(value: Any) -> str:
    """A ``collect`` entry: a workspace path whose components may hold ``*``, ``?`` and ``[...]``,
    or be ``**`` (any number of directories, none included)."""
    return _normalised(value, glob=True, here=False)


with_schema(workspace_path, {"type": "string", "minLength": 1, "maxLength": MAX_WORKSPACE_PATH_BYTES})
with_schema(workspace_dir, {"type": "string", "minLength": 1, "maxLength": MAX_WORKSPACE_PATH_BYTES})
with_schema(collect_pattern, {"type": "string", "minLength": 1, "maxLength": MAX_WORKSPACE_PATH_BYTES})


def _normalised(value: Any, *, glob: bool, here: bool) -> str:
    # ``glob`` changes nothing of the checks (a name may hold '*' on Linux); it is kept so that a
    # pattern's rules can part from a path's without touching the callers.
    if not isinstance(value, str):
        raise Invalid(f"expected a path as a string, got {json_type(value)}")
    try:
        encoded = value.encode("utf-8")
    except UnicodeEncodeError:
        raise Invalid("is not UTF-8 (it holds a lone surrogate)") from None
    if not value:
        raise Invalid("must not be empty")
    if len(encoded) > MAX_WORKSPACE_PATH_BYTES:
        raise Invalid(f"is longer than {MAX_WORKSPACE_PATH_BYTES} bytes")
    if "\x00" in value:
        raise Invalid("contains a NUL character")
    if value.startswith("/"):
        raise Invalid("must be relative to the workspace, not absolute")
    parts = [part for part in value.split("/") if part not in ("", ".")]
    for part in parts:
        if part == "..":
            raise Invalid("must not contain '..': a path stays inside the workspace")
        if len(part.encode("utf-8")) > MAX_WORKSPACE_NAME_BYTES:
            raise Invalid(f"has a name longer than {MAX_WORKSPACE_NAME_BYTES} bytes")
    if not parts:
        if here:
            return "."
        raise Invalid("names the workspace itself, not a file in it")
    return "/".join(parts)


def is_pattern(path: str) -> bool:
    """Whether a checked ``collect`` entry is a glob (else it names one file)."""
    return any(c in _GLOB_CHARACTERS for c in path) or "**" in path.split("/")


# --------------------------------------------------------------------------- request values


def check_files(files: Mapping[str, bytes] | tuple[tuple[str, bytes], ...]) -> tuple[tuple[str, bytes], ...]:
    """A request's ``files`` (path to bytes) checked: at most :data:`MAX_REQUEST_FILES` of them,
    :data:`MAX_REQUEST_FILES_BYTES` together, each path a :func:`workspace_path`, none twice once
    normalised. :class:`Invalid` says what is wrong. For both wires."""
    pairs = tuple(files.items()) if isinstance(files, Mapping) else tuple(files)
    if len(pairs) > MAX_REQUEST_FILES:
        raise Invalid(f"holds {len(pairs)} files; at most {MAX_REQUEST_FILES} may be sent with a request")
    seen: set[str] = set()
    total = 0
    checked = []
    for raw_path, data in pairs:
        try:
            path = workspace_path(raw_path)
        except Invalid as exc:
            raise Invalid(f"{_shown(raw_path)}: {exc}") from None
        if path in seen:
            raise Invalid(f"{_shown(raw_path)}: names {path!r}, which another entry names too")
        if not isinstance(data, bytes):
            raise Invalid(f"{_shown(raw_path)}: expected bytes, got {type(data).__name__}")
        seen.add(path)
        total += len(data)
        if total > MAX_REQUEST_FILES_BYTES:
            raise Invalid(
                f"holds more than {MAX_REQUEST_FILES_BYTES} bytes of files; send larger files into a "
                f"session with an upload"
            )
        checked.append((path, data))
    return tuple(checked)


def check_collect(patterns: tuple[str, ...] | list[str]) -> tuple[str, ...]:
    """A request's ``collect`` checked: at most :data:`MAX_COLLECT_PATTERNS` entries, each a
    :func:`collect_pattern`, none twice once normalised. For both wires."""
    if len(patterns) > MAX_COLLECT_PATTERNS:
        raise Invalid(f"holds {len(patterns)} patterns; at most {MAX_COLLECT_PATTERNS} may be given")
    checked: list[str] = []
    for raw in patterns:
        try:
            pattern = collect_pattern(raw)
        except Invalid as exc:
            raise Invalid(f"{_shown(raw)}: {exc}") from None
        if pattern in checked:
            raise Invalid(f"{_shown(raw)}: names {pattern!r}, which another entry names too")
        checked.append(pattern)
    return tuple(checked)


def files_value(value: Any) -> tuple[tuple[str, bytes], ...]:
    """The JSONL ``files`` field: an object mapping workspace paths to base64 (RFC 4648, padded)."""
    if not isinstance(value, dict):
        raise Invalid(f"expected an object of paths to base64, got {json_type(value)}")
    if len(value) > MAX_REQUEST_FILES:  # before decoding a byte
        raise Invalid(f"holds {len(value)} files; at most {MAX_REQUEST_FILES} may be sent with a request")
    decoded = []
    for path, text in value.items():
        try:
            decoded.append((path, decode_bytes(text)))
        except Invalid as exc:
            raise Invalid(f"{_shown(path)}: {exc}") from None
    return check_files(tuple(decoded))


def collect_value(value: Any) -> tuple[str, ...]:
    """The JSONL ``collect`` field: an array of workspace paths or glob patterns."""
    if not isinstance(value, list):
        raise Invalid(f"expected an array of paths or patterns, got {json_type(value)}")
    return check_collect(value)


with_schema(files_value, {
    "type": "object",
    "maxProperties": MAX_REQUEST_FILES,
    "additionalProperties": {"type": "string", "contentEncoding": "base64"},
})
with_schema(collect_value, {
    "type": "array",
    "maxItems": MAX_COLLECT_PATTERNS,
    "items": {"type": "string", "minLength": 1, "maxLength": MAX_WORKSPACE_PATH_BYTES},
})


def decode_bytes(value: Any) -> bytes:
    """Base64 text (RFC 4648, padded, no line breaks) as bytes; :class:`Invalid` otherwise."""
    if not isinstance(value, str):
        raise Invalid(f"expected base64 text, got {json_type(value)}")
    try:
        return base64.b64decode(value.encode("ascii"), validate=True)
    except (UnicodeEncodeError, binascii.Error):
        raise Invalid("is not valid base64") from None


def encode_bytes(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii")


def _shown(path: Any) -> str:
    return short(path, 77)
