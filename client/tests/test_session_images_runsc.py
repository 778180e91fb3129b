"""``Session.hibernate`` and ``Session.fork`` (and their async twins) on a real ``readie pool``, real gVisor sandboxes.

A hibernated session's sandbox is gone and its next step restores it
(``resumed_ms``); a fork is a second session, open at once, with the
parent's state, grants and host functions, and after it the two share
nothing. The pool's own side is pool/tests/test_pool_hibernate.py's.
"""

from __future__ import annotations

import asyncio

import pytest
import readie
from readie.testing import temp_pool

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def pool():
    with temp_pool(workers=2, checkpoints=CHECKPOINTS) as pool:
        (pool.cwd / "data").mkdir()
        (pool.cwd / "data" / "notes.txt").write_text("kept\n")
        yield pool
    # temp_pool's close checked that the pool drained and exited 0


def test_a_hibernated_session_resumes_with_its_state_at_its_next_step(pool):
    with pool.session(allow_read=["data"]) as session:
        first = session.run("x = {'n': 41}")
        assert first.ok and first.resumed_ms is None
        hibernate_ms = session.hibernate()
        assert type(hibernate_ms) is int and hibernate_ms > 0
        assert session.open  # on disk, still the pool's
        stats = pool.stats()
        assert (stats["sessions_active"], stats["sessions_hibernated"]) == (1, 1)
        assert session.hibernate() == 0  # already on disk: nothing to do
        # Its grants came back with it: the step carries none (the pool would refuse them).
        resumed = session.run("x['n'] += 1\nprint(x['n'], open('data/notes.txt').read().strip())")
        assert (resumed.stdout, resumed.step, resumed.session_ended) == ("42 kept\n", 2, False), resumed
        assert type(resumed.resumed_ms) is int and resumed.resumed_ms > 0
        later = session.run("print(x['n'])")
        assert later.stdout == "42\n" and later.resumed_ms is None
        assert pool.stats()["sessions_hibernated"] == 0
    assert pool.stats()["sessions_active"] == 0


def test_a_fork_has_the_parents_state_and_functions_and_goes_on_alone(pool):
    calls: list[str] = []

    def lookup(key: str) -> str:
        calls.append(key)
        return key.upper()

    with pool.session(allow_read=["data"], functions={"lookup": lookup}) as parent:
        parent.run("from readie_host import lookup\nstate = ['a']")
        with parent.fork() as fork:
            assert fork.open and fork.name != parent.name and fork.name.startswith("session-")
            assert fork.functions == parent.functions and fork.setup == parent.setup
            in_fork = fork.run("state.append('b')\nprint(state, lookup('fork'), open('data/notes.txt').read().strip())")
            assert (in_fork.stdout, in_fork.step) == ("['a', 'b'] FORK kept\n", 1), in_fork
            assert type(in_fork.resumed_ms) is int and in_fork.resumed_ms > 0
            in_parent = parent.run("state.append('a2')\nprint(state, lookup('parent'))")
            assert (in_parent.stdout, in_parent.step) == ("['a', 'a2'] PARENT\n", 2)
            assert fork.run("print(state)").stdout == "['a', 'b']\n"
            assert calls == ["fork", "parent"]

            with pytest.raises(readie.RequestError, match="open already") as taken:
                parent.fork(fork.name)
            assert not taken.value.result.session_ended
            with pytest.raises(readie.RequestError, match="name of its own"):
                parent.fork(parent.name)
            # Both refusals left both sessions as they were.
            assert parent.run("print(len(state))").stdout == "2\n"
            assert fork.run("print(len(state))").stdout == "2\n"

            named = fork.fork("grandchild")
            assert named.name == "grandchild" and named.run("print(state, lookup('g'))").stdout == "['a', 'b'] G\n"
            named.close()
            assert pool.stats()["sessions_active"] == 2
    assert pool.stats()["sessions_active"] == 0


def test_the_async_session_hibernates_and_forks(tmp_path):
    async def shout(text: str) -> str:
        await asyncio.sleep(0)
        return text.upper() + "!"

    async def main() -> None:
        async with readie.AsyncPool(workers=2, checkpoints=CHECKPOINTS, cwd=tmp_path) as pool:
            async with pool.session(functions={"shout": shout}) as session:
                await session.run("from readie_host import shout\nn = 1")
                hibernate_ms = await session.hibernate()
                assert type(hibernate_ms) is int and hibernate_ms > 0
                assert (await pool.stats())["sessions_hibernated"] == 1
                resumed = await session.run("n += 1\nprint(n)")
                assert resumed.stdout == "2\n" and type(resumed.resumed_ms) is int and resumed.resumed_ms > 0

                async with await session.fork() as fork:
                    assert fork.open
                    in_fork = await fork.run("n += 10\nprint(n, shout('fork'))")
                    assert (in_fork.stdout, in_fork.step) == ("12 FORK!\n", 1) and in_fork.resumed_ms > 0
                    assert (await session.run("print(n, shout('parent'))")).stdout == "2 PARENT!\n"
                    with pytest.raises(readie.RequestError, match="open already"):
                        await session.fork(fork.name)
                    assert (await fork.run("print(n)")).stdout == "12\n"
            assert (await pool.stats())["sessions_active"] == 0

    asyncio.run(main())
