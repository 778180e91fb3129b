"""Output callbacks and the wait timeout, sync and async, against the real pool engine over pipes
(its backend scripted: engine_pool.py streams each ``say`` and ``warn`` as it comes)."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from pathlib import Path

import pytest
import readie

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


def test_callbacks_get_each_piece_in_order_on_the_calling_thread_before_run_returns(tmp_path):
    seen: list[tuple[str, str, str]] = []
    caller = threading.current_thread().name
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        result = pool.run(
            "say one\nsleep 0.1\nwarn careful\nsay two",
            on_stdout=lambda text: seen.append(("out", text, threading.current_thread().name)),
            on_stderr=lambda text: seen.append(("err", text, threading.current_thread().name)),
        )
    assert seen == [("out", "one\n", caller), ("err", "careful\n", caller), ("out", "two\n", caller)]
    assert (result.stdout, result.stderr) == ("one\ntwo\n", "careful\n")  # the result still has it all


def test_a_job_without_callbacks_does_not_stream_and_one_callback_is_enough(tmp_path):
    seen: list[str] = []
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        assert pool.run("say quiet").stdout == "quiet\n"
        result = pool.run("say a\nwarn b", on_stderr=seen.append)
    assert seen == ["b\n"] and result.stdout == "a\n"


def test_a_session_step_streams_its_own_output(tmp_path):
    seen: list[str] = []
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool, pool.session() as session:
        session.run("say first")
        result = session.run("say second", on_stdout=seen.append)
    assert seen == ["second\n"] and result.step == 2


def test_a_callback_that_raises_cancels_the_job_and_the_pool_goes_on(tmp_path):
    def explode(text: str) -> None:
        raise RuntimeError(f"no thanks: {text.strip()}")

    with readie.Pool(command=ENGINE, cwd=tmp_path, workers=1) as pool:
        with pytest.raises(RuntimeError, match="no thanks: early"):
            pool.run("say early\nsleep 30\nsay late", on_stdout=explode)
        started = time.monotonic()
        assert pool.run("say next").stdout == "next\n"
        assert time.monotonic() - started < 5  # the cancel freed the one worker the 30 s job held


def test_wait_timeout_cancels_the_job_and_raises_a_timeout(tmp_path):
    with readie.Pool(command=ENGINE, cwd=tmp_path, workers=1) as pool:
        started = time.monotonic()
        with pytest.raises(readie.WaitTimeout) as caught:
            pool.run("sleep 30", wait_timeout=0.3)
        assert isinstance(caught.value, TimeoutError) and time.monotonic() - started < 5
        assert pool.run("say free again").stdout == "free again\n"  # its only worker was freed


def test_async_callbacks_may_be_coroutines_and_run_in_order(tmp_path):
    async def main() -> tuple[list[str], str]:
        seen: list[str] = []

        async def slow(text: str) -> None:
            await asyncio.sleep(0.02)
            seen.append(f"out:{text}")

        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            result = await pool.run("say 1\nsay 2\nwarn 3\nsay 4", on_stdout=slow, on_stderr=lambda t: seen.append(f"err:{t}"))
            async with pool.session() as session:
                await session.run("say s", on_stdout=lambda t: seen.append(f"step:{t}"))
        return seen, result.stdout

    seen, stdout = asyncio.run(main())
    assert seen == ["out:1\n", "out:2\n", "err:3\n", "out:4\n", "step:s\n"] and stdout == "1\n2\n4\n"


def test_async_wait_timeout_cancels_the_job(tmp_path):
    async def main() -> str:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path, workers=1) as pool:
            with pytest.raises(readie.WaitTimeout):
                await pool.run("sleep 30", wait_timeout=0.3)
            return (await asyncio.wait_for(pool.run("say free"), 5)).stdout

    assert asyncio.run(main()) == "free\n"


def test_async_a_callback_that_raises_cancels_the_job_and_its_own_timeout_error_is_not_a_wait_timeout(tmp_path):
    def explode(text: str) -> None:
        raise TimeoutError(f"my own: {text.strip()}")

    async def main() -> str:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path, workers=1) as pool:
            with pytest.raises(TimeoutError, match="my own: early") as caught:
                await pool.run("say early\nsleep 30", on_stdout=explode, wait_timeout=60)
            assert not isinstance(caught.value, readie.WaitTimeout)
            return (await asyncio.wait_for(pool.run("say free"), 5)).stdout  # the cancel freed the one worker

    assert asyncio.run(main()) == "free\n"


def test_a_session_step_whose_callback_raises_is_cancelled_and_ends_the_session(tmp_path):
    def explode(text: str) -> None:
        raise RuntimeError("stop")

    with readie.Pool(command=ENGINE, cwd=tmp_path, workers=1) as pool:
        session = pool.session()
        session.run("say opened")
        with pytest.raises(RuntimeError, match="stop"):
            session.run("say step\nsleep 30", on_stdout=explode)
        assert not session.open
        started = time.monotonic()
        assert session.run("say again").step == 1  # a new session: the old one ended
        assert time.monotonic() - started < 5  # the cancel stopped the 30 s step holding the one worker
