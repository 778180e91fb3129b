"""``readie.AsyncPool`` driving a real ``readie pool``: jobs in gVisor sandboxes, awaited from one event loop."""

from __future__ import annotations

import asyncio
import time

import pytest
import readie

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


def test_sixteen_awaited_jobs_an_async_host_function_and_a_session(tmp_path):
    calls: list[str] = []

    async def search(query: str, limit: int = 1) -> list[str]:
        calls.append(query)
        await asyncio.sleep(0.01)
        return [f"{query}-{n}" for n in range(limit)]

    async def main() -> None:
        async with readie.AsyncPool(workers=2, checkpoints=CHECKPOINTS, cwd=tmp_path) as pool:
            started = time.monotonic()
            results = await asyncio.gather(*(pool.run(f"print({n} * {n})") for n in range(16)))
            assert [result.stdout for result in results] == [f"{n * n}\n" for n in range(16)]
            assert all(result.ok and result.policy.backend.startswith("gvisor:") for result in results)
            # Sixteen fresh sandboxes on two slots: the loop never waited on one job at a time.
            assert time.monotonic() - started < 16 * 2.0

            hit = await pool.run(
                "from readie_host import search\nprint(search('readie', limit=2))", functions={"search": search}
            )
            assert hit.stdout == "['readie-0', 'readie-1']\n" and calls == ["readie"]

            async with pool.session() as session:
                await session.run("x = 41")
                step = await session.run("x += 1\nprint(x)")
                assert (step.stdout, step.step) == ("42\n", 2)
            stats = await pool.stats()
            assert stats["jobs"] == 19 and stats["sessions_active"] == 0

    asyncio.run(main())


def test_a_cancelled_step_frees_the_sessions_sandbox_and_the_pool_serves_on(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(workers=1, checkpoints=CHECKPOINTS, cwd=tmp_path) as pool:
            session = pool.session(timeout="3s")
            await session.run("import time")
            slow = asyncio.ensure_future(session.run("time.sleep(60)"))
            await asyncio.sleep(0.5)
            slow.cancel()
            with pytest.raises(asyncio.CancelledError):
                await slow
            # The close waits for the step (its 3 s timeout); then the one slot is free again.
            result = await asyncio.wait_for(pool.run("print('after')"), 30)
            assert result.stdout == "after\n"
            assert (await pool.stats())["sessions_active"] == 0

    asyncio.run(main())


def test_a_cancelled_run_stops_its_job_and_frees_the_sandbox(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(workers=1, checkpoints=CHECKPOINTS, cwd=tmp_path) as pool:
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(pool.run("import time\ntime.sleep(60)", timeout="90s"), 2)
            started = time.monotonic()
            # One slot: this runs now only because the cancel stopped the sleeping job.
            result = await asyncio.wait_for(pool.run("print('next')"), 30)
            assert result.stdout == "next\n" and time.monotonic() - started < 15
            stats = await pool.stats()
            assert (stats["worker_errors"], stats["ok"]) == (1, 1)

    asyncio.run(main())
