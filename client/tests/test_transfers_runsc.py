"""Files in and out of real sandboxes through ``readie.Pool``: a job's ``files`` and ``collect``, and a
session's chunked upload, download and listing, byte-exact; refusals leave the session going.

One pool (one worker) serves the module. The requests and checks without a sandbox are
test_transfers.py's.
"""

from __future__ import annotations

import hashlib
import os
import struct
import zlib

import pytest
import readie
from readie.testing import temp_pool
from readie_protocol.workspace import DOWNLOAD_CHUNK_BYTES, UPLOAD_CHUNK_BYTES

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


def png(width: int = 4, height: int = 3) -> bytes:
    """A real PNG (red pixels), made by hand: the checkpoints preload no plotting library."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + b"\xff\x00\x00" * width for _ in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


@pytest.fixture(scope="module")
def pool():
    with temp_pool(workers=1, checkpoints=CHECKPOINTS) as pool:
        yield pool


def test_a_jobs_files_go_in_and_what_it_wrote_comes_back(pool):
    orders = b"product,amount\ntea,3\ncake,5\ntea,4\n"
    chart = png()
    code = (
        "import csv, os, shutil\n"
        "rows = list(csv.DictReader(open('data/orders.csv')))\n"
        "os.makedirs('out/figs', exist_ok=True)\n"
        "shutil.copy('chart.png', 'out/figs/chart.png')\n"
        "os.symlink('/etc/passwd', 'out/passwd.png')\n"
        "print(sum(int(r['amount']) for r in rows))\n"
    )
    result = pool.run(code, files={"data/orders.csv": orders, "chart.png": chart},
                      collect=["out/**/*.png", "report.xlsx"]).raise_for_error()
    assert result.stdout == "12\n"
    assert result.collected == {"out/figs/chart.png": chart}
    assert sorted((left.path, left.reason) for left in result.left_out) == [
        ("out/passwd.png", "link"), ("report.xlsx", "unreadable")]


def test_a_session_moves_files_in_chunks_byte_exact(pool, tmp_path):
    local = tmp_path / "in.bin"
    local.write_bytes(os.urandom(2 * UPLOAD_CHUNK_BYTES + 7))
    written = bytes(range(256)) * (DOWNLOAD_CHUNK_BYTES * 2 // 256 + 3)  # three download chunks
    with pool.session() as nb:
        assert nb.upload("in/data.bin", local) == local.stat().st_size  # opens the session: step 1
        step = nb.run(
            "import hashlib\n"
            "print(hashlib.sha256(open('in/data.bin', 'rb').read()).hexdigest())\n"
            f"open('out.bin', 'wb').write(bytes(range(256)) * {len(written) // 256})\n"
        ).raise_for_error()
        assert step.step == 2 and step.stdout == hashlib.sha256(local.read_bytes()).hexdigest() + "\n"
        assert nb.download("out.bin") == written
        target = tmp_path / "out.bin"
        assert nb.download("out.bin", to=target) == target and target.read_bytes() == written
        listing = nb.files()
        names = {entry.name: entry for entry in listing}
        assert names["out.bin"] == readie.FileEntry("out.bin", len(written), "file")
        assert names["in"].kind == "dir" and not listing.truncated
        assert [entry.name for entry in nb.files("in")] == ["data.bin"]
        # Refusals are the pool's typed errors; the session goes on.
        with pytest.raises(readie.RequestError):
            nb.download("missing.bin")
        with pytest.raises(readie.RequestError):
            nb.files("out.bin")  # a file, not a directory
        assert nb.run("print(len(open('out.bin', 'rb').read()))").stdout == f"{len(written)}\n"


def test_a_sessions_files_outlive_its_hibernation_and_go_into_its_forks(pool):
    with pool.session() as nb:
        nb.upload("a/kept.txt", b"kept")
        assert nb.hibernate() > 0
        assert nb.download("a/kept.txt") == b"kept"  # resumes it first
        fork = nb.fork()
        try:
            fork.upload("a/kept.txt", b"the fork's")
            assert (fork.download("a/kept.txt"), nb.download("a/kept.txt")) == (b"the fork's", b"kept")
        finally:
            fork.close()
