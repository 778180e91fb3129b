"""``AsyncPool`` against the real pool engine over pipes (its backend scripted, engine_pool.py) and a pool that dies."""

from __future__ import annotations

import asyncio
import sys
import time
from pathlib import Path

import pytest
import readie

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]
FAKE = [sys.executable, str(Path(__file__).with_name("fake_pool.py"))]


def test_sixteen_concurrent_runs_from_one_loop_reach_their_callers(tmp_path):
    async def main() -> list[str]:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path, workers=4) as pool:
            assert pool.ready.workers == 4
            results = await asyncio.gather(*(pool.run(f"sleep {0.05 * (n % 3)}\nsay job{n}") for n in range(16)))
            stats = await pool.stats()
        assert stats["jobs"] == 16 and stats["ok"] == 16
        return [result.stdout for result in results]

    assert asyncio.run(main()) == [f"job{n}\n" for n in range(16)]


def test_host_functions_may_be_coroutines_or_plain_callables(tmp_path):
    async def lookup(word: str) -> dict[str, int]:
        await asyncio.sleep(0.01)
        return {"len": len(word)}

    def add(a: int, b: int) -> int:
        time.sleep(0.01)  # on a thread: the loop keeps going
        return a + b

    def broken() -> None:
        raise LookupError("not here")

    async def main() -> str:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            result = await pool.run(
                'call lookup ["tea"] {}\ncall add [2,3] {}\ncall broken [] {}',
                functions={"lookup": lookup, "add": add, "broken": broken},
            )
        return result.stdout

    assert asyncio.run(main()) == '{"result": {"len": 3}}\n{"result": 5}\n{"error": "not here"}\n'


def test_a_refusal_raises_with_its_result_and_the_pool_serves_on(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            with pytest.raises(readie.RequestError, match="no-such-profile") as refused:
                await pool.run("say never", profile="no-such-profile")
            assert refused.value.result is not None and refused.value.result.exit == -1
            with pytest.raises(readie.RequestError, match="timeout: 'soon' is not a duration") as refused:
                await pool.run("say never", timeout="soon")  # refused before sending, by the parser's check
            assert refused.value.result is None
            failed = await pool.run("raise")
            assert failed.exit == 1 and failed.error == readie.ErrorInfo("ValueError", "boom", "<string>", 1)
            assert (await pool.run("say fine")).stdout == "fine\n"

    asyncio.run(main())


def test_a_session_keeps_its_order_and_a_cancelled_step_ends_it(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            async with pool.session("nb") as session:
                first, second = await asyncio.gather(session.run("say one"), session.run("say two"))
                assert (first.step, second.step, first.stdout, second.stdout) == (1, 2, "one\n", "two\n")
                slow = asyncio.ensure_future(session.run("sleep 0.5\nsay late"))
                await asyncio.sleep(0.1)
                cancelled_at = time.monotonic()
                slow.cancel()
                with pytest.raises(asyncio.CancelledError):
                    await slow
                assert time.monotonic() - cancelled_at < 0.3, "the cancel returns at once; the close follows"
                assert not session.open
                again = await session.run("say fresh")
                assert again.step == 1, "a cancelled step ends the session: the next run is a new one"
            assert (await pool.stats())["sessions_active"] == 0

    asyncio.run(main())


def test_a_cancelled_run_stops_its_job_and_frees_the_slot(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path, workers=1) as pool:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.run("sleep 30\nsay dropped"), 0.2)
            started = time.monotonic()
            # One slot: the next job runs at once only if the cancel stopped the first.
            assert (await pool.run("say next")).stdout == "next\n"
            assert time.monotonic() - started < 5
            stats = await pool.stats()
            assert (stats["worker_errors"], stats["ok"]) == (1, 1)

    asyncio.run(main())


def test_a_pool_that_dies_fails_every_waiting_caller_and_says_why(tmp_path):
    async def main() -> None:
        pool = await readie.AsyncPool(command=FAKE, cwd=tmp_path).start()
        waiting = asyncio.ensure_future(pool.run("sleep 5\nsay late"))
        await asyncio.sleep(0.2)
        with pytest.raises(readie.PoolError, match="exited with status 7") as died:
            await pool.run("die")
        assert "fake pool: dying as asked" in str(died.value)
        with pytest.raises(readie.PoolError, match="exited with status 7"):
            await waiting
        with pytest.raises(readie.PoolError, match="status 7"):
            await pool.run("say again")
        with pytest.raises(readie.PoolError, match="exited with status 7"):
            await pool.close()

    asyncio.run(main())


def test_a_pool_that_never_gets_ready_is_stopped(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_POOL", "silent")

    async def main() -> None:
        with pytest.raises(readie.PoolError, match="not ready within 0.5 s"):
            await readie.AsyncPool(command=FAKE, cwd=tmp_path, start_timeout=0.5).start()

    asyncio.run(main())


def test_using_a_pool_before_start_says_so(tmp_path):
    async def main() -> None:
        with pytest.raises(readie.PoolError, match="not started"):
            await readie.AsyncPool(command=ENGINE, cwd=tmp_path).run("say x")

    asyncio.run(main())


def test_a_cancelled_start_leaves_no_process_and_the_pool_refuses_use(tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_POOL", "silent")

    async def main() -> None:
        pool = readie.AsyncPool(command=FAKE, cwd=tmp_path)
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(pool.start(), 0.3)
        assert pool._process is not None and pool._process.returncode is not None
        with pytest.raises(readie.PoolError, match="unusable"):
            await pool.start()
        with pytest.raises(readie.PoolError, match="closed|unusable"):
            await pool.run("say x")

    asyncio.run(main())
