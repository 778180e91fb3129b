"""The async remote calls (``Client.call_async``, ``call_result_async``, ``RemoteFunction.aio``)
through a real ``readie router`` and two ``readie worker`` processes, awaited from one event loop:
the sync call's values, errors and echo, and a cancelled await that frees its sandbox."""

from __future__ import annotations

import asyncio
import time

import pytest
import readie
from readie.testing import local_router
from readie_rpc.client import WorkerClient
from readie_rpc.testing import Cluster
from readie_worker.testing import wait_until

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

# After a cancel, the worker has destroyed the sandbox and freed its slot within this long.
FREED_WITHIN_S = 5.0
# A cancelled await itself returns at once: it waits for nothing but the loop.
RETURNS_WITHIN_S = 0.5


@pytest.fixture(scope="module")
def cluster():
    # Eight slots in all, so eight concurrent calls all run at once.
    with local_router(workers=2, checkpoints=CHECKPOINTS, warm="base=1", slots=4) as cluster:
        yield cluster
    # local_router checked that everything drained, exited 0 and left no sandbox


@pytest.fixture
def client(cluster):
    with readie.Client(cluster.address, timeout=120) as client:
        yield client


def word_count(text, *, lower=True):
    import collections

    words = text.lower().split() if lower else text.split()
    print(f"counting {len(words)} words")
    return dict(collections.Counter(words))


def divide(a, b):
    print(f"dividing {a} by {b}")
    return a / b


def nap(seconds):
    import time

    time.sleep(seconds)
    return "rested"


def busy(cluster: Cluster) -> list[int]:
    """Each worker's busy slots, asked of the worker itself (not the router's view)."""
    counts = []
    for worker in cluster.workers:
        direct = WorkerClient(f"127.0.0.1:{worker.port}")
        try:
            counts.append(direct.capacity(5)[0].busy)
        finally:
            direct.close()
    return counts


def all_containers(cluster: Cluster) -> set[str]:
    return {name for names in cluster.containers().values() for name in names}


def test_eight_concurrent_awaits_return_their_values(cluster):
    @readie.remote(router=cluster.address, timeout=120)
    def square_after_a_nap(n):
        import time

        started = time.time()
        time.sleep(2)
        return n * n, started, time.time()

    async def main() -> None:
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                await asyncio.sleep(0.05)
                ticks += 1

        ticker = asyncio.create_task(tick())
        started = time.monotonic()
        answers = await asyncio.gather(*(square_after_a_nap.aio(n) for n in range(8)))
        elapsed = time.monotonic() - started
        ticker.cancel()
        assert [square for square, _, _ in answers] == [n * n for n in range(8)]
        # All eight were in their sandboxes at the same moment: none waited for another
        # (a thread pool of the loop's default size, 6 on this machine, would have).
        assert max(start for _, start, _ in answers) < min(end for _, _, end in answers), answers
        # And the loop ran on meanwhile (about elapsed / 0.05 ticks).
        assert ticks > elapsed / 0.05 / 2, (ticks, elapsed)

    asyncio.run(main())


def test_an_exception_in_the_sandbox_raises_remote_error_from_the_await(cluster, client, capsys):
    async def main() -> None:
        with pytest.raises(readie.RemoteError) as raised:
            await client.call_async(divide, 1, 0)
        assert raised.value.exc_type == "ZeroDivisionError" and raised.value.message == "division by zero"
        line = divide.__code__.co_firstlineno + 2
        assert f'File "<dynamic-code>", line {line}, in divide' in raised.value.traceback
        assert raised.value.output == ("dividing 1 by 0\n",)
        with pytest.raises(readie.RemoteError, match="ZeroDivisionError"):
            await readie.remote(router=cluster.address)(divide).aio(2, 0)

    asyncio.run(main())
    # What it printed before raising is echoed, as by the sync call.
    assert capsys.readouterr().out == "dividing 1 by 0\ndividing 2 by 0\n"


