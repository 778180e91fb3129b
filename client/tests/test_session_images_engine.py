"""``Session.hibernate`` and ``Session.fork`` against the real pool engine over pipes, its backend faked.

The fake backend cannot checkpoint (``FakeBackend`` refuses both with a
RequestError): what this shows is the client's side, the refusal raised as
the typed error with the session going on, and a session with nothing in
the pool answered without asking it. Hibernating and forking for real is
test_session_images_runsc.py's.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import readie

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


@pytest.fixture
def pool(tmp_path):
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        yield pool


def test_a_refused_hibernate_or_fork_raises_request_error_and_the_session_goes_on(pool):
    session = pool.session(env={"A": "1"})
    assert session.run("say one").step == 1
    with pytest.raises(readie.RequestError, match="cannot hibernate") as refused:
        session.hibernate()
    assert refused.value.result.session == session.name and not refused.value.result.session_ended
    with pytest.raises(readie.RequestError, match="cannot fork"):
        session.fork("copy")
    assert session.open
    again = session.run("say two")  # no setup resent: the pool would refuse env on an open session
    assert (again.stdout, again.step) == ("two\n", 2)
    # The refused fork's name was given back: a session of that name opens afresh.
    assert pool.session("copy").run("say fresh").step == 1
    session.close()


def test_a_session_with_nothing_in_the_pool_is_answered_here(pool):
    session = pool.session()
    assert session.hibernate() == 0  # nothing held, nothing to free: as close() does nothing
    with pytest.raises(readie.RequestError, match="not open") as refused:
        session.fork()
    assert refused.value.result is None  # raised here: the pool was not asked
    assert pool.stats()["jobs"] == 0
    ended = session.run("exit")
    assert ended.session_ended and not session.open
    assert session.hibernate() == 0
    with pytest.raises(readie.RequestError, match="nothing to fork"):
        session.fork("later")
    with pytest.raises(TypeError, match="name: expected a str"):
        session.fork(7)  # type: ignore[arg-type]


def test_the_async_session_raises_the_same(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            session = pool.session()
            assert await session.hibernate() == 0
            with pytest.raises(readie.RequestError, match="not open"):
                await session.fork()
            await session.run("say one")
            with pytest.raises(readie.RequestError, match="cannot hibernate"):
                await session.hibernate()
            with pytest.raises(readie.RequestError, match="cannot fork"):
                await session.fork()
            assert session.open and (await session.run("say two")).step == 2
            await session.close()
            assert (await pool.stats())["sessions_active"] == 0

    asyncio.run(main())
