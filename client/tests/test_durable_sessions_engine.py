"""``Session.key``, ``pool.attach`` and a lost step, sync and async, against the real pool engine over
pipes with its backend faked (engine_pool.py: its store holds one session under STORED_KEY). A
session moving between two real pools through a real store is test_durable_sessions_runsc.py's."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import readie
from client.tests.engine_pool import STORED_KEY

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


def test_a_session_keeps_its_key_attach_continues_a_stored_one_and_a_lost_step_leaves_it_open(tmp_path):
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        session = pool.session()
        assert session.key is None  # nothing sent yet
        first = session.run("say one")
        assert session.key == first.session_key and len(session.key) >= 43
        assert session.key not in repr(session) and session.key not in repr(first)
        lost = session.run("lose")
        assert (lost.lost, lost.error.type, lost.session_ended, session.open) == (True, "PoolWorkerError", False, True)
        assert session.last_step == 1
        after = session.run("say two")
        assert (after.step, after.resumed_from_step, after.session_key) == (2, 1, None)
        assert session.key == first.session_key  # a later step keeps it

        attached = pool.attach("moved", STORED_KEY)
        assert (attached.name, attached.open, attached.key, attached.last_step) == ("moved", True, STORED_KEY, 4)
        assert attached.run("say on").step == 5
        with pytest.raises(readie.RequestError, match="^attach: ") as wrong:
            pool.attach("again", STORED_KEY)  # taken: the store holds it no more
        with pytest.raises(readie.RequestError, match="^attach: ") as unknown:
            pool.attach("again", "x" * 43)
        assert str(wrong.value) == str(unknown.value)
        with pytest.raises(readie.RequestError, match="^session: "):
            pool.attach(session.name, "x" * 43)  # a name open here
        with pytest.raises(TypeError):
            pool.attach("again", None)  # type: ignore[arg-type]
        attached.close()
        session.close()


def test_the_async_pool_attaches_the_same_way(tmp_path):
    async def main() -> None:
        async with readie.AsyncPool(command=ENGINE, cwd=tmp_path) as pool:
            session = pool.session()
            first = await session.run("say one")
            assert session.key == first.session_key is not None
            attached = await pool.attach("moved", STORED_KEY)
            assert isinstance(attached, readie.AsyncSession) and attached.last_step == 4
            assert (await attached.run("say on")).step == 5
            with pytest.raises(readie.RequestError, match="^attach: "):
                await pool.attach("again", STORED_KEY)
            await attached.close()
            await session.close()

    asyncio.run(main())
