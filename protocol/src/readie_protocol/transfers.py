"""A session's files moving one chunk at a time over the pool protocol (decision 31): the three
requests (``upload``, ``download``, ``list``) and the events that answer them, for both ends.

Each request names an open session and one workspace path; each is answered
by one event, or refused by a result with an error (as a close is). An
upload or a download is a run of these, one chunk each, so no line holds
more than a chunk: the client loops (``readie.Session.upload``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ._fields import Fields, broken, short
from ._values import Invalid, bounded_text, schema_of
from .errors import RequestError
from .wire import MAX_SESSION_CHARS, RequestId
from .workspace import (
    DOWNLOAD_CHUNK_BYTES,
    FILE_KINDS,
    MAX_LISTED_ENTRIES,
    MAX_TRANSFER_BYTES,
    UPLOAD_CHUNK_BYTES,
    FileChunk,
    FileEntry,
    FileListing,
    decode_bytes,
    encode_bytes,
    workspace_dir,
    workspace_path,
)

__all__ = [
    "DOWNLOAD_FIELDS",
    "LIST_FIELDS",
    "TRANSFER_KINDS",
    "UPLOAD_FIELDS",
    "ChunkEvent",
    "DownloadChunk",
    "ListFiles",
    "ListingEvent",
    "UploadChunk",
    "UploadedEvent",
    "build_transfer",
    "parse_chunk",
    "parse_listing",
    "parse_uploaded",
]

_session = bounded_text(MAX_SESSION_CHARS)


# --------------------------------------------------------------------------- requests


@dataclass(frozen=True, slots=True)
class UploadChunk:
    """Write ``data`` at ``offset`` of the ``size``-byte file ``path`` in ``session``'s workspace."""

    id: RequestId
    session: str
    path: str
    offset: int
    size: int
    data: bytes

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "session": self.session, "upload": self.path, "size": self.size,
                "offset": self.offset, "data": encode_bytes(self.data)}


@dataclass(frozen=True, slots=True)
class DownloadChunk:
    """Read at most :data:`~readie_protocol.workspace.DOWNLOAD_CHUNK_BYTES` of ``path`` from ``offset``."""

    id: RequestId
    session: str
    path: str
    offset: int = 0

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "session": self.session, "download": self.path, "offset": self.offset}


@dataclass(frozen=True, slots=True)
class ListFiles:
    """List directory ``path`` (``"."``: the workspace) of ``session``'s workspace."""

    id: RequestId
    session: str
    path: str = "."

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "session": self.session, "list": self.path}


#: The keys that make a line a transfer request, and each kind's keys.
TRANSFER_KINDS = ("upload", "download", "list")
_KEYS = {
    "upload": frozenset({"id", "session", "upload", "size", "offset", "data"}),
    "download": frozenset({"id", "session", "download", "offset"}),
    "list": frozenset({"id", "session", "list"}),
}


def build_transfer(rid: RequestId, obj: Mapping[str, Any]) -> UploadChunk | DownloadChunk | ListFiles:
    """The transfer request ``obj`` is (it holds ``upload``, ``download`` or ``list``), checked;
    :class:`RequestError` names the field. The request parser and a client both build here."""
    kind = next(key for key in TRANSFER_KINDS if key in obj)
    for key in obj:
        if key not in _KEYS[kind]:
            raise RequestError(f"not allowed in a{'n' if kind == 'upload' else ''} {kind} request", key)
    if "session" not in obj:
        raise RequestError(f"required: the session whose workspace to {kind} in", "session")
    session = _checked(obj, "session", _session)
    if kind == "list":
        return ListFiles(rid, session, _checked(obj, "list", workspace_dir))
    path = _checked(obj, kind, workspace_path)
    if kind == "download":
        return DownloadChunk(rid, session, path, _count(obj, "offset", MAX_TRANSFER_BYTES, default=0))
    for key in ("size", "offset", "data"):
        if key not in obj:
            raise RequestError("required in an upload", key)
    size = _count(obj, "size", MAX_TRANSFER_BYTES)
    offset = _count(obj, "offset", size)
    if not isinstance(obj["data"], str) or len(obj["data"]) > _encoded_length(UPLOAD_CHUNK_BYTES):
        raise RequestError(f"must be base64 of at most {UPLOAD_CHUNK_BYTES} bytes", "data")
    data = _checked(obj, "data", decode_bytes)
    if len(data) > UPLOAD_CHUNK_BYTES:  # base64's padding lets a byte or two past the text's bound
        raise RequestError(f"must be base64 of at most {UPLOAD_CHUNK_BYTES} bytes", "data")
    if offset + len(data) > size:
        raise RequestError(f"runs past the upload's size of {size} bytes", "data")
    return UploadChunk(rid, session, path, offset, size, data)


def _checked(obj: Mapping[str, Any], key: str, check: Any) -> Any:
    try:
        return check(obj[key])
    except Invalid as exc:
        raise RequestError(str(exc), key) from None


def _count(obj: Mapping[str, Any], key: str, most: int, *, default: int | None = None) -> int:
    value = obj.get(key, default)
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestError(f"expected a whole number of bytes, got {short(value)}", key)
    if not 0 <= value <= most:
        raise RequestError(f"must be between 0 and {most}", key)
    return value


def _encoded_length(size: int) -> int:
    return (size + 2) // 3 * 4


