"""Files in the pool engine, in memory (decision 31): a job's and a step's files and collect, and a
session's upload, download and list requests, over the fake backend's workspace. No gVisor.

The real process against real sandboxes is test_pool_transfers.py.
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
from pathlib import Path

from readie_policy.config import parse_config
from readie_pool._engine import PoolEngine, PoolSetup
from readie_pool._events import RuntimeInfo
from readie_pool.testing import FakeBackend, MemorySink, MemorySource
from readie_protocol.workspace import FileChunk

RUNTIME = RuntimeInfo.pool("3.11.2")


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def setup_for(cwd: Path, workers: int = 1, config: str | None = None) -> PoolSetup:
    extra = {} if config is None else {"config": parse_config(config, cwd / "readie.toml")}
    return PoolSetup(workers=workers, checkpoint="base", runtime=RUNTIME, cwd=cwd, **extra)


def serve(setup, scenario, backend=None):
    async def main():
        fake = backend or FakeBackend()
        source, sink = MemorySource(), MemorySink()
        engine = PoolEngine(setup, fake)
        serving = asyncio.create_task(engine.serve(source, sink))
        await scenario(source, sink, fake)
        source.end()
        code = await asyncio.wait_for(serving, 5)
        return code, sink.lines[1:], fake

    code, lines, fake = asyncio.run(main())
    assert code == 0
    return lines, fake


def error_of(line):
    return line["error"] and (line["error"]["type"], line["error"]["message"])


def test_a_jobs_files_reach_its_job_and_what_it_collects_comes_back(tmp_path):
    async def scenario(source, sink, fake):
        source.feed_lines(
            {"id": 1, "code": "x", "files": {"data//orders.csv": b64(b"a,b\n"), "out/chart.png": b64(b"\x89PNG")},
             "collect": ["out/*.png", "report.xlsx"]},
            {"id": 2, "code": "y"},
        )
        await sink.wait_for(3)

    lines, fake = serve(setup_for(tmp_path), scenario)
    by_id = {line["id"]: line for line in lines}
    assert fake.started[0].files == (("data/orders.csv", b"a,b\n"), ("out/chart.png", b"\x89PNG"))
    assert fake.started[0].collect == ("out/*.png", "report.xlsx")
    assert by_id[1]["collected"] == {"out/chart.png": b64(b"\x89PNG")}
    assert by_id[1]["left_out"] == [{"path": "report.xlsx", "reason": "unreadable", "size": None}]
    assert by_id[1]["left_out_more"] == 0
    assert "collected" not in by_id[2] and "left_out" not in by_id[2]  # it asked for nothing


def test_the_ceiling_bounds_what_comes_back(tmp_path):
    config = "[pool.limits]\ncollect_files = 1\ncollect_bytes = 3\n"

    async def scenario(source, sink, fake):
        source.feed_lines({"id": 1, "code": "x", "files": {"a": b64(b"12"), "b": b64(b"3"), "c": b64(b"4567")},
                           "collect": ["c", "a", "b"]})
        await sink.wait_for(2)

    (line,), fake = serve(setup_for(tmp_path, config=config), scenario)
    assert (fake.started[0].collect_files, fake.started[0].collect_bytes) == (1, 3)
    assert line["collected"] == {"a": b64(b"12")}
    assert [(entry["path"], entry["reason"]) for entry in line["left_out"]] == [("c", "size"), ("b", "count")]


def test_a_session_moves_files_in_order_with_its_steps(tmp_path):
    async def scenario(source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "open", "files": {"seed.txt": b64(b"seed")}},
            {"id": 2, "session": "nb", "upload": "in/data.bin", "size": 6, "offset": 0, "data": b64(b"abc")},
            {"id": 3, "session": "nb", "upload": "in/data.bin", "size": 6, "offset": 3, "data": b64(b"def")},
            {"id": 4, "session": "nb", "download": "in/data.bin", "offset": 2},
            {"id": 5, "session": "nb", "list": "."},
            {"id": 6, "session": "nb", "list": "in"},
            {"id": 7, "session": "nb", "code": "step", "collect": ["in/data.bin", "seed.txt"]},
        )
        await sink.wait_for(8)

    lines, fake = serve(setup_for(tmp_path), scenario)
    assert [line["id"] for line in lines] == [1, 2, 3, 4, 5, 6, 7]  # one session: its order
    assert lines[1] == {"id": 2, "event": "uploaded", "session": "nb", "path": "in/data.bin", "received": 3, "size": 6}
    assert lines[2]["received"] == 6
    assert lines[3] == {"id": 4, "event": "file_chunk", "session": "nb", "path": "in/data.bin", "offset": 2, "size": 6,
                        "modified_ns": 0, "data": b64(b"cdef")}
    assert lines[4]["entries"] == [{"name": "in", "size": 0, "kind": "dir"}, {"name": "seed.txt", "size": 4, "kind": "file"}]
    assert lines[5] == {"id": 6, "event": "listing", "session": "nb", "path": "in", "truncated": False,
                        "entries": [{"name": "data.bin", "size": 6, "kind": "file"}]}
    assert lines[6]["collected"] == {"in/data.bin": b64(b"abcdef"), "seed.txt": b64(b"seed")}
    assert lines[6]["step"] == 2 and not lines[6]["session_ended"]


def test_refused_transfers_are_results_and_the_session_and_pool_go_on(tmp_path):
    async def scenario(source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "open"},
            {"id": 2, "session": "gone", "download": "a"},  # no such session
            {"id": 3, "session": "nb", "upload": "a", "size": 100, "offset": 0, "data": b64(b"x")},  # past the ceiling
            {"id": 4, "session": "nb", "download": "missing"},
            {"id": 5, "session": "nb", "upload": "a", "size": 4, "offset": 2, "data": b64(b"x")},  # not where it ends
            {"id": 6, "session": "nb", "upload": "../a", "size": 1, "offset": 0, "data": b64(b"x")},  # the parser's
            {"id": 7, "session": "nb", "code": "still here"},
            {"id": "s", "stats": True},
        )
        await sink.wait_for(9)

    lines, fake = serve(setup_for(tmp_path, config="[pool.limits]\ntransfer_bytes = 10\n"), scenario)
    by_id = {line["id"]: line for line in lines}
    assert error_of(by_id[2]) == ("RequestError", "session: no open session named 'gone' (never opened, closed, or ended)")
    assert by_id[2]["session_ended"] is True and by_id[2]["exit"] == -1
    assert error_of(by_id[3]) == ("RequestError", "size: a file of 100 bytes is larger than the pool's transfer_bytes of 10")
    assert error_of(by_id[4]) == ("RequestError", "download: no file 'missing' in the workspace")
    assert error_of(by_id[5])[1].startswith("offset: starts at 2")
    assert error_of(by_id[6])[1].startswith("upload: must not contain '..'")
    for request_id in (3, 4, 5):
        assert by_id[request_id]["session"] == "nb" and by_id[request_id]["session_ended"] is False
    assert by_id[7]["exit"] == 0 and by_id[7]["step"] == 2
    assert by_id["s"]["request_errors"] == 5 and by_id["s"]["sessions_active"] == 1
    assert fake.transfers == ["missing", "a"]  # the refused-early ones never reached the backend


def test_a_backend_answering_out_of_bounds_ends_the_session_not_the_pool(tmp_path):
    async def scenario(source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "code": "open", "files": {"a": b64(b"abc")}})
        await sink.wait_for(2)
        session = fake.sessions[0]
        honest = session.download_chunk

        async def lying(path, offset, length):
            chunk = await honest(path, offset, length)
            return dataclasses.replace(chunk, data=chunk.data * 2)  # past the file's end

        session.download_chunk = lying
        source.feed_lines({"id": 2, "session": "nb", "download": "a"})
        await sink.wait_for(3)
        source.feed_lines({"id": 3, "session": "nb", "code": "again"}, {"id": 4, "code": "a job"})
        await sink.wait_for(5)

    lines, fake = serve(setup_for(tmp_path), scenario)
    by_id = {line["id"]: line for line in lines}
    assert by_id[2]["error"]["type"] == "PoolWorkerError" and by_id[2]["session_ended"] is True
    assert "not a chunk it may send" in by_id[2]["error"]["message"]
    assert fake.sessions[0].closes == 1  # the session ended with the lie
    assert by_id[3]["step"] == 1 and len(fake.sessions) == 2  # so its name opens a new one
    assert by_id[4]["exit"] == 0


def test_other_sessions_steps_run_between_the_chunks_of_a_transfer(tmp_path):
    """A chunk holds a worker's slot while it moves and gives it up before the next: with one slot
    left (a step of C holds the other), B's step waiting for it runs between A's chunks."""

    async def scenario(source, sink, fake):
        source.feed_lines(*({"id": name, "session": name, "code": "open"} for name in "ABC"))
        await sink.wait_for(4)
        fake.gates.update(big=asyncio.Event(), hold=asyncio.Event())
        source.feed_lines({"id": "c2", "session": "C", "code": "hold"})
        source.feed_lines(*({"id": f"up{i}", "session": "A", "upload": "big", "size": 2, "offset": i,
                             "data": b64(b"x")} for i in range(2)))
        while fake.transfers != ["big"]:  # the first chunk holds the other slot
            await asyncio.sleep(0.001)
        source.feed_lines({"id": "b2", "session": "B", "code": "meanwhile"})
        await asyncio.sleep(0.05)
        fake.gates["big"].set()
        await sink.wait_for(7)
        fake.gates["hold"].set()
        await sink.wait_for(8)

    lines, fake = serve(setup_for(tmp_path, workers=2), scenario)
    assert [line["id"] for line in lines[3:]] == ["up0", "b2", "up1", "c2"]
    assert fake.most_running == 2


def test_a_lying_chunk_is_caught_whatever_it_gets_wrong(tmp_path):
    from readie_policy.jobs import CodeJob
    from readie_protocol.errors import PoolWorkerError
    from readie_protocol.transfers import DownloadChunk
    from readie_pool._transfers import move

    job = CodeJob(checkpoint="base", code="")
    request = DownloadChunk(1, "nb", "a", 4)

    class Session:
        def __init__(self, chunk: FileChunk) -> None:
            self.chunk = chunk

        async def download_chunk(self, path, offset, length):
            return self.chunk

    good = FileChunk("a", 4, 10, 0, b"efghij")
    assert asyncio.run(move(Session(good), request, job)).chunk == good
    for lie in (dataclasses.replace(good, path="b"), dataclasses.replace(good, offset=0),
                dataclasses.replace(good, size=5), dataclasses.replace(good, data=b"x" * (1024 * 1024 + 1),
                                                                         size=2**30)):
        try:
            asyncio.run(move(Session(lie), request, job))
        except PoolWorkerError:
            continue
        raise AssertionError(f"{lie} passed")
