"""Conformance, hibernation and forks: the real ``readie pool`` over pipes, real gVisor sandboxes.

``{"id", "session", "hibernate": true}`` answers ``{"hibernated": true}``;
``{"id", "session": "a", "fork": "b"}`` answers ``{"forked": "b"}``; a
session idle for ``session_hibernate`` hibernates on its own; the step
after either says ``resumed_ms``. Through a router (``--router``) a session
hibernates and forks on its worker and stays pinned there, the fork too
(decision 0022). Each check looks at ``runsc list`` of the pool's state dir
to see the sandbox really gone.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from readie_pool.testing import pool_placement
from readie_worker.state_dir import STORE

from conftest import CHECKPOINTS
from pool.tests.test_pool_sessions import Pool

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def pool(checkpoints) -> Iterator[Pool]:
    made = Pool("--workers", "3", "--max-sessions", "8", "--log=json")
    yield made
    assert made.process.close() == 0
    assert not made.state.exists(), "the pool's worker removes its state dir, images and all, at close"
    made.cleanup()


def step(pool: Pool, rid: str, session: str, code: str, **fields: Any) -> dict[str, Any]:
    return pool.process.run({"id": rid, "session": session, "code": code, **fields})


def hibernated_images(pool: Pool) -> list[Path]:
    """The stored images in the pool's own session store: each entry's generations."""
    return sorted((pool.state / STORE).glob("*/g*"))


def test_a_session_hibernates_on_request_and_resumes_at_its_next_step(pool):
    first = step(pool, "h1", "nb", "import json\nx = {'n': 41}\nprint('set')")
    assert (first["stdout"], first["step"]) == ("set\n", 1) and "resumed_ms" not in first
    before = set(pool.containers())
    answer = pool.process.run({"id": "h2", "session": "nb", "hibernate": True})
    assert list(answer) == ["id", "session", "hibernated", "hibernate_ms"], answer
    assert (answer["id"], answer["session"], answer["hibernated"]) == ("h2", "nb", True)
    assert type(answer["hibernate_ms"]) is int and answer["hibernate_ms"] > 0
    assert len(before - set(pool.containers())) == 1, "its sandbox is gone"
    assert len(hibernated_images(pool)) == 1
    stats = pool.stats()
    assert (stats["sessions_active"], stats["sessions_hibernated"]) == (1, 1)
    again = pool.process.run({"id": "h3", "session": "nb", "hibernate": True})
    assert (again["hibernated"], again["hibernate_ms"]) == (True, 0)  # already: nothing to do
    resumed = step(pool, "h4", "nb", "x['n'] += 1\nprint(json.dumps(x))")
    assert (resumed["stdout"], resumed["step"], resumed["session_ended"]) == ('{"n": 42}\n', 2, False), resumed
    assert type(resumed["resumed_ms"]) is int and resumed["resumed_ms"] > 0
    assert list(resumed)[-1] == "resumed_ms" or "resumed_ms" in resumed
    assert hibernated_images(pool) == []
    later = step(pool, "h5", "nb", "print(x['n'])")
    assert later["stdout"] == "42\n" and "resumed_ms" not in later
    images = pool.stats("s2")["session_images"]
    assert (images["hibernations"], images["resumes"]) == (1, 1), images
    assert pool.process.run({"id": "h6", "session": "nb", "close": True}) == {"id": "h6", "session": "nb", "closed": True}


def test_a_fork_copies_the_state_and_both_go_on_alone(pool):
    key_a = step(pool, "f1", "a", "state = ['a']")["session_key"]
    forked = pool.process.run({"id": "f2", "session": "a", "fork": "b"})
    assert list(forked) == ["id", "session", "forked", "fork_ms", "session_key"], forked
    assert len(forked["session_key"]) >= 43 and forked["session_key"] != key_a  # the fork's own (decision 32)
    assert (forked["session"], forked["forked"]) == ("a", "b") and forked["fork_ms"] > 0
    # The fork's first step is its own step 1; its permissions are a's, so none may be given.
    in_b = step(pool, "f3", "b", "state.append('b')\nprint(state)")
    assert (in_b["stdout"], in_b["step"]) == ("['a', 'b']\n", 1), in_b
    assert in_b["resumed_ms"] > 0
    in_a = step(pool, "f4", "a", "state.append('a2')\nprint(state)")
    assert (in_a["stdout"], in_a["step"]) == ("['a', 'a2']\n", 2), in_a
    assert step(pool, "f5", "b", "print(state)")["stdout"] == "['a', 'b']\n"
    refused = step(pool, "f6", "b", "pass", allow_read=["data"])
    assert refused["error"]["type"] == "RequestError" and "fixed its permissions" in refused["error"]["message"]
    for rid, name in (("f7", "a"), ("f8", "b")):
        assert pool.process.run({"id": rid, "session": name, "close": True})["closed"] is True
    assert hibernated_images(pool) == []


def test_steps_sent_right_behind_a_fork_wait_for_it(pool):
    step(pool, "q1", "src", "n = 7")
    pool.process.send(
        {"id": "q2", "session": "src", "fork": "dst"},
        {"id": "q3", "session": "dst", "code": "print(n * 6)"},
        {"id": "q4", "session": "src", "code": "print(n)"},
    )
    lines = {line["id"]: line for line in pool.process.results(3)}
    assert lines["q2"]["forked"] == "dst"
    assert lines["q3"]["stdout"] == "42\n", lines["q3"]
    assert lines["q4"]["stdout"] == "7\n", lines["q4"]
    for rid, name in (("q5", "src"), ("q6", "dst")):
        pool.process.run({"id": rid, "session": name, "close": True})


def test_refusals_name_the_field_and_leave_the_session_as_it_was(pool):
    missing = pool.process.run({"id": "r1", "session": "nobody", "hibernate": True})
    # session_ended: a client that took it for open (the pool closed it idle) learns it is not.
    assert (missing["error"]["type"], missing["session"], missing["session_ended"]) == ("RequestError", "nobody", True)
    assert "no open session named 'nobody'" in missing["error"]["message"]
    step(pool, "r2", "one", "x = 1")
    step(pool, "r3", "two", "x = 2")
    taken = pool.process.run({"id": "r4", "session": "one", "fork": "two"})
    assert taken["error"]["type"] == "RequestError" and "'two' is open already" in taken["error"]["message"]
    same = pool.process.run({"id": "r5", "session": "one", "fork": "one"})
    assert same["error"]["type"] == "RequestError" and same["error"]["message"].startswith("fork:")
    extra = pool.process.run({"id": "r6", "session": "one", "hibernate": True, "code": "pass"})
    assert extra["error"]["message"].startswith("code: not allowed in a hibernate request"), extra
    assert step(pool, "r7", "one", "print(x)")["stdout"] == "1\n"
    for rid, name in (("r8", "one"), ("r9", "two")):
        pool.process.run({"id": rid, "session": name, "close": True})


def test_an_idle_session_hibernates_on_its_own_then_closes_at_session_idle(checkpoints):
    pool = Pool("--workers", "2", "--session-hibernate", "1s", "--session-idle", "4s")
    try:
        step(pool, "i1", "idle", "kept = 'yes'")
        # Two warm sandboxes (one per worker, refilled after the session took one) and the session's.
        deadline = time.monotonic() + 15
        while len(pool.containers()) != 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        deadline = time.monotonic() + 15
        while pool.stats()["sessions_hibernated"] != 1 and time.monotonic() < deadline:
            time.sleep(0.2)
        assert pool.stats()["sessions_hibernated"] == 1
        assert len(pool.containers()) == 2
        woken = step(pool, "i2", "idle", "print(kept)")
        assert woken["stdout"] == "yes\n" and woken["resumed_ms"] > 0, woken
        # Idle again: it hibernates at 1 s and is closed at 4 s, as a session that never slept would be.
        deadline = time.monotonic() + 20
        while pool.stats()["sessions_active"] != 0 and time.monotonic() < deadline:
            time.sleep(0.2)
        stats = pool.stats()
        assert (stats["sessions_active"], stats["sessions_hibernated"]) == (0, 0), stats
        # The close that removes the image runs in the background of the table's change.
        deadline = time.monotonic() + 10
        while hibernated_images(pool) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert hibernated_images(pool) == []
        fresh = step(pool, "i3", "idle", "print('kept' in globals())")
        assert (fresh["stdout"], fresh["step"]) == ("False\n", 1)
    finally:
        pool.process.close()
        pool.cleanup()


def test_session_hibernate_must_be_shorter_than_session_idle(checkpoints, tmp_path):
    from readie_pool.testing import PoolProcess

    process = PoolProcess(
        ["--checkpoints", str(CHECKPOINTS), "--session-hibernate", "10m", "--session-idle", "5m"],
        cwd=tmp_path, stderr_path=tmp_path / "stderr.log",
    )
    assert process.wait() == 2
    assert "session_hibernate" in process.stderr_text() and "not shorter than session_idle" in process.stderr_text()


def test_through_a_router_a_session_hibernates_and_forks_on_its_worker(checkpoints, short_tmp):
    with pool_placement("router", short_tmp, CHECKPOINTS / "manifest.json") as args:
        pool = Pool("--workers", "2", *args)
        try:
            step(pool, "x1", "remote", "x = 5")
            answer = pool.process.run({"id": "x2", "session": "remote", "hibernate": True})
            assert (answer["hibernated"], answer["hibernate_ms"] > 0) == (True, True), answer
            assert pool.stats()["sessions_hibernated"] == 1
            # Pinned: the step goes to the worker whose disk holds the image, which restores it.
            resumed = step(pool, "x3", "remote", "x += 1\nprint(x)")
            assert (resumed["stdout"], resumed["step"], resumed["resumed_ms"] > 0) == ("6\n", 2, True), resumed
            # The fork stays on that worker too, reached by a stream of its own (attached by token).
            forked = pool.process.run({"id": "x4", "session": "remote", "fork": "copy"})
            assert (forked["forked"], forked["fork_ms"] > 0) == ("copy", True), forked
            in_copy = step(pool, "x5", "copy", "x *= 10\nprint(x)")
            assert (in_copy["stdout"], in_copy["step"], in_copy["resumed_ms"] > 0) == ("60\n", 1, True), in_copy
            assert step(pool, "x6", "remote", "print(x)")["stdout"] == "6\n"
            assert pool.stats()["sessions_active"] == 2
            for rid, name in (("x7", "copy"), ("x8", "remote")):
                assert pool.process.run({"id": rid, "session": name, "close": True})["closed"] is True
            assert pool.stats()["sessions_active"] == 0
        finally:
            pool.process.close()
            pool.cleanup()


def test_the_pools_max_sessions_reaches_its_worker(checkpoints):
    """Found by the soak at bench size: ``--max-sessions 64`` let the pool's table admit 64, but its
    worker kept its own default of 16 and refused the 17th with SandboxSetupError."""
    pool = Pool("--workers", "2", "--max-sessions", "18")
    try:
        for index in range(17):
            opened = step(pool, f"m{index}", f"many-{index}", "x = 1")
            assert opened["exit"] == 0, opened
        assert pool.stats()["sessions_active"] == 17
    finally:
        pool.process.close()
        pool.cleanup()
