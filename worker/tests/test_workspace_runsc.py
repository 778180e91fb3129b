"""Files in and out of real gVisor sandboxes through the in-process Worker (decision 31).

A job's files and collect byte-exact; a session's 64 MiB each way in chunks; the workspace
through hibernation and a fork; an upload past the sandbox's memory refused and the session
going on; a link the code planted to a write grant never followed; a sandbox that lies about
its files failing its step, not the worker.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from readie_protocol.workspace import DOWNLOAD_CHUNK_BYTES, UPLOAD_CHUNK_BYTES, LeftOut
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ErrorType, PoolWorkerError, RequestError
from readie_worker.jobs import CodeJob, Step

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

MIB = 1024 * 1024


@pytest.fixture(scope="module")
def worker(checkpoints):
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"base": 1}, slots=2, max_sessions=4)
    worker = Worker(config).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []


@pytest.fixture
def grant_dir():
    # Not under /tmp: the worker keeps its own dirs there, and no grant may overlap them.
    path = Path(tempfile.mkdtemp(prefix="ws-grant-", dir="/var/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def job(code: str, **fields) -> CodeJob:
    return CodeJob(checkpoint="base", code=code, name="cell.py", **fields)


def upload(session, path: str, data: bytes) -> None:
    for offset in range(0, max(len(data), 1), UPLOAD_CHUNK_BYTES):
        held = session.upload_chunk(path, offset, data[offset : offset + UPLOAD_CHUNK_BYTES], len(data))
        assert held == min(offset + UPLOAD_CHUNK_BYTES, len(data))


def download(session, path: str) -> bytes:
    pieces, offset = [], 0
    while True:
        chunk = session.download_chunk(path, offset, DOWNLOAD_CHUNK_BYTES)
        assert chunk.offset == offset and len(chunk.data) <= DOWNLOAD_CHUNK_BYTES
        pieces.append(chunk.data)
        offset = chunk.end
        if chunk.last:
            return b"".join(pieces)


def test_a_jobs_files_go_in_and_what_it_wrote_comes_back_byte_exact(worker):
    given = bytes(range(256)) * 64
    code = (
        "import os\n"
        "data = open('data/in.bin', 'rb').read()\n"
        "os.makedirs('out', exist_ok=True)\n"
        "open('out/chart.png', 'wb').write(bytes(reversed(data)))\n"
        "open('out/notes.txt', 'w').write('not asked for')\n"
        "os.symlink('/etc/passwd', 'out/passwd.png')\n"
        "os.symlink('/etc', 'out/etc')\n"
        "print(len(data))"
    )
    outcome = worker.run_job(job(code, files=(("data/in.bin", given),), collect=("out/**/*.png", "report.xlsx", "out/etc/passwd")))
    assert (outcome.exit, outcome.stdout) == (0, f"{len(given)}\n"), outcome.error
    assert outcome.collected.files == {"out/chart.png": bytes(reversed(given))}
    assert set(outcome.collected.left_out) == {
        LeftOut("out/passwd.png", "link"), LeftOut("report.xlsx", "unreadable"), LeftOut("out/etc/passwd", "link")
    }


def test_a_session_moves_64_mib_each_way_in_chunks(worker):
    session, _ = worker.open_session(job("import hashlib"))
    try:
        sent = os.urandom(64 * MIB)
        upload(session, "in/big.bin", sent)
        checked = session.run_step(Step("print(hashlib.sha256(open('in/big.bin', 'rb').read()).hexdigest())"))
        assert checked.outcome.stdout == hashlib.sha256(sent).hexdigest() + "\n"
        written = session.run_step(Step(
            "import os\nblob = os.urandom(64 * 2**20)\nopen('out.bin', 'wb').write(blob)\n"
            "print(hashlib.sha256(blob).hexdigest())\ndel blob"
        ))
        assert written.outcome.exit == 0, written.outcome.error
        assert hashlib.sha256(download(session, "out.bin")).hexdigest() + "\n" == written.outcome.stdout
        listed = {entry.name: entry for entry in session.list_files(".").entries}
        assert (listed["in"].kind, listed["out.bin"].kind, listed["out.bin"].size) == ("dir", "file", 64 * MIB)
    finally:
        session.close()


def test_the_workspace_survives_hibernation_and_goes_into_a_fork(worker):
    session, _ = worker.open_session(job("x = 1"))
    try:
        upload(session, "kept.txt", b"kept through it all")
        session.hibernate()
        assert session.hibernated
        assert download(session, "kept.txt") == b"kept through it all"  # resumed first
        fork, _ = worker.fork_session(session)
        try:
            assert [e.name for e in fork.list_files(".").entries if e.name == "kept.txt"] == ["kept.txt"]
            assert fork.run_step(Step("print(open('kept.txt').read())")).outcome.stdout == "kept through it all\n"
        finally:
            fork.close()
    finally:
        session.close()


def test_an_upload_past_the_memory_left_is_refused_and_the_session_goes_on(worker):
    session, _ = worker.open_session(job("x = 1", memory_bytes=64 * MIB))
    try:
        with pytest.raises(RequestError, match="bytes of memory left") as refused:
            session.upload_chunk("huge.bin", 0, b"x" * UPLOAD_CHUNK_BYTES, 200 * MIB)
        assert refused.value.field == "upload"
        assert session.run_step(Step("import os\nprint(x, os.path.exists('huge.bin'))")).outcome.stdout == "1 False\n"
        upload(session, "fits.bin", b"y" * 8 * MIB)  # what is left is measured, not taken as nothing
        assert session.run_step(Step("print(os.path.getsize('fits.bin'))")).outcome.stdout == f"{8 * MIB}\n"
    finally:
        session.close()


def test_an_upload_through_a_link_the_code_planted_to_a_write_grant_is_refused(worker, grant_dir):
    session, _ = worker.open_session(job(f"import os\nos.symlink({str(grant_dir)!r}, 'grant')", allow_write=(str(grant_dir),)))
    try:
        for path in ("grant/evil.txt", "grant"):
            with pytest.raises(RequestError, match="symbolic link") as refused:
                session.upload_chunk(path, 0, b"evil", 4)
            assert refused.value.field == "upload"
        with pytest.raises(RequestError, match="symbolic link"):
            session.list_files("grant")
        assert list(grant_dir.iterdir()) == []
        assert session.run_step(Step("print('still here')")).outcome.stdout == "still here\n"
    finally:
        session.close()


def test_a_sandbox_that_lies_about_its_files_fails_its_step_and_ends_the_session(worker):
    liar = (
        "import json\nimport readie_executor.jobs._collect as c\n"
        "def collect(*args):\n"
        "    header = json.dumps({'files': [{'path': 'etc/passwd', 'size': 4}], 'left_out': [], 'left_out_more': 0, 'walk_cut': False}).encode()\n"
        "    return len(header).to_bytes(4, 'big') + header + b'root'\n"
        "collect.__readie_raw_response__ = True\n"
        "c.collect = collect\n"
    )
    session, _ = worker.open_session(job(liar))
    step = session.run_step(Step("open('a.txt', 'w').write('a')", collect=("*.txt",)))
    assert step.session_ended and step.outcome.exit is None
    assert step.outcome.error.type == ErrorType.POOL_WORKER and "no pattern asked for 'etc/passwd'" in step.outcome.error.message
    assert step.outcome.collected.files == {}
    assert session.ended and step.outcome.sandbox_id not in worker.runsc.list_ids()
    assert worker.run_job(job("print('served')")).stdout == "served\n"


def test_a_download_chunk_longer_than_asked_ends_the_session_not_the_worker(worker):
    liar = (
        "import json\nimport readie_executor.jobs._transfers as t\n"
        "def download_chunk(cwd, path, offset, length):\n"
        "    header = json.dumps({'offset': offset, 'size': 10 * length, 'modified_ns': 1}).encode()\n"
        "    return len(header).to_bytes(4, 'big') + header + b'x' * (length + 1)\n"
        "download_chunk.__readie_raw_response__ = True\n"
        "t.download_chunk = download_chunk\n"
    )
    session, _ = worker.open_session(job(liar))
    with pytest.raises(PoolWorkerError, match="out of bounds"):
        session.download_chunk("any.bin", 0, 1000)
    assert session.ended and session.sandbox_id not in worker.runsc.list_ids()
    assert worker.run_job(job("print('served')")).stdout == "served\n"
