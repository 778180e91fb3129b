"""Host functions from Python: ``Pool.run(functions=...)``, sessions and tools against a real ``readie pool``."""

from __future__ import annotations

import threading

import pytest
import readie
from readie.testing import temp_pool

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def pool():
    with temp_pool(workers=2, checkpoints=CHECKPOINTS) as pool:
        yield pool


def search(query: str, limit: int = 10) -> list[str]:
    """Search the index; at most ``limit`` titles."""
    return ["first hit", "second hit"][:limit]


def test_the_spec_example(pool):
    threads = set()

    def watched_search(query, limit=10):
        threads.add(threading.current_thread().name)
        return search(query, limit)

    code = "from readie_host import search\nprint(search('readie', limit=2))"
    result = pool.run(code, functions={"search": watched_search}).raise_for_error()
    assert result.stdout == "['first hit', 'second hit']\n"
    assert len(threads) == 1 and threads.pop().startswith("readie-host")  # not the reader thread


def test_an_exception_here_is_host_error_there(pool):
    def lookup(key):
        raise KeyError(f"no such key: {key}")

    code = (
        "from readie_host import lookup, HostError\n"
        "try:\n"
        "    lookup('k')\n"
        "except HostError as exc:\n"
        "    print('caught', exc)\n"
    )
    assert pool.run(code, functions={"lookup": lookup}).stdout == "caught 'no such key: k'\n"


def test_a_stateful_tool_calls_host_functions_in_every_step(pool):
    notes: list[str] = []

    def remember(text: str) -> int:
        """Store a note for the user; returns how many notes there are."""
        notes.append(text)
        return len(notes)

    with readie.tool(pool=pool, session=True, functions={"remember": remember, "search": search}) as tool:
        assert "- remember(text: str) -> int" in tool.description
        assert tool("from readie_host import search, remember\nhits = search('tea')") == "(no output)"
        assert tool("print(remember(hits[0]), remember(hits[1]))") == "1 2"
    assert notes == ["first hit", "second hit"]


