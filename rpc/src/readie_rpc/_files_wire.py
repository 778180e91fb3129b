"""Files in a job's workspace as proto messages, and back: validation without I/O (decision 31).

Both ends use these. A request's ``files`` and ``collect``, and a session's
``upload``, ``download`` and ``list_files``, are checked on the serving side
by :mod:`readie_protocol.workspace`'s own rules (the JSONL parser's too),
each refusal a :class:`~readie_protocol.errors.RequestError` naming its
field. What a worker answers (the files a job collected, a chunk, a listing)
is a network peer's, checked on the calling side against the same limits and
against what was asked before anyone reads it: a
:class:`~readie_protocol.errors.PoolWorkerError` says what was out of bounds.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, NoReturn

from ._proto.readie.v1 import worker_pb2 as pb
from ._session_wire import refusal, refusal_fields
from readie_protocol.cancel import Cancellation
from readie_protocol.errors import PoolWorkerError, ReadieError, RequestError, SandboxSetupError
from readie_protocol.workspace import (
    DOWNLOAD_CHUNK_BYTES,
    FILE_KINDS,
    LEFT_OUT_REASONS,
    MAX_COLLECTED_BYTES,
    MAX_COLLECTED_FILES,
    MAX_LEFT_OUT,
    MAX_LISTED_ENTRIES,
    MAX_TRANSFER_BYTES,
    MAX_WORKSPACE_NAME_BYTES,
    UPLOAD_CHUNK_BYTES,
    Collected,
    FileChunk,
    FileEntry,
    FileListing,
    LeftOut,
    check_collect,
    check_files,
    workspace_dir,
    workspace_path,
)
from readie_policy.runner import SessionHandle

__all__ = [
    "FILE_EVENTS",
    "answer_file_request",
    "chunk_from_answer",
    "collect_patterns",
    "collected_from_message",
    "collected_message",
    "download_message",
    "file_messages",
    "file_refusal",
    "list_message",
    "listing_from_answer",
    "received_from_answer",
    "upload_message",
    "workspace_files",
]

# Each file request of an open session, and the event (its name, its message) that answers it.
_ANSWERS: dict[str, tuple[str, type[pb.ChunkUploaded | pb.ChunkDownloaded | pb.FilesListed]]] = {
    "upload": ("uploaded", pb.ChunkUploaded),
    "download": ("downloaded", pb.ChunkDownloaded),
    "list_files": ("listed", pb.FilesListed),
}
#: Each file request of an open session and the event that answers it.
FILE_EVENTS = {kind: event for kind, (event, _) in _ANSWERS.items()}
# A refusal's field names a request field: longer than any, it is a worker's garbage, cut.
MAX_REFUSAL_FIELD_CHARS = 64
_KINDS = {
    "file": pb.FILE_KIND_FILE,
    "dir": pb.FILE_KIND_DIR,
    "link": pb.FILE_KIND_LINK,
    "other": pb.FILE_KIND_OTHER,
}
_KIND_NAMES = {number: name for name, number in _KINDS.items()}
assert set(_KINDS) == set(FILE_KINDS)


# --------------------------------------------------------------------------- a request's files and collect


def workspace_files(field: str, messages: Iterable[pb.WorkspaceFile]) -> tuple[tuple[str, bytes], ...]:
    """A request's ``files``, checked (``workspace.check_files``); RequestError naming ``field``."""
    try:
        return check_files(tuple((message.path, bytes(message.data)) for message in messages))
    except ValueError as exc:  # the checks' Invalid
        raise RequestError(str(exc), field=field) from None


def collect_patterns(field: str, patterns: Iterable[str]) -> tuple[str, ...]:
    """A request's ``collect``, checked (``workspace.check_collect``); RequestError naming ``field``."""
    try:
        return check_collect(tuple(patterns))
    except ValueError as exc:  # the checks' Invalid
        raise RequestError(str(exc), field=field) from None


def file_messages(files: Iterable[tuple[str, bytes]]) -> list[pb.WorkspaceFile]:
    return [pb.WorkspaceFile(path=path, data=data) for path, data in files]


# --------------------------------------------------------------------------- what a job collected


def collected_message(collected: Collected) -> pb.CollectedFiles:
    return pb.CollectedFiles(
        files=file_messages(collected.files.items()),
        left_out=[_left_out_message(entry) for entry in collected.left_out],
        left_out_more=collected.left_out_more,
    )


def _left_out_message(entry: LeftOut) -> pb.LeftOut:
    message = pb.LeftOut(path=entry.path, reason=entry.reason)
    if entry.size is not None:
        message.size = entry.size
    return message


