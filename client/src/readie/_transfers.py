"""The pure half of a session's file transfers (decision 31): the requests, the checks of their
answers, and the local ends (a file read or written a chunk at a time), without waiting.

:class:`~readie.AsyncSession` and :class:`~readie.Session` (generated from it)
loop over these, one request and one answer per chunk, through whatever
connection their pool has (a local ``readie pool``, or one in front of a
router). Each request is checked by the protocol's own builder
(:func:`~readie_protocol.transfers.build_transfer`) before it is sent; each
answer is checked against the request it answers: a chunk of another file,
or not starting where it was asked, is the pool breaking the protocol
(:class:`~readie.PoolError`); a file whose size or modification time moved
between two chunks changed while it was read (:class:`~readie.FileChanged`),
and its two versions are never joined.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any, TypeAlias

from readie_protocol.transfers import (
    ChunkEvent,
    DownloadChunk,
    ListFiles,
    ListingEvent,
    UploadChunk,
    UploadedEvent,
    build_transfer,
)
from readie_protocol.workspace import MAX_TRANSFER_BYTES, UPLOAD_CHUNK_BYTES, FileChunk, FileEntry

from ._errors import FileChanged, PoolError
from ._requests import PathArg, RequestId

__all__ = [
    "FileList",
    "UploadData",
    "check_chunk",
    "check_listing",
    "check_uploaded",
    "download_request",
    "download_sink",
    "list_request",
    "upload_chunks",
    "upload_path",
]

#: What an upload takes: the file's bytes, or the path of a local file (read a chunk at a time).
UploadData: TypeAlias = bytes | bytearray | memoryview | str | os.PathLike[str]


class FileList(list[FileEntry]):
    """A directory's entries, sorted by name (:meth:`Session.files <readie.Session.files>`).

    A list of :class:`~readie.FileEntry`; ``truncated`` is True when the
    directory held more than the pool lists at once
    (:data:`~readie_protocol.workspace.MAX_LISTED_ENTRIES`), ``path`` the
    directory listed, normalised.
    """

    def __init__(self, entries: Iterable[FileEntry] = (), *, path: str = ".", truncated: bool = False) -> None:
        super().__init__(entries)
        self.path = path
        self.truncated = truncated


# --------------------------------------------------------------------------- requests


def upload_path(session: str, path: Any, size: int) -> str:
    """``path`` normalised, after the protocol's checks of an upload of ``size`` bytes into
    ``session`` (RequestError naming the field: a bad path, a file past
    :data:`~readie_protocol.workspace.MAX_TRANSFER_BYTES`), before a byte is read or sent."""
    probe = build_transfer(0, {"id": 0, "session": session, "upload": path, "size": size, "offset": 0, "data": ""})
    assert isinstance(probe, UploadChunk)
    return probe.path


def download_request(id: RequestId, session: str, path: Any, offset: int = 0) -> DownloadChunk:
    request = build_transfer(id, {"id": id, "session": session, "download": path, "offset": offset})
    assert isinstance(request, DownloadChunk)
    return request


def list_request(id: RequestId, session: str, path: Any) -> ListFiles:
    request = build_transfer(id, {"id": id, "session": session, "list": path})
    assert isinstance(request, ListFiles)
    return request


# --------------------------------------------------------------------------- answers


def check_uploaded(answer: UploadedEvent, request: UploadChunk) -> None:
    """The pool's word that ``request``'s chunk is written: the file now holds its end."""
    expected = (request.session, request.path, request.offset + len(request.data), request.size)
    if (answer.session, answer.path, answer.received, answer.size) != expected:
        _broken(f"answered an upload of bytes {request.offset} to {expected[2]} of {request.path!r} "
                f"({request.size} bytes) with {answer.received} of {answer.path!r} ({answer.size} bytes)")


def check_chunk(answer: ChunkEvent, request: DownloadChunk, first: FileChunk | None) -> FileChunk:
    """The chunk ``answer`` holds, read as the next one of the download ``first`` began (None: this
    is the first)."""
    chunk = answer.chunk
    if answer.session != request.session or chunk.path != request.path or chunk.offset != request.offset:
        _broken(f"answered a download of {request.path!r} from byte {request.offset} with bytes "
                f"{chunk.offset} to {chunk.end} of {chunk.path!r}")
    if first is None and chunk.size > MAX_TRANSFER_BYTES:
        _broken(f"sent a chunk of a {chunk.size}-byte file; a download moves at most {MAX_TRANSFER_BYTES}")
    if first is not None and (chunk.size, chunk.modified_ns) != (first.size, first.modified_ns):
        raise FileChanged(
            f"{request.path!r} changed while it was downloaded (it held {first.size} bytes modified at "
            f"{first.modified_ns} ns, then {chunk.size} bytes modified at {chunk.modified_ns} ns): "
            "download it again once nothing writes it"
        )
    if not chunk.last and not chunk.data:
        _broken(f"sent an empty chunk of {request.path!r} at byte {chunk.offset} of {chunk.size}")
    return chunk


def check_listing(answer: ListingEvent, request: ListFiles) -> FileList:
    listing = answer.listing
    if answer.session != request.session or listing.path != request.path:
        _broken(f"answered a listing of {request.path!r} with one of {listing.path!r}")
    return FileList(listing.entries, path=listing.path, truncated=listing.truncated)


def _broken(what: str) -> Any:
    raise PoolError(f"readie pool broke the protocol: it {what}")


# --------------------------------------------------------------------------- the local ends


class _Source:
    """What an upload sends: its size, known before the first byte, and its chunks."""

    def __init__(self, size: int, chunks: Iterator[bytes]) -> None:
        self.size = size
        self.chunks = chunks


@contextmanager
def upload_chunks(data: UploadData) -> Iterator[_Source]:
    """``data`` (bytes, or a local file's path) as an upload's size and chunks of at most
    :data:`~readie_protocol.workspace.UPLOAD_CHUNK_BYTES`; always one chunk at least (an empty
    file is created by its one empty chunk). A local file is never held whole: its size is
    read when it is opened, and one that grows or shrinks meanwhile raises :class:`FileChanged`."""
    if isinstance(data, bytes | bytearray | memoryview):
        view = memoryview(data).cast("B")
        yield _Source(len(view), _slices(view))
        return
    if not isinstance(data, str | os.PathLike):
        raise TypeError(f"data_or_local_path: expected bytes or a local file's path, got {type(data).__name__}")
    with open(data, "rb") as file:
        size = os.fstat(file.fileno()).st_size
        yield _Source(size, _read(file, size, os.fsdecode(data)))


def _slices(view: memoryview) -> Iterator[bytes]:
    for offset in range(0, max(len(view), 1), UPLOAD_CHUNK_BYTES):
        yield bytes(view[offset:offset + UPLOAD_CHUNK_BYTES])


def _read(file: IO[bytes], size: int, name: str) -> Iterator[bytes]:
    offset = 0
    while True:
        data = file.read(min(UPLOAD_CHUNK_BYTES, size - offset)) if offset < size else b""
        if offset < size and not data:
            raise FileChanged(f"{name!r} shrank while it was uploaded: it held {size} bytes, then ended at {offset}")
        offset += len(data)
        if offset == size and file.read(1):
            raise FileChanged(f"{name!r} grew while it was uploaded: it held {size} bytes, then more")
        yield data
        if offset == size:
            return


class _Bytes:
    def __init__(self) -> None:
        self._data = bytearray()

    def write(self, data: bytes) -> None:
        self._data += data

    def finish(self) -> bytes:
        return bytes(self._data)


class _LocalFile:
    """A download into a temporary file beside ``path``, renamed over it once whole: a download
    that fails leaves ``path`` as it was, and nothing beside it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        descriptor, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".part")
        self._temporary = Path(temporary)
        self._file = os.fdopen(descriptor, "wb")

    def write(self, data: bytes) -> None:
        self._file.write(data)

    def finish(self) -> Path:
        self._file.close()
        os.replace(self._temporary, self.path)
        return self.path

    def abandon(self) -> None:
        self._file.close()
        self._temporary.unlink(missing_ok=True)


@contextmanager
def download_sink(to: PathArg | None) -> Iterator[_Bytes | _LocalFile]:
    """Where a download's chunks go as they come: memory (``to`` None), else a local file."""
    if to is None:
        yield _Bytes()
        return
    if not isinstance(to, str | os.PathLike):
        raise TypeError(f"to: expected a local path or None, got {type(to).__name__}")
    sink = _LocalFile(Path(to))
    try:
        yield sink
    except BaseException:
        sink.abandon()
        raise
