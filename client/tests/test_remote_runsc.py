"""readie-style calls through a real ``readie router`` in front of two ``readie worker`` processes."""

from __future__ import annotations

import threading

import pytest
import readie
from readie.testing import local_router

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def cluster():
    with local_router(workers=2, checkpoints=CHECKPOINTS, warm="base=1", slots=2) as cluster:
        yield cluster
    # local_router checked that everything drained, exited 0 and left no sandbox


@pytest.fixture
def client(cluster):
    with readie.Client(cluster.address) as client:
        yield client


def word_count(text, *, lower=True):
    import collections

    words = text.lower().split() if lower else text.split()
    print(f"counting {len(words)} words")
    return dict(collections.Counter(words))


def divide(a, b):
    return a / b


def test_a_function_returns_its_value_and_prints_here(client, capsys):
    assert client.call(word_count, "The cat the hat") == {"the": 2, "cat": 1, "hat": 1}
    assert capsys.readouterr().out == "counting 4 words\n"
    result = client.call_result(word_count, "A a", lower=False)
    assert result == readie.RemoteResult({"A": 1, "a": 1}, ("counting 2 words\n",))
    assert capsys.readouterr().out == ""


def test_an_exception_raises_remote_error_with_the_remote_traceback(client):
    with pytest.raises(readie.RemoteError) as raised:
        client.call(divide, 1, 0)
    assert raised.value.exc_type == "ZeroDivisionError"
    assert raised.value.message == "division by zero"
    # cloudpickle sends the function's code without its file: the frame names
    # its line in this file and the function, under "<dynamic-code>".
    line = divide.__code__.co_firstlineno + 1
    assert f'File "<dynamic-code>", line {line}, in divide' in raised.value.traceback


def test_the_sandbox_is_the_boundary(client):
    def where():
        import os
        import socket

        try:
            socket.create_connection(("1.1.1.1", 53), timeout=2)
            network = "reachable"
        except OSError as exc:
            network = type(exc).__name__
        return os.path.exists("/readie/run"), network

    in_sandbox, network = client.call(where)
    assert in_sandbox is True and network != "reachable"


def test_the_decorator_and_a_preloaded_checkpoint(cluster):
    @readie.remote(checkpoint="pandas", router=cluster.address)
    def describe(values):
        import sys

        import pandas as pd

        return "pandas" in sys.modules, float(pd.Series(values).mean())

    assert describe([1, 2, 3, 6]) == (True, 3.0)
    assert describe.local.__name__ == "describe"


def test_calls_spread_over_both_workers(cluster, client):
    def nap():
        import time

        time.sleep(0.5)
        return "rested"

    answers: list[str] = []
    threads = [threading.Thread(target=lambda: answers.append(client.call(nap))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert answers == ["rested"] * 4
    served = [sum(1 for line in worker.log_lines() if line.get("rpc") == "Execute") for worker in cluster.workers]
    assert all(count > 0 for count in served), served


def test_refusals_and_version_mismatch(cluster, client, monkeypatch):
    wrong = readie.Client(cluster.address, checkpoint="nope")
    with wrong, pytest.raises(readie.RequestError, match="no checkpoint named 'nope'") as refused:
        wrong.call(divide, 1, 2)
    assert refused.value.field == "checkpoint"
    monkeypatch.setattr("readie._envelope.SANDBOX_PYTHON", (3, 12))
    with pytest.raises(readie.VersionMismatch, match="the sandboxes run Python 3.12.*this is Python 3.11"):
        client.call(divide, 1, 2)


def test_a_pool_can_run_its_jobs_through_the_router(cluster, tmp_path):
    (tmp_path / "out").mkdir()
    with readie.Pool(workers=2, router=cluster.address, cwd=tmp_path, checkpoints=CHECKPOINTS) as pool:
        result = pool.run("open('out/x', 'w').write('via router')\nprint('ok')", allow_write=["out"])
    assert result.raise_for_error().stdout == "ok\n"
    assert (tmp_path / "out" / "x").read_text() == "via router"


def test_a_pools_sessions_and_host_functions_work_through_the_router(cluster, tmp_path):
    notes: list[str] = []

    def remember(text: str) -> int:
        """Keep a note; returns how many there are."""
        notes.append(text)
        return len(notes)

    with readie.Pool(workers=2, router=cluster.address, cwd=tmp_path, checkpoints=CHECKPOINTS) as pool:
        with pool.session(functions={"remember": remember}) as session:
            session.run("from readie_host import remember\ntotal = 0").raise_for_error()
            for word in ("tea", "cake"):
                step = session.run(f"total += remember({word!r})\nprint(total)").raise_for_error()
        plain = pool.run("from readie_host import remember\nprint(remember('x'))", functions={"remember": remember})
    assert step.stdout == "3\n" and step.step == 3  # 1 + 2: the session's state lived on its worker
    assert plain.raise_for_error().stdout == "3\n" and notes == ["tea", "cake", "x"]