def collected_from_message(
    message: pb.CollectedFiles, *, max_files: int = MAX_COLLECTED_FILES, max_bytes: int = MAX_COLLECTED_BYTES
) -> Collected:
    """A worker's collected files, held to what the request let come back (``max_files``,
    ``max_bytes``, never past the protocol's limits): each path a normalised workspace path
    named once, each left-out entry's reason one a worker gives. Counts and sizes are checked
    before a path is."""
    max_files, max_bytes = min(max_files, MAX_COLLECTED_FILES), min(max_bytes, MAX_COLLECTED_BYTES)
    if len(message.files) > max_files:
        _lied(f"{len(message.files)} collected files, over the {max_files} asked for")
    total = sum(len(file.data) for file in message.files)
    if total > max_bytes:
        _lied(f"{total} bytes of collected files, over the {max_bytes} asked for")
    if len(message.left_out) > MAX_LEFT_OUT:
        _lied(f"{len(message.left_out)} left-out entries, over the {MAX_LEFT_OUT} a result holds")
    files: dict[str, bytes] = {}
    for file in message.files:
        path = _answered_path(file.path, "a collected file's path")
        if path in files:
            _lied(f"the collected file {path!r} twice")
        files[path] = bytes(file.data)
    left_out = []
    for entry in message.left_out:
        if entry.reason not in LEFT_OUT_REASONS:
            _lied(f"a left-out file's reason {entry.reason[:40]!r}, which no worker gives")
        size = entry.size if entry.HasField("size") else None
        if size is not None and not 0 <= size:
            _lied(f"a left-out file's size of {size}")
        left_out.append(LeftOut(_answered_path(entry.path, "a left-out file's path"), entry.reason, size))  # type: ignore[arg-type]
    return Collected(files=files, left_out=tuple(left_out), left_out_more=message.left_out_more)


# --------------------------------------------------------------------------- a session's files: the serving side


def answer_file_request(session: SessionHandle, request: pb.InteractRequest, cancel: Cancellation) -> pb.InteractEvent:
    """Do what an ``upload``, ``download`` or ``list_files`` asks of ``session``; its answer.

    A request the wire's checks refuse, and a refusal of the session's
    (RequestError, SandboxSetupError) that left it open, are answered in the
    event and the session goes on; anything else is raised, and ends the stream.
    """
    kind = request.WhichOneof("kind")
    event, message_type = _ANSWERS[kind]
    try:
        if kind == "upload":
            path, offset, data, size = _upload(request.upload)
            answer = pb.ChunkUploaded(received=session.upload_chunk(path, offset, data, size, cancel=cancel))
        elif kind == "download":
            path, offset, length = _download(request.download)
            answer = _chunk_message(session.download_chunk(path, offset, length, cancel=cancel))
        else:
            answer = _listing_message(session.list_files(_listed_path(request.list_files.path), cancel=cancel))
    except (RequestError, SandboxSetupError) as refused:
        if session.ended:  # a resume that failed ended it: not a refusal, the stream ends with it
            raise
        answer = message_type(**refusal_fields(refused, with_field=True))
    return pb.InteractEvent(**{event: answer})


def _upload(message: pb.UploadChunk) -> tuple[str, int, bytes, int]:
    path = _asked_path("upload.path", message.path, workspace_path)
    if not 0 <= message.size <= MAX_TRANSFER_BYTES:
        raise RequestError(f"must be between 0 and {MAX_TRANSFER_BYTES}, got {message.size}", field="upload.size")
    if len(message.data) > UPLOAD_CHUNK_BYTES:
        raise RequestError(f"{len(message.data)} bytes; a chunk holds at most {UPLOAD_CHUNK_BYTES}", field="upload.data")
    if not 0 <= message.offset <= message.size - len(message.data):
        raise RequestError(
            f"{message.offset} with {len(message.data)} bytes does not fit in a file of {message.size}", field="upload.offset"
        )
    return path, message.offset, bytes(message.data), message.size


def _download(message: pb.DownloadChunk) -> tuple[str, int, int]:
    path = _asked_path("download.path", message.path, workspace_path)
    if not 0 <= message.offset <= MAX_TRANSFER_BYTES:
        raise RequestError(f"must be between 0 and {MAX_TRANSFER_BYTES}, got {message.offset}", field="download.offset")
    if not 1 <= message.length <= DOWNLOAD_CHUNK_BYTES:
        raise RequestError(f"must be between 1 and {DOWNLOAD_CHUNK_BYTES}, got {message.length}", field="download.length")
    return path, message.offset, message.length


def _listed_path(path: str) -> str:
    """proto3 cannot tell an empty string from none: both list the workspace."""
    return _asked_path("list_files.path", path or ".", workspace_dir)


def _asked_path(field: str, path: str, check: Any) -> str:
    try:
        return str(check(path))
    except ValueError as exc:  # the checks' Invalid
        raise RequestError(str(exc), field=field) from None