def test_echo_output_is_the_sync_calls(cluster, client, capsys):
    async def main() -> None:
        assert await client.call_async(word_count, "The cat the hat") == {"the": 2, "cat": 1, "hat": 1}
        assert capsys.readouterr().out == "counting 4 words\n"
        result = await client.call_result_async(word_count, "A a", lower=False)
        assert result == readie.RemoteResult({"A": 1, "a": 1}, ("counting 2 words\n",))
        assert capsys.readouterr().out == ""
        with readie.Client(cluster.address, echo_output=False) as quiet:
            assert await quiet.call_async(word_count, "x y") == {"x": 1, "y": 1}
            with pytest.raises(readie.RemoteError):
                await quiet.call_async(divide, 1, 0)
        assert capsys.readouterr().out == ""

    asyncio.run(main())
    # The same calls, sync, print the same.
    client.call(word_count, "The cat the hat")
    assert capsys.readouterr().out == "counting 4 words\n"


def test_refusals_timeouts_and_version_mismatch_from_the_await(cluster, client, monkeypatch):
    async def main() -> None:
        with readie.Client(cluster.address, checkpoint="nope") as wrong:
            with pytest.raises(readie.RequestError, match="no checkpoint named 'nope'") as refused:
                await wrong.call_async(divide, 1, 2)
        assert refused.value.field == "checkpoint"
        with readie.Client(cluster.address, timeout=1) as hasty:
            with pytest.raises(readie.CallTimeout):
                await hasty.call_async(nap, 10)
        monkeypatch.setattr("readie._envelope.SANDBOX_PYTHON", (3, 12))
        with pytest.raises(readie.VersionMismatch, match="the sandboxes run Python 3.12.*this is Python 3.11"):
            await client.call_async(divide, 1, 2)

    asyncio.run(main())
    assert wait_until(lambda: busy(cluster) == [0, 0], FREED_WITHIN_S)


async def _cancelled_frees_its_sandbox(cluster: Cluster, stop) -> None:
    """Starts a 60 s call, ``await stop(task)`` once it runs, and checks that its sandbox goes at once."""
    seen: set[str] = set()

    def running() -> bool:
        if sum(busy(cluster)) != 1:
            return False
        seen.update(all_containers(cluster))  # the call's sandbox, and warm ones
        return True

    task = asyncio.create_task(readie.remote(router=cluster.address, timeout=120)(nap).aio(60))
    assert await asyncio.to_thread(wait_until, running, 30)
    await asyncio.sleep(1)
    seen.update(all_containers(cluster))
    stopped_at = time.monotonic()
    await stop(task)
    assert time.monotonic() - stopped_at < RETURNS_WITHIN_S
    assert task.cancelled()

    def freed() -> bool:
        # Warm sandboxes stay until a call takes one: what vanished is the call's.
        return busy(cluster) == [0, 0] and bool(seen - all_containers(cluster))

    assert await asyncio.to_thread(wait_until, freed, FREED_WITHIN_S), (busy(cluster), seen, cluster.containers())
    assert time.monotonic() - stopped_at < FREED_WITHIN_S


def test_cancelling_the_awaiting_task_cancels_the_call_and_frees_the_sandbox(cluster, client):
    async def cancel(task: asyncio.Task) -> None:
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    async def give_up(task: asyncio.Task) -> None:
        # asyncio.wait_for's timeout is a cancel too (of the task that awaits the call).
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(task, 0.01)

    async def main() -> None:
        await _cancelled_frees_its_sandbox(cluster, cancel)
        await _cancelled_frees_its_sandbox(cluster, give_up)
        # The client serves on after its calls were cancelled.
        assert await client.call_async(divide, 6, 3) == 2.0

    asyncio.run(main())
    # The router saw its callers cancel (and cancelled its own calls to the workers).
    router_log = cluster.log_path.read_text().splitlines()
    cancelled = [line for line in router_log if "rpc=Execute" in line and "status=CANCELLED" in line]
    assert len(cancelled) == 2, router_log[-20:]
