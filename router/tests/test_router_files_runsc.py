"""Files in and out of real sandboxes through `readie router` (issue 29): a client that shares no
disk with the worker moves them over gRPC only.

One router in front of one real `readie worker` (two slots), started once for the module. A
``WorkerClient`` of the router opens sessions (``RemoteSession`` here, ``PlacedSession`` on the
router, ``RemoteSession`` again to the worker, the worker's ``SandboxSession`` in runsc):

* a job's ``files`` are read by its code in the sandbox and what it wrote comes back
  ``collect``-ed, byte-exact;
* 64 MiB go up into a session in chunks, a step checksums them in the sandbox, a 64 MiB file the
  step wrote comes back in chunks byte-exact, while another session's steps keep running;
* a bad path (the router's check) and a missing file (the worker's) are refused naming their
  field, and the session goes on.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from readie_policy.jobs import CodeJob, Step
from readie_protocol.errors import RequestError
from readie_protocol.workspace import DOWNLOAD_CHUNK_BYTES, UPLOAD_CHUNK_BYTES
from readie_rpc.client import WorkerClient
from readie_rpc.testing import Cluster, start_cluster

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

MiB = 1024 * 1024
BIG = 64 * MiB
TIMEOUT_MS = 60_000


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="rf-", dir="/tmp"))
    made = start_cluster(base, CHECKPOINTS / "manifest.json", workers=1)
    yield made
    made.stop()
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture
def client(cluster: Cluster) -> Iterator[WorkerClient]:
    client = WorkerClient(cluster.address)
    yield client
    client.close()


def test_a_jobs_files_go_in_and_what_it_wrote_comes_back(client):
    orders = b"id,total\n1,9.5\n2,0.5\n"
    code = (
        "import csv, pathlib\n"
        "rows = list(csv.DictReader(open('data/orders.csv')))\n"
        "pathlib.Path('out').mkdir()\n"
        "pathlib.Path('out/total.txt').write_text(str(sum(float(r['total']) for r in rows)))\n"
        "pathlib.Path('out/chart.png').write_bytes(bytes(range(256)) * 4)\n"
    )
    outcome = client.run_job(CodeJob(
        "base", code, timeout_ms=TIMEOUT_MS, files=(("data/orders.csv", orders),), collect=("out/*", "missing.xlsx"),
    ))
    assert outcome.error is None, outcome
    assert outcome.collected is not None
    assert dict(outcome.collected.files) == {"out/total.txt": b"10.0", "out/chart.png": bytes(range(256)) * 4}
    assert [(entry.path, entry.reason) for entry in outcome.collected.left_out] == [("missing.xlsx", "unreadable")]


def test_64_mib_up_and_down_through_the_router_while_another_session_steps(client):
    session, _ = client.open_session(CodeJob("base", "import hashlib", timeout_ms=TIMEOUT_MS))
    other, _ = client.open_session(CodeJob("base", "n = 0", timeout_ms=TIMEOUT_MS))
    transferring = threading.Event()
    steps_meanwhile: list[str] = []

    def keep_stepping() -> None:
        while transferring.is_set():
            steps_meanwhile.append(other.run_step(Step("n += 1\nprint(n)")).outcome.stdout)

    data = hashlib.shake_256(b"readie files").digest(BIG)
    transferring.set()
    stepper = threading.Thread(target=keep_stepping, daemon=True)
    stepper.start()
    try:
        for offset in range(0, BIG, UPLOAD_CHUNK_BYTES):
            chunk = data[offset : offset + UPLOAD_CHUNK_BYTES]
            assert session.upload_chunk("in/data.bin", offset, chunk, BIG) == offset + len(chunk)
        step = session.run_step(Step(
            "data = open('in/data.bin', 'rb').read()\n"
            "print(len(data), hashlib.sha256(data).hexdigest())\n"
            "open('out.bin', 'wb').write(hashlib.sha256(data).digest() * (len(data) // 32))\n"
            "del data\n"
        ))
        assert step.outcome.stdout.split() == [str(BIG), hashlib.sha256(data).hexdigest()], step.outcome
        pieces, offset = [], 0
        while True:
            chunk = session.download_chunk("out.bin", offset, DOWNLOAD_CHUNK_BYTES)
            pieces.append(chunk.data)
            offset = chunk.end
            if chunk.last:
                break
        downloaded = b"".join(pieces)
    finally:
        transferring.clear()
        stepper.join(TIMEOUT_MS / 1000)
    assert downloaded == hashlib.sha256(data).digest() * (BIG // 32)
    listing = {entry.name: (entry.size, entry.kind) for entry in session.list_files(".").entries}
    assert listing["out.bin"] == (BIG, "file") and listing["in"][1] == "dir"
    assert len(steps_meanwhile) >= 5 and steps_meanwhile == [f"{n}\n" for n in range(1, len(steps_meanwhile) + 1)]
    with pytest.raises(RequestError) as refused:  # the router's own check
        session.download_chunk("../../etc/passwd", 0, 1)
    assert refused.value.field == "download.path" and not session.ended
    with pytest.raises(RequestError) as missing:  # the worker's, relayed by the router naming its field
        session.download_chunk("missing.bin", 0, 1)
    assert missing.value.field == "download" and "missing.bin" in str(missing.value) and not session.ended
    assert session.run_step(Step("print('goes on')")).outcome.stdout == "goes on\n"
    session.close()
    other.close()
