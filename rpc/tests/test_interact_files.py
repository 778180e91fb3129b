"""Files in a session's workspace, and a job's files and collect, over real gRPC on loopback.

The worker's real ``serve()`` and ``Interaction``, a real ``WorkerClient`` and
``RemoteSession``; below the wire, the fake runner's sessions keep their
workspace in a dict (``_interact_fakes.MemoryWorkspace``). Covered:

* a file uploaded in the largest chunks, downloaded in the largest chunks,
  byte-exact, and listed; the session's steps go on after;
* refusals (bad paths, a size past the session's limit, no such file) cross
  the wire typed, naming their field, and the session goes on;
* a failure of the session under a file request ends it, its sandbox closed;
* a file request while a step runs is refused on the calling side;
* a transfer held up on one session holds up no other session's steps;
* a job's files reach it and come back collected, and the largest answer a
  worker sends (32 MiB collected, 16 MiB of stdout and of stderr, a value) fits.

Real sandboxes behind a router: router/tests/test_router_files_runsc.py.
"""

from __future__ import annotations

import hashlib
import threading

import pytest

from readie_executor.jobs import bounds
from readie_policy.jobs import CodeJob, Step
from readie_protocol.errors import PoolWorkerError, RequestError
from readie_protocol.workspace import DOWNLOAD_CHUNK_BYTES, MAX_COLLECTED_BYTES, UPLOAD_CHUNK_BYTES, FileEntry
from rpc.tests._interact_fakes import WAIT_S, wait_until
from rpc.tests._interact_fakes import serve_fake  # noqa: F401 - fixtures

OPEN = CodeJob("base", "open", timeout_ms=5000)


def _upload(session, path: str, data: bytes) -> None:
    for offset in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
        chunk = data[offset : offset + UPLOAD_CHUNK_BYTES]
        assert session.upload_chunk(path, offset, chunk, len(data)) == offset + len(chunk)


def _download(session, path: str) -> bytes:
    pieces, offset = [], 0
    while True:
        chunk = session.download_chunk(path, offset, DOWNLOAD_CHUNK_BYTES)
        pieces.append(chunk.data)
        offset = chunk.end
        if chunk.last:
            return b"".join(pieces)


def test_a_file_goes_up_and_comes_back_byte_exact_in_the_largest_chunks(serve_fake):
    served = serve_fake()
    session, _ = served.client().open_session(OPEN)
    data = hashlib.shake_256(b"readie").digest(2 * DOWNLOAD_CHUNK_BYTES + 12_345)
    _upload(session, "in/data.bin", data)
    worker_side = served.runner.sessions[0]
    assert worker_side.files["in/data.bin"] == data
    assert _download(session, "in/data.bin") == data
    assert session.list_files(".").entries == (FileEntry("in", 0, "dir"),)
    assert session.list_files("in").entries == (FileEntry("data.bin", len(data), "file"),)
    assert session.run_step(Step("after")).outcome.stdout == "after"
    session.close()
    assert worker_side.closed.wait(WAIT_S)


def test_refusals_cross_the_wire_typed_and_the_session_goes_on(serve_fake):
    served = serve_fake()
    session, _ = served.client().open_session(OPEN)
    served.runner.sessions[0].transfer_bytes = 10
    cases = [
        (lambda: session.upload_chunk("../escape", 0, b"x", 1), "upload.path"),  # the wire's own check
        (lambda: session.upload_chunk("big", 0, b"", 11), "upload.size"),  # the session's limit
        (lambda: session.download_chunk("missing", 0, 5), "download.path"),
        (lambda: session.list_files("/etc"), "list_files.path"),
    ]
    for ask, field in cases:
        with pytest.raises(RequestError) as refused:
            ask()
        assert refused.value.field == field and not session.ended
    assert session.run_step(Step("still here")).outcome.stdout == "still here"
    session.close()


def test_a_failure_under_a_file_request_ends_the_session(serve_fake):
    served = serve_fake()
    session, _ = served.client().open_session(OPEN)
    worker_side = served.runner.sessions[0]
    worker_side.failure = PoolWorkerError("the sandbox answered out of bounds")
    with pytest.raises(PoolWorkerError, match="the session ended"):
        session.download_chunk("x", 0, 1)
    assert session.ended and worker_side.closed.wait(WAIT_S)


def test_a_file_request_waits_for_no_step_it_is_refused_while_one_runs(serve_fake):
    served = serve_fake()
    session, _ = served.client().open_session(OPEN)
    step = threading.Thread(target=session.run_step, args=(Step("block"),), daemon=True)
    step.start()
    assert wait_until(lambda: served.runner.sessions[0].steps == ["block"])
    with pytest.raises(RequestError, match="between steps"):
        session.upload_chunk("x", 0, b"", 0)
    served.runner.release.set()
    step.join(WAIT_S)
    assert session.upload_chunk("x", 0, b"ok", 2) == 2


def test_a_transfer_held_up_on_one_session_holds_up_no_other(serve_fake):
    served = serve_fake()
    client = served.client()
    slow, _ = client.open_session(OPEN)
    other, _ = client.open_session(OPEN)
    gate = served.runner.sessions[0].gate = threading.Event()
    uploaded: list[int] = []
    upload = threading.Thread(target=lambda: uploaded.append(slow.upload_chunk("f", 0, b"abc", 3)), daemon=True)
    upload.start()
    assert served.runner.sessions[0].waiting.wait(WAIT_S)
    for number in range(5):
        assert other.run_step(Step(f"step {number}")).outcome.stdout == f"step {number}"
    assert client.run_job(CodeJob("base", "a job", timeout_ms=5000)).stdout == "a job"
    assert uploaded == []  # still held
    gate.set()
    upload.join(WAIT_S)
    assert uploaded == [3]


def test_a_jobs_files_come_back_collected_and_the_largest_answer_fits(serve_fake):
    client = serve_fake().client()
    files = (("data/orders.csv", b"id,total\n1,9.5\n"), ("empty", b""))
    outcome = client.run_job(CodeJob("base", "echo", timeout_ms=5000, files=files, collect=("**",)))
    assert outcome.collected is not None and dict(outcome.collected.files) == dict(files)
    big = client.run_job(CodeJob("base", f"big {MAX_COLLECTED_BYTES}", timeout_ms=5000, collect=("big.bin",)))
    assert big.collected is not None and big.collected.files["big.bin"] == b"\xa5" * MAX_COLLECTED_BYTES
    assert len(big.stdout) == len(big.stderr) == bounds.MAX_OUTPUT_LIMIT and big.value is not None
