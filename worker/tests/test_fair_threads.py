"""FairThreads (readie_worker._fair_threads): owners take the threads in turn, each at most its
share at once; the resolver forwards sandboxes' lookups on it."""

from __future__ import annotations

import threading
import time

import pytest

from readie_worker._fair_threads import FairThreads


def test_an_owner_whose_tasks_hang_holds_its_share_and_another_owners_task_runs_at_once():
    pool = FairThreads(4, 2, "test")
    release, lock = threading.Event(), threading.Lock()
    running = {"now": 0, "most": 0}

    def hanging() -> None:
        with lock:
            running["now"] += 1
            running["most"] = max(running["most"], running["now"])
        release.wait(10)
        with lock:
            running["now"] -= 1

    try:
        for _ in range(8):  # a sandbox's lookups of names whose servers never answer
            pool.submit("flooder", hanging)
        ran = threading.Event()
        started = time.monotonic()
        pool.submit("other", ran.set)
        assert ran.wait(2) and time.monotonic() - started < 1, "the other owner's task waited behind the flood"
        assert running["most"] == 2  # its share, never every thread
    finally:
        release.set()
        pool.close()


def test_owners_take_turns_and_a_failing_task_leaves_its_thread_serving():
    pool = FairThreads(1, 1, "test")
    order: list[str] = []
    gate, holding = threading.Event(), threading.Event()
    try:
        pool.submit("a", lambda: holding.set() or gate.wait(5))  # holds the one thread while the rest queue
        assert holding.wait(5)
        for name in ("a1", "a2", "a3"):
            pool.submit("a", lambda name=name: order.append(name))
        pool.submit("b", lambda: 1 / 0)
        pool.submit("b", lambda: order.append("b2"))
        gate.set()
        deadline = time.monotonic() + 5
        while len(order) < 4 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert order == ["a1", "a2", "b2", "a3"]  # in turn: a1, b's first (which raised), a2, b2, a3
    finally:
        pool.close()


def test_closed_it_refuses_new_tasks_and_drops_what_waits():
    pool = FairThreads(1, 1, "test")
    gate, dropped = threading.Event(), threading.Event()
    pool.submit("a", lambda: gate.wait(5))
    pool.submit("a", dropped.set)
    closing = threading.Thread(target=pool.close)
    closing.start()
    time.sleep(0.1)
    gate.set()
    closing.join(5)
    assert not closing.is_alive() and not dropped.is_set()
    with pytest.raises(RuntimeError):
        pool.submit("a", dropped.set)
    with pytest.raises(ValueError):
        FairThreads(2, 3, "test")


def test_with_no_thread_that_could_start_a_task_is_refused_not_queued_forever():
    def cannot() -> None:
        raise OSError("the namespace is gone")

    pool = FairThreads(2, 1, "test", cannot)
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            pool.submit("a", lambda: None)
        except RuntimeError:
            break
        time.sleep(0.01)
    with pytest.raises(RuntimeError, match="no thread could start"):
        pool.submit("a", lambda: None)
    pool.close()
