"""A session's uploads, downloads and listings, the pure layer: the requests a :class:`readie.Session`
sends for each chunk and its checks of every answer, against a fake pool's ``_exchange`` (typed
requests in, typed answers out; tampered with where a test says so). What a real pool and sandbox do
behind them is test_transfers_runsc.py's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import itertools
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import readie
from readie_protocol.encoding import encode_request
from readie_protocol.events import ClosedEvent, ErrorInfo, Result
from readie_protocol.lines import MAX_LINE_BYTES
from readie_protocol.requests import CloseSession, JobRequest
from readie_protocol.transfers import (
    ChunkEvent,
    DownloadChunk,
    ListFiles,
    ListingEvent,
    UploadChunk,
    UploadedEvent,
)
from readie_protocol.workspace import (
    DOWNLOAD_CHUNK_BYTES,
    MAX_TRANSFER_BYTES,
    UPLOAD_CHUNK_BYTES,
    FileChunk,
    FileEntry,
    FileListing,
)

SESSION = "nb"


class FakePool:
    """What a session needs of its pool (``_next_id``, ``_exchange``, ``_send_and_forget``), answering
    from a dict of workspace files as a pool that behaves would; ``tamper`` rewrites an answer."""

    def __init__(self) -> None:
        self.ids = itertools.count(1)
        self.sent: list[Any] = []
        self.workspace: dict[str, bytearray] = {}
        self.modified_ns: dict[str, int] = {}
        self.tamper: Callable[[Any, Any], Any] = lambda request, answer: answer
        self.steps = 0

    def _next_id(self) -> int:
        return next(self.ids)

    def _send_and_forget(self, request: Any) -> None:
        self.sent.append(request)

    def _exchange(self, request: Any, functions: Any = None, callbacks: Any = None) -> Any:
        self.sent.append(request)
        return self.tamper(request, self._answer(request))

    def _answer(self, request: Any) -> Any:
        if isinstance(request, JobRequest):
            self.steps += 1
            return Result(id=request.id, exit=0, session=SESSION, step=self.steps)
        if isinstance(request, UploadChunk):
            # The chunk must fit its line (the pool reads at most MAX_LINE_BYTES).
            assert len(encode_request(request.to_json())) <= MAX_LINE_BYTES
            if request.offset == 0:
                self.workspace[request.path] = bytearray()
            assert len(self.workspace[request.path]) == request.offset
            self.workspace[request.path] += request.data
            self.modified_ns[request.path] = 1
            return UploadedEvent(request.id, SESSION, request.path, request.offset + len(request.data), request.size)
        if isinstance(request, DownloadChunk):
            if request.path not in self.workspace:
                return refusal(request.id, f"download: no file {request.path!r} in the workspace")
            data = bytes(self.workspace[request.path])
            part = data[request.offset:request.offset + DOWNLOAD_CHUNK_BYTES]
            chunk = FileChunk(request.path, request.offset, len(data), self.modified_ns[request.path], part)
            return ChunkEvent(request.id, SESSION, chunk)
        if isinstance(request, ListFiles):
            entries = tuple(FileEntry(name, len(data), "file") for name, data in sorted(self.workspace.items()))
            return ListingEvent(request.id, SESSION, FileListing(request.path, entries, truncated=True))
        assert isinstance(request, CloseSession), request
        return ClosedEvent(request.id, SESSION)

    def of(self, kind: type) -> list[Any]:
        return [request for request in self.sent if isinstance(request, kind)]


def refusal(rid: Any, message: str, error_type: str = "RequestError", ended: bool = False) -> Result:
    return Result(id=rid, exit=-1, error=ErrorInfo(error_type, message), session=SESSION, session_ended=ended)


@pytest.fixture
def pool() -> FakePool:
    return FakePool()


@pytest.fixture
def session(pool: FakePool) -> readie.Session:
    return readie.Session(pool, SESSION, {"memory": "1g"})


def opened(session: readie.Session) -> readie.Session:
    session.run("")
    return session


# --------------------------------------------------------------------------- upload


def test_an_upload_opens_the_session_then_sends_its_chunks_in_order(pool, session):
    data = bytes(range(256)) * (UPLOAD_CHUNK_BYTES * 5 // 2 // 256)
    assert session.upload("data//in/./orders.csv", data) == len(data)
    step, = pool.of(JobRequest)
    assert (step.code, step.memory_bytes, session.open) == ("", 1 << 30, True)  # the setup went with it
    chunks = pool.of(UploadChunk)
    assert [(c.path, c.offset, c.size, len(c.data)) for c in chunks] == [
        ("data/in/orders.csv", 0, len(data), UPLOAD_CHUNK_BYTES),
        ("data/in/orders.csv", UPLOAD_CHUNK_BYTES, len(data), UPLOAD_CHUNK_BYTES),
        ("data/in/orders.csv", 2 * UPLOAD_CHUNK_BYTES, len(data), len(data) - 2 * UPLOAD_CHUNK_BYTES),
    ]
    assert len({c.id for c in chunks}) == 3 and pool.workspace["data/in/orders.csv"] == data
    # Open now: the next upload sends no step.
    session.upload("empty", b"")
    assert len(pool.of(JobRequest)) == 1 and pool.of(UploadChunk)[-1].data == b"" and pool.workspace["empty"] == b""


def test_a_local_file_is_read_a_chunk_at_a_time(pool, session, tmp_path):
    local = tmp_path / "big.bin"
    local.write_bytes(b"x" * (UPLOAD_CHUNK_BYTES + 10))
    assert opened(session).upload("big.bin", local) == UPLOAD_CHUNK_BYTES + 10
    assert [len(c.data) for c in pool.of(UploadChunk)] == [UPLOAD_CHUNK_BYTES, 10]
    assert pool.workspace["big.bin"] == local.read_bytes()


@pytest.mark.parametrize("change", ["grow", "shrink"])
def test_a_local_file_that_changes_while_it_is_uploaded_is_reported(pool, session, tmp_path, change):
    local = tmp_path / "moving.bin"
    local.write_bytes(b"x" * (2 * UPLOAD_CHUNK_BYTES))

    def change_it(request, answer):
        if isinstance(request, UploadChunk) and request.offset == 0:
            with local.open("ab" if change == "grow" else "r+b") as file:
                file.write(b"more") if change == "grow" else file.truncate(100)
        return answer

    pool.tamper = change_it
    with pytest.raises(readie.FileChanged, match="grew" if change == "grow" else "shrank"):
        opened(session).upload("moving.bin", local)
    assert session.open  # the session goes on; its copy is partial


def test_a_bad_upload_is_refused_before_anything_is_sent(pool, session, tmp_path):
    with pytest.raises(readie.RequestError, match="'..'") as bad_path:
        session.upload("../etc/passwd", b"x")
    assert bad_path.value.field == "upload"
    huge = tmp_path / "huge.bin"
    with huge.open("wb") as file:
        file.truncate(MAX_TRANSFER_BYTES + 1)  # sparse: nothing is read before the size is checked
    with pytest.raises(readie.RequestError) as too_big:
        session.upload("huge.bin", huge)
    assert too_big.value.field == "size"
    with pytest.raises(TypeError, match="bytes or a local file's path"):
        session.upload("x", 42)
    assert pool.sent == [] and not session.open


def test_an_upload_answer_that_does_not_match_breaks_the_protocol(pool, session):
    pool.tamper = lambda request, answer: (
        dataclasses.replace(answer, received=answer.received + 1) if isinstance(answer, UploadedEvent) else answer)
    with pytest.raises(readie.PoolError, match="broke the protocol"):
        session.upload("a", b"abc")


def test_a_refused_upload_raises_its_error_and_the_session_goes_on(pool, session):
    pool.tamper = lambda request, answer: (
        refusal(request.id, "upload: 300 MiB is more than the session's memory has left")
        if isinstance(request, UploadChunk) else answer)
    with pytest.raises(readie.RequestError, match="memory has left"):
        session.upload("a", b"abc")
    assert session.open


# --------------------------------------------------------------------------- download


def test_a_download_asks_for_each_chunk_where_the_last_ended(pool, session, tmp_path):
    data = hashlib.sha256(b"seed").digest() * (DOWNLOAD_CHUNK_BYTES * 2 // 32 + 5)
    pool.workspace["out/report.bin"] = bytearray(data)
    pool.modified_ns["out/report.bin"] = 7
    assert opened(session).download("out//report.bin") == data
    assert [(d.path, d.offset) for d in pool.of(DownloadChunk)] == [
        ("out/report.bin", 0), ("out/report.bin", DOWNLOAD_CHUNK_BYTES), ("out/report.bin", 2 * DOWNLOAD_CHUNK_BYTES)]
    target = tmp_path / "report.bin"
    assert session.download("out/report.bin", to=str(target)) == target
    assert target.read_bytes() == data and [p.name for p in tmp_path.iterdir()] == ["report.bin"]
    pool.workspace["empty"], pool.modified_ns["empty"] = bytearray(), 1
    assert session.download("empty") == b""


def test_a_file_that_changes_while_it_is_downloaded_is_reported_and_never_joined(pool, session, tmp_path):
    pool.workspace["log"] = bytearray(b"a" * (DOWNLOAD_CHUNK_BYTES + 1))
    pool.modified_ns["log"] = 1

    def rewrite(request, answer):
        pool.modified_ns["log"] += 1  # written to between every two chunks, its size the same
        return answer

    pool.tamper = rewrite
    target = tmp_path / "log"
    target.write_bytes(b"what was there")
    with pytest.raises(readie.FileChanged, match="'log' changed while it was downloaded"):
        opened(session).download("log", to=target)
    assert target.read_bytes() == b"what was there" and [p.name for p in tmp_path.iterdir()] == ["log"]
    assert session.open


def broken_chunk(answer: ChunkEvent, **changes: Any) -> ChunkEvent:
    return dataclasses.replace(answer, chunk=dataclasses.replace(answer.chunk, **changes))


@pytest.mark.parametrize("lie", [
    lambda a: broken_chunk(a, offset=a.chunk.offset + 1, data=a.chunk.data[:-1]),  # not where asked
    lambda a: broken_chunk(a, path="other"),
    lambda a: broken_chunk(a, data=b""),  # no progress: it would loop for ever
    lambda a: broken_chunk(a, size=MAX_TRANSFER_BYTES + 1),
    lambda a: dataclasses.replace(a, session="another"),
], ids=["offset", "path", "empty", "huge", "session"])
def test_a_chunk_that_is_not_the_one_asked_for_breaks_the_protocol(pool, session, lie):
    pool.workspace["f"], pool.modified_ns["f"] = bytearray(b"abc" * 1000), 1
    pool.tamper = lambda request, answer: lie(answer) if isinstance(answer, ChunkEvent) else answer
    with pytest.raises(readie.PoolError, match="broke the protocol"):
        opened(session).download("f")


def test_refusals_raise_the_pools_error_and_say_whether_the_session_ended(pool, session):
    opened(session)
    with pytest.raises(readie.RequestError, match="no file 'missing'"):
        session.download("missing")
    assert session.open
    pool.tamper = lambda request, answer: (
        refusal(request.id, "the sandbox died", "PoolWorkerError", ended=True) if isinstance(request, ListFiles) else answer)
    with pytest.raises(readie.PoolWorkerError, match="the sandbox died"):
        session.files()
    assert not session.open


def test_an_ok_result_is_no_answer_to_a_transfer(pool, session):
    pool.tamper = lambda request, answer: (
        Result(id=request.id, exit=0, session=SESSION) if isinstance(request, DownloadChunk) else answer)
    with pytest.raises(readie.PoolError, match="answered download request"):
        opened(session).download("f")


def test_reading_a_session_that_is_not_open_is_refused_without_asking(pool, session):
    for read in (lambda: session.download("f"), session.files):
        with pytest.raises(readie.RequestError, match="is not open"):
            read()
    assert pool.sent == []


# --------------------------------------------------------------------------- listing


def test_files_lists_a_directory_and_says_when_it_was_cut(pool, session):
    pool.workspace["b.csv"], pool.workspace["a.png"] = bytearray(b"12"), bytearray(b"1")
    listing = opened(session).files("data/./")
    assert listing == [readie.FileEntry("a.png", 1, "file"), readie.FileEntry("b.csv", 2, "file")]
    assert (listing.path, listing.truncated) == ("data", True) and pool.of(ListFiles)[0].path == "data"
    pool.tamper = lambda request, answer: (
        dataclasses.replace(answer, listing=dataclasses.replace(answer.listing, path="elsewhere"))
        if isinstance(answer, ListingEvent) else answer)
    with pytest.raises(readie.PoolError, match="broke the protocol"):
        session.files("data")
    with pytest.raises(readie.RequestError, match="absolute") as absolute:
        session.files("/etc")
    assert absolute.value.field == "list"


def test_the_async_twin_sends_the_same(pool):
    import asyncio

    class AsyncFake(FakePool):
        async def _exchange(self, request: Any, functions: Any = None, callbacks: Any = None) -> Any:
            return FakePool._exchange(self, request)

    fake = AsyncFake()

    async def go() -> tuple[bytes, list]:
        async with readie.AsyncSession(fake, SESSION, {}) as nb:
            await nb.upload("x/y", b"hello")
            return await nb.download("x/y"), await nb.files("x")

    data, listing = asyncio.run(go())
    assert data == b"hello" and [e.name for e in listing] == ["x/y"]
