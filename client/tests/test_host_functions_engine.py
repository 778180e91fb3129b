"""Host functions in ``Pool.run`` against the real pool engine with a faked backend: call events in,
replies out. No gVisor.

The backend (``engine_pool.py``) makes a host call for ``call NAME ARGS
KWARGS`` and prints the reply's answer (``{"result": ...}`` or
``{"error": ...}``) as the job's stdout, so each test sees exactly what the
client sent back, through the engine's own call and reply handling.
"""

from __future__ import annotations

import json
import sys
import threading
import time
from pathlib import Path

import pytest
import readie

ENGINE = [sys.executable, str(Path(__file__).with_name("engine_pool.py"))]


@pytest.fixture
def pool(tmp_path):
    with readie.Pool(command=ENGINE, cwd=tmp_path) as pool:
        yield pool


def answer(result: readie.Result) -> dict:
    return json.loads(result.stdout)


def search(query: str, limit: int = 10) -> list[str]:
    return ["first hit", "second hit"][:limit]


def test_a_call_runs_the_callable_here_and_the_reply_carries_its_value(pool):
    result = pool.run('call search ["readie"] {"limit":2}', functions={"search": search})
    assert answer(result) == {"result": ["first hit", "second hit"]}


def test_exceptions_and_unsendable_values_become_error_replies(pool):
    def broken(*args):
        raise ConnectionError("backend unavailable")

    functions = {"broken": broken, "silent": lambda: exec("raise KeyError()"), "odd": lambda: {1, 2}}
    assert answer(pool.run("call broken [] {}", functions=functions)) == {"error": "backend unavailable"}
    assert answer(pool.run("call silent [] {}", functions=functions)) == {"error": "KeyError"}
    odd = answer(pool.run("call odd [] {}", functions=functions))["error"]
    assert odd.startswith("odd returned a value that cannot be sent: set is not JSON")
    # A name this job did not declare (the real pool never forwards one) is still answered.
    assert answer(pool.run("call nope [] {}", functions=functions)) == {
        "error": "nope: this client has no such host function for the task"
    }


def test_each_request_calls_its_own_functions(pool):
    results = {}

    def run(tag):
        results[tag] = pool.run("sleep 0.1\ncall who [] {}", functions={"who": lambda: tag})

    threads = [threading.Thread(target=run, args=(tag,)) for tag in ("a", "b", "c")]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert {tag: answer(result)["result"] for tag, result in results.items()} == {"a": "a", "b": "b", "c": "c"}


def test_a_slow_function_does_not_hold_up_other_results(pool):
    def slow():
        time.sleep(1)
        return "slow"

    slow_result = {}
    thread = threading.Thread(target=lambda: slow_result.update(r=pool.run("call slow [] {}", functions={"slow": slow})))
    thread.start()
    time.sleep(0.2)
    started = time.monotonic()
    assert pool.run("say quick").stdout == "quick\n"
    assert time.monotonic() - started < 0.5
    thread.join()
    assert answer(slow_result["r"]) == {"result": "slow"}


def test_functions_are_checked_before_anything_is_sent(pool):
    with pytest.raises(readie.RequestError, match="functions: 'HostError' is reserved"):
        pool.run("x", functions={"HostError": search})
    with pytest.raises(readie.RequestError, match="is not a Python identifier"):
        pool.run("x", functions={"not a name": search})
    with pytest.raises(TypeError, match="not a callable"):
        pool.run("x", functions={"search": "search"})
    with pytest.raises(TypeError, match="mapping"):
        pool.run("x", functions=[search])
    assert pool.stats()["jobs"] == 0  # nothing reached the pool


def test_a_function_that_runs_a_job_of_its_own_gets_its_result(pool):
    # Calls run off the thread that reads the pool's output, so the inner job's result is read
    # while the outer call waits for it.
    def nested() -> str:
        return pool.run("say inner").stdout.strip()

    result = pool.run("call nested [] {}", functions={"nested": nested}, wait_timeout=30)
    assert answer(result) == {"result": "inner"}