def _chunk_message(chunk: FileChunk) -> pb.ChunkDownloaded:
    return pb.ChunkDownloaded(
        path=chunk.path, offset=chunk.offset, size=chunk.size, modified_ns=chunk.modified_ns, data=chunk.data
    )


def _listing_message(listing: FileListing) -> pb.FilesListed:
    entries = [pb.FileEntry(name=entry.name, size=entry.size, kind=_KINDS[entry.kind]) for entry in listing.entries]
    return pb.FilesListed(entries=entries, truncated=listing.truncated)


# --------------------------------------------------------------------------- a session's files: the calling side


def upload_message(path: str, offset: int, data: bytes, size: int) -> pb.InteractRequest:
    return pb.InteractRequest(upload=pb.UploadChunk(path=path, offset=offset, size=size, data=data))


def download_message(path: str, offset: int, length: int) -> pb.InteractRequest:
    return pb.InteractRequest(download=pb.DownloadChunk(path=path, offset=offset, length=length))


def list_message(path: str) -> pb.InteractRequest:
    return pb.InteractRequest(list_files=pb.ListFiles(path=path))


def file_refusal(answer: pb.ChunkUploaded | pb.ChunkDownloaded | pb.FilesListed) -> ReadieError | None:
    """The refusal a file answer carries, as the worker raised it (its field named); None if none."""
    field = answer.error_field[:MAX_REFUSAL_FIELD_CHARS] or None
    return refusal(answer, field=field)


def received_from_answer(answer: pb.ChunkUploaded, offset: int, data: bytes) -> int:
    """The bytes the file holds after the chunk: exactly where the chunk ended, or the worker lied."""
    if answer.received != offset + len(data):
        _lied(f"{answer.received} bytes received for a chunk that ends at {offset + len(data)}")
    return answer.received


def chunk_from_answer(answer: pb.ChunkDownloaded, path: str, offset: int, length: int) -> FileChunk:
    """The chunk asked for: the same path and offset, at most ``length`` bytes, within the file's
    size (at most :data:`MAX_TRANSFER_BYTES`), and some bytes unless the file ends at ``offset``,
    so a download always gets on."""
    data = bytes(answer.data)
    if answer.path != path or answer.offset != offset:
        _lied(f"a chunk of {answer.path[:100]!r} at {answer.offset} for one of {path!r} at {offset}")
    if not 0 <= answer.size <= MAX_TRANSFER_BYTES or answer.modified_ns < 0:
        _lied(f"a file of {answer.size} bytes modified at {answer.modified_ns}")
    if len(data) > length or offset + len(data) > answer.size or (not data and offset < answer.size):
        _lied(f"{len(data)} bytes at {offset} of a {answer.size}-byte file when {length} were asked")
    return FileChunk(path=path, offset=offset, size=answer.size, modified_ns=answer.modified_ns, data=data)


def listing_from_answer(answer: pb.FilesListed, path: str) -> FileListing:
    """A listing held to a worker's own: at most :data:`MAX_LISTED_ENTRIES` entries, each a name
    (no ``/``, at most 255 bytes, not ``.`` or ``..``) of a known kind, sorted, none twice."""
    if len(answer.entries) > MAX_LISTED_ENTRIES:
        _lied(f"{len(answer.entries)} entries, over the {MAX_LISTED_ENTRIES} of a listing")
    entries = []
    for entry in answer.entries:
        if entry.kind not in _KIND_NAMES or entry.size < 0:
            _lied(f"an entry of kind {entry.kind} and size {entry.size}")
        if entry.name in ("", ".", "..") or "/" in entry.name or "\0" in entry.name:
            _lied(f"the entry name {entry.name[:100]!r}")
        if len(entry.name.encode("utf-8", "surrogatepass")) > MAX_WORKSPACE_NAME_BYTES:
            _lied(f"an entry name of more than {MAX_WORKSPACE_NAME_BYTES} bytes")
        if entries and entry.name <= entries[-1].name:
            _lied("a listing not sorted by name, or a name twice")
        entries.append(FileEntry(entry.name, entry.size, _KIND_NAMES[entry.kind]))
    return FileListing(path=path, entries=tuple(entries), truncated=answer.truncated)


def _answered_path(path: str, what: str) -> str:
    try:
        checked = workspace_path(path)
    except ValueError as exc:  # the checks' Invalid
        problem: str | None = str(exc)
    else:
        problem = None if checked == path else "is not normalised"
    if problem is not None:
        _lied(f"{what} {path[:100]!r}, which {problem}")
    return path


def _lied(what: str) -> NoReturn:
    raise PoolWorkerError(f"the worker answered {what}")