# --------------------------------------------------------------------------- events


@dataclass(frozen=True, slots=True)
class UploadedEvent:
    """The answer to an upload chunk: the file in ``session``'s workspace holds ``received`` bytes of
    its ``size``."""

    id: RequestId
    session: str
    path: str
    received: int
    size: int

    def to_json(self) -> dict[str, Any]:
        return {"id": self.id, "event": "uploaded", "session": self.session, "path": self.path,
                "received": self.received, "size": self.size}


@dataclass(frozen=True, slots=True)
class ChunkEvent:
    """The answer to a download request: one chunk of the file."""

    id: RequestId
    session: str
    chunk: FileChunk

    def to_json(self) -> dict[str, Any]:
        chunk = self.chunk
        return {"id": self.id, "event": "file_chunk", "session": self.session, "path": chunk.path,
                "offset": chunk.offset, "size": chunk.size, "modified_ns": chunk.modified_ns,
                "data": encode_bytes(chunk.data)}


@dataclass(frozen=True, slots=True)
class ListingEvent:
    """The answer to a list request."""

    id: RequestId
    session: str
    listing: FileListing

    def to_json(self) -> dict[str, Any]:
        listing = self.listing
        return {"id": self.id, "event": "listing", "session": self.session, "path": listing.path,
                "entries": [entry.to_json() for entry in listing.entries], "truncated": listing.truncated}


def parse_uploaded(obj: Any) -> UploadedEvent:
    fields = _event(obj, "uploaded")
    return UploadedEvent(
        id=fields.get("id", (str, int)), session=fields.get("session", str), path=fields.get("path", str),
        received=fields.get("received", int), size=fields.get("size", int),
    )


def parse_chunk(obj: Any) -> ChunkEvent:
    """A ``file_chunk`` event; more than a chunk's bytes is the pool breaking the protocol."""
    fields = _event(obj, "file_chunk")
    try:
        data = decode_bytes(fields.get("data", str))
    except Invalid as exc:
        broken(f"a file_chunk's data {exc}")
    if len(data) > DOWNLOAD_CHUNK_BYTES:
        broken(f"a file_chunk holds {len(data)} bytes, more than a chunk's {DOWNLOAD_CHUNK_BYTES}")
    chunk = FileChunk(
        path=fields.get("path", str), offset=fields.get("offset", int), size=fields.get("size", int),
        modified_ns=fields.get("modified_ns", int), data=data,
    )
    if chunk.offset < 0 or chunk.end > chunk.size:
        broken(f"a file_chunk of bytes {chunk.offset} to {chunk.end} of a {chunk.size}-byte file")
    return ChunkEvent(id=fields.get("id", (str, int)), session=fields.get("session", str), chunk=chunk)


def parse_listing(obj: Any) -> ListingEvent:
    fields = _event(obj, "listing")
    entries = fields.get("entries", list)
    if len(entries) > MAX_LISTED_ENTRIES:
        broken(f"a listing of {len(entries)} entries, more than {MAX_LISTED_ENTRIES}")
    parsed = []
    for entry in entries:
        item = Fields(entry, "a listing's entry")
        kind = item.get("kind", str)
        if kind not in FILE_KINDS:
            broken(f"a listing's entry of an unknown kind: {short(kind)}")
        parsed.append(FileEntry(name=item.get("name", str), size=item.get("size", int), kind=kind))
    listing = FileListing(path=fields.get("path", str), entries=tuple(parsed), truncated=fields.get("truncated", bool))
    return ListingEvent(id=fields.get("id", (str, int)), session=fields.get("session", str), listing=listing)


def _event(obj: Any, name: str) -> Fields:
    fields = Fields(obj, f"a{'n' if name[0] in 'aeiou' else ''} {name} event")
    if fields.get("event", str) != name:
        broken(f"expected a{'n' if name[0] in 'aeiou' else ''} {name} event, got {short(obj)}")
    return fields


#: The fields of each transfer request beside its id, as JSON Schema (``readie_protocol.schema``).
UPLOAD_FIELDS = {
    "session": {**schema_of(_session), "description": "The open session whose workspace receives the file."},
    "upload": {**schema_of(workspace_path), "description": "The file's path in the workspace."},
    "size": {"type": "integer", "minimum": 0, "maximum": MAX_TRANSFER_BYTES,
             "description": "The whole file's size, the same in every chunk; checked before the first byte."},
    "offset": {"type": "integer", "minimum": 0,
               "description": "Where this chunk goes: 0 creates the file, each next chunk starts where the last ended."},
    "data": {"type": "string", "contentEncoding": "base64",
             "description": f"This chunk's bytes, at most {UPLOAD_CHUNK_BYTES}."},
}
DOWNLOAD_FIELDS = {
    "session": {**schema_of(_session), "description": "The open session whose workspace holds the file."},
    "download": {**schema_of(workspace_path), "description": "The file's path in the workspace."},
    "offset": {"type": "integer", "minimum": 0,
               "description": f"Where to read from; the answer holds at most {DOWNLOAD_CHUNK_BYTES} bytes."},
}
LIST_FIELDS = {
    "session": {**schema_of(_session), "description": "The open session whose workspace to list."},
    "list": {**schema_of(workspace_dir), "description": "The directory to list; \".\" is the workspace."},
}
