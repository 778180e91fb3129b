"""``Pool`` against the real pool engine over pipes, its backend faked: demultiplexing, refusals,
host functions, sessions, stats and the drain, as a client meets them, without gVisor.

The engine is the one ``readie pool`` runs (``readie_pool.testing.serve_stdio``);
only the sandboxes are replaced (``engine_pool.py`` says what each verb does).
What only a broken pool does (garbage, dying, another protocol version) is
test_pool_fake.py's, against a stand-in that misbehaves on purpose.
"""

from __future__ import annotations

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


def test_the_ready_event_is_the_engines(pool):
    assert pool.ready == readie.ReadyEvent(
        workers=2, runtime="readie", preloaded_modules=(), package_dirs=(), config=None, profiles=(), protocol=1
    )


def test_results_reach_their_callers_in_completion_order(pool):
    answers: dict[str, str] = {}
    finished: list[str] = []

    def run(name: str, code: str) -> None:
        answers[name] = pool.run(code).stdout
        finished.append(name)

    slow = threading.Thread(target=run, args=("slow", "sleep 0.5\nsay slow"))
    slow.start()
    time.sleep(0.1)
    fast = [threading.Thread(target=run, args=(f"fast{i}", f"say fast{i}")) for i in range(4)]
    for thread in fast:
        thread.start()
    for thread in [slow, *fast]:
        thread.join(10)
    assert answers == {"slow": "slow\n", **{f"fast{i}": f"fast{i}\n" for i in range(4)}}
    assert finished[-1] == "slow"


def test_a_job_failure_is_a_result_and_the_engines_refusal_raises_with_its_line(pool):
    failed = pool.run("raise")
    assert not failed.ok and failed.exit == 1
    assert failed.error == readie.ErrorInfo("ValueError", "boom", "<string>", 1)
    with pytest.raises(readie.JobError, match=r"job 1 failed: ValueError: boom \(<string>, line 1\)"):
        failed.raise_for_error()
    with pytest.raises(readie.RequestError) as refused:
        pool.run("say never", profile="no-such-profile")
    assert "no-such-profile" in str(refused.value), refused.value
    assert refused.value.result is not None and refused.value.result.exit == -1
    assert refused.value.result.error.type == "RequestError"
    # What the pool's parser refuses is refused before sending, by the same check: no line, no result.
    with pytest.raises(readie.RequestError, match="timeout: 'soon' is not a duration") as refused:
        pool.run("say never", timeout="soon")
    assert refused.value.result is None
    assert pool.run("say fine").raise_for_error().stdout == "fine\n"


def test_a_host_function_is_answered_by_the_caller_through_the_engine(pool):
    result = pool.run("call add [2,3] {}\nsay after", functions={"add": lambda a, b: a + b})
    assert result.stdout == '{"result": 5}\nafter\n', result


def test_a_session_keeps_its_steps_in_order_and_ends_when_asked(pool):
    with pool.session() as session:
        first = session.run("say one")
        second = session.run("say two")
        assert (first.step, second.step, second.stdout) == (1, 2, "two\n")
        ended = session.run("exit")
        assert ended.session_ended
    assert pool.stats()["sessions_active"] == 0


def test_stats_are_the_engines_counters(pool):
    pool.run("say x")
    pool.run("raise")
    stats = pool.stats()
    assert (stats["event"], stats["jobs"], stats["ok"], stats["failed"]) == ("stats", 2, 1, 1)
    assert stats["errors"] == {"ValueError": 1}


def test_close_waits_for_the_drain(tmp_path):
    pool = readie.Pool(command=ENGINE, cwd=tmp_path)
    answers: list[str] = []
    waiting = threading.Thread(target=lambda: answers.append(pool.run("sleep 0.3\nsay drained").stdout))
    waiting.start()
    time.sleep(0.1)
    pool.close()
    waiting.join(10)
    assert answers == ["drained\n"]  # accepted before close, answered during the drain
    pool.close()  # again: nothing
    with pytest.raises(readie.PoolError, match="closed"):
        pool.run("say no")
