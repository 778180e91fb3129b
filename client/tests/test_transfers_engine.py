"""A session's files and a job's ``files``/``collect`` through the real pool engine and protocol (its
backend faked: a session's workspace is a dict), from both pools: every chunk's line is parsed by the
pool and every answer read by the client's connection. Real sandboxes: test_transfers_runsc.py.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import readie
from readie_protocol.workspace import DOWNLOAD_CHUNK_BYTES, UPLOAD_CHUNK_BYTES

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


@pytest.fixture(scope="module")
def pool(tmp_path_factory):
    with readie.Pool(command=ENGINE, cwd=tmp_path_factory.mktemp("engine")) as pool:
        yield pool


def test_a_jobs_files_come_back_when_collected(pool):
    result = pool.run("cat in/a.csv\nwrite out.txt done", files={"in/a.csv": b"a,b\n"}, collect=["**/*.csv", "*.txt"])
    assert result.stdout == "a,b\n\n" and result.collected == {"in/a.csv": b"a,b\n", "out.txt": b"done"}


def test_a_session_uploads_downloads_and_lists_through_the_engine(pool, tmp_path):
    data = bytes(range(256)) * ((2 * DOWNLOAD_CHUNK_BYTES + UPLOAD_CHUNK_BYTES) // 256 + 1)
    local = tmp_path / "local.bin"
    local.write_bytes(data)
    with pool.session() as nb:
        assert nb.upload("in/data.bin", local) == len(data)
        assert nb.last_step == 1 and nb.open  # the empty step that opened it
        assert nb.download("in/data.bin") == data
        target = tmp_path / "back.bin"
        assert nb.download("in/data.bin", to=target) == target and target.read_bytes() == data
        assert [(entry.name, entry.kind) for entry in nb.files("in")] == [("data.bin", "file")]
        with pytest.raises(readie.RequestError, match="no file 'missing'"):
            nb.download("missing")
        assert nb.run("say still here").stdout == "still here\n"


def test_the_async_session_does_the_same(tmp_path):
    async def go() -> tuple[bytes, list[str]]:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            async with pool.session() as nb:
                await nb.upload("a/b.txt", b"x" * (UPLOAD_CHUNK_BYTES + 1))
                return await nb.download("a/b.txt"), [entry.name for entry in await nb.files("a")]

    assert asyncio.run(go()) == (b"x" * (UPLOAD_CHUNK_BYTES + 1), ["b.txt"])
