"""A session's files moving one chunk at a time (decision 31): what the pool does with an upload,
download or list request once its turn in the session has come.

The session driver (``_session_driver``) queues each request in its session
as it queues a hibernation, holds one of the workers' slots for it (one
chunk's worth: the next chunk queues again, so other sessions' steps run in
between) and turns a refusal into a result. This calls the session's backend
and builds the event that answers.

The pool's ceiling is held here too, whatever the backend holds: an upload
whose ``size`` is past the session's ``transfer_bytes`` is refused before a
byte moves, and so is a download of a file that grew past it. What the
backend hands back is checked before it is written: a chunk longer than a
download answer holds, or not the one asked for, or a listing longer than a
listing holds would break every client's connection
(``readie_protocol.transfers``' parsers), so it is the backend's failure
(``PoolWorkerError``) instead, and the session's end.
"""

from __future__ import annotations

from readie_policy.jobs import CodeJob
from readie_protocol.errors import PoolWorkerError, RequestError
from readie_protocol.transfers import ChunkEvent, DownloadChunk, ListFiles, ListingEvent, UploadChunk, UploadedEvent
from readie_protocol.units import format_size
from readie_protocol.workspace import DOWNLOAD_CHUNK_BYTES, MAX_LISTED_ENTRIES, FileChunk

from ._backend import BackendSession

__all__ = ["Transfer", "TransferEvent", "move"]

Transfer = UploadChunk | DownloadChunk | ListFiles
TransferEvent = UploadedEvent | ChunkEvent | ListingEvent


async def move(session: BackendSession, request: Transfer, job: CodeJob) -> TransferEvent:
    """Do ``request`` in ``session`` (whose first job is ``job``): the event that answers it.

    A refusal is raised as the backend raised it (``RequestError``: the session goes on).
    """
    if isinstance(request, UploadChunk):
        _within(request.size, job.transfer_bytes, "size")
        received = await session.upload_chunk(request.path, request.offset, request.data, request.size)
        return UploadedEvent(request.id, request.session, request.path, received, request.size)
    if isinstance(request, DownloadChunk):
        chunk = await session.download_chunk(request.path, request.offset, DOWNLOAD_CHUNK_BYTES)
        _check_chunk(chunk, request)
        _within(chunk.size, job.transfer_bytes, "download")
        return ChunkEvent(request.id, request.session, chunk)
    listing = await session.list_files(request.path)
    if len(listing.entries) > MAX_LISTED_ENTRIES:
        raise PoolWorkerError(f"the session listed {len(listing.entries)} entries, more than {MAX_LISTED_ENTRIES}")
    return ListingEvent(request.id, request.session, listing)


def _within(size: int, most: int, field: str) -> None:
    if size > most:
        raise RequestError(
            f"a file of {size} bytes is larger than the pool's transfer_bytes of {format_size(most)}", field
        )


def _check_chunk(chunk: FileChunk, request: DownloadChunk) -> None:
    asked = (request.path, request.offset)
    if (chunk.path, chunk.offset) != asked or len(chunk.data) > DOWNLOAD_CHUNK_BYTES or chunk.end > chunk.size:
        raise PoolWorkerError(
            f"the session answered a download of {asked} with {len(chunk.data)} bytes of {chunk.path!r} "
            f"from {chunk.offset}, of a {chunk.size}-byte file: not a chunk it may send"
        )
