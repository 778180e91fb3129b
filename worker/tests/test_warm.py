"""Warm pools under real runsc: ready before they are asked, refilled, probed, closed clean."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import tempfile
import time
from pathlib import Path

import pytest

from readie_worker._sentry import kill_sandbox_process
from readie_worker._states import SandboxState
from readie_worker.runsc import Runsc
from readie_worker.warm import RefillBudget, WarmSandboxes
from readie_worker.sandbox import checkpoint_factory
from readie_worker.testing import cpu_ticks, stopped, wait_until

pytestmark = pytest.mark.runsc


def sentry_of(sandbox) -> int:
    """Its sentry's pid, from runsc's pid file (runsc state would wait for a paused sentry)."""
    return int(sandbox.dir.pid_file.read_text())


def sentry_children(sentry: int) -> list[int]:
    """The sentry's descendants: systrap's stubs, where the sandbox's code runs."""
    found, todo = [], [sentry]
    while todo:
        tasks = Path(f"/proc/{todo.pop()}/task")
        children = [int(pid) for task in tasks.iterdir() for pid in (task / "children").read_text().split()]
        found += children
        todo += children
    return found


@pytest.fixture
def pool_factory(runsc, checkpoints, short_tmp):
    pools: list[WarmSandboxes] = []

    def make(name: str = "base", target: int = 2) -> WarmSandboxes:
        factory = checkpoint_factory(runsc, checkpoints.manifest, checkpoints.usable[name], short_tmp)
        pool = WarmSandboxes(name, factory, target, RefillBudget()).start()
        pools.append(pool)
        return pool

    yield make
    for pool in pools:
        pool.close()


def test_jobs_taken_from_a_full_pool_do_not_wait_for_a_restore(pool_factory):
    pool = pool_factory("pandas", target=2)
    assert pool.wait_until_full(timeout=60)
    restore_ms = min(s.sandbox.ready_ms for s in list(pool._ready))
    taken = []
    for _ in range(2):
        started = time.monotonic()
        sandbox = pool.take()
        taken.append((sandbox, (time.monotonic() - started) * 1000))
    try:
        for sandbox, take_ms in taken:
            print(f"take from warm pool: {take_ms:.1f} ms (a restore took {restore_ms:.0f} ms)")
            assert sandbox.state is SandboxState.BUSY
            # A warm take is a probe round trip; anything near a restore means we restored.
            assert take_ms < restore_ms / 2
        assert pool.hits == 2 and pool.misses == 0
    finally:
        for sandbox, _ in taken:
            sandbox.destroy()
    assert pool.wait_until_full(timeout=60), "the pool refills in the background"


def test_an_empty_pool_restores_on_demand(pool_factory):
    pool = pool_factory("base", target=0)
    sandbox = pool.take()
    try:
        assert sandbox.alive()
        assert pool.misses == 1
    finally:
        sandbox.destroy()


def test_a_dead_warm_sandbox_is_never_handed_out(pool_factory, runsc):
    pool = pool_factory("base", target=1)
    assert pool.wait_until_full(timeout=60)
    [victim] = [entry.sandbox for entry in pool._ready]
    # Killed from outside as it waits, by its pid: runsc kill would wait for a paused sentry.
    assert kill_sandbox_process(victim.id, victim.dir.pid_file)
    # A take checks the warm-up's kept connection, which shows the death a few ms after
    # the kill; a death racing the take is a death under the job (decision 0012).
    assert wait_until(lambda: not victim.connection_intact(), timeout=5)
    sandbox = pool.take()
    try:
        assert sandbox.id != victim.id
        assert sandbox.alive()
        assert victim.destroyed
    finally:
        sandbox.destroy()


def test_ready_sandboxes_are_warmed_up_and_keep_the_warm_up_s_connection(pool_factory):
    pool = pool_factory("pandas", target=1)
    assert pool.wait_until_full(timeout=60)
    [ready] = [entry.sandbox for entry in pool._ready]
    # What lets take() skip the ping for a sandbox that answered moments ago.
    assert ready.connection_intact()


def test_a_sandbox_idle_past_the_ping_threshold_is_pinged_and_a_wedged_one_replaced(pool_factory, runsc):
    from readie_worker.warm import PING_AFTER_IDLE_S

    pool = pool_factory("base", target=1)
    assert pool.wait_until_full(timeout=60)
    [entry] = list(pool._ready)
    entry.since -= PING_AFTER_IDLE_S + 1  # as if it had idled that long
    # Wedged: alive, its connection quiet, but it answers nothing. The stub processes that run its
    # code are stopped, not the sentry, which a take resumes when it waited paused.
    pids = sentry_children(sentry_of(entry.sandbox))
    assert pids
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        sandbox = pool.take()
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):  # destroyed by then, as it should be
                os.kill(pid, signal.SIGCONT)
    try:
        assert sandbox.id != entry.sandbox.id and entry.sandbox.destroyed
        assert sandbox.alive()
    finally:
        sandbox.destroy()


def test_closing_a_pool_destroys_its_sandboxes(pool_factory, runsc):
    pool = pool_factory("base", target=2)
    assert pool.wait_until_full(timeout=60)
    ids = [entry.sandbox.id for entry in pool._ready]
    pool.close()
    assert not set(ids) & set(runsc.list_ids())


def test_warm_sandboxes_behind_the_next_in_line_wait_paused_using_no_cpu(pool_factory):
    pool = pool_factory("base", target=2)
    assert pool.wait_until_full(timeout=60)
    first, second = [entry.sandbox for entry in pool._ready]
    assert not stopped(sentry_of(first))  # the next a take gets runs, never stopped
    behind = sentry_of(second)
    assert wait_until(lambda: stopped(behind), timeout=5)  # frozen a moment after the freezer is told
    assert pool.paused_count == 1  # the worker's gauge (readie_worker_warm_sandboxes_paused)
    before = cpu_ticks(behind)
    time.sleep(1.0)  # running idle, systrap's sentry takes a few ticks a second here
    assert cpu_ticks(behind) == before
    taken = pool.take()
    try:
        assert taken.id == first.id
        assert not stopped(behind)  # next in line now: resumed before it is taken
        assert taken.alive()
        again = pool.take()
        try:
            assert again.id == second.id and again.alive()
        finally:
            again.destroy()
    finally:
        taken.destroy()


def test_a_paused_sandbox_is_destroyed_at_once_and_swept_at_once(checkpoints, short_tmp):
    # A root of its own: the sweep empties the whole root, and the session's one is shared.
    own = Runsc(root=Path(tempfile.mkdtemp(prefix="readie-test-pause-")))
    factory = checkpoint_factory(own, checkpoints.manifest, checkpoints.usable["base"], short_tmp)
    first, second, third = factory.create(), factory.create(), factory.create()
    try:
        for sandbox in (first, second):
            sandbox.pause()  # frozen a moment after the freezer is told
            assert wait_until(lambda sandbox=sandbox: stopped(sentry_of(sandbox)), timeout=5)
        os.kill(sentry_of(third), signal.SIGSTOP)  # as an earlier readie paused one: its sentry alone
        started = time.monotonic()
        first.destroy()  # its SIGKILL, then a thaw (frozen, even a SIGKILL waits); runsc kill would wait too
        assert time.monotonic() - started < 5
        # A worker that died left the others paused: the next one's sweep thaws or continues them,
        # else runsc state, kill and delete would wait for them.
        started = time.monotonic()
        assert sorted(own.sweep()) == sorted([second.id, third.id])
        assert time.monotonic() - started < 10
        assert own.list_ids() == []
    finally:
        for sandbox in (first, second, third):
            sandbox.destroy()
        shutil.rmtree(own.root, ignore_errors=True)


def test_the_next_in_line_is_resumed_once_the_job_that_took_its_place_is_done(pool_factory):
    pool = pool_factory("base", target=2)
    assert pool.wait_until_full(timeout=60)
    first, second = [entry.sandbox for entry in pool._ready]
    with pool.refill_held():  # as Worker.run_job holds it around a job
        taken = pool.take()
        # Resumed beside the running job, the sentry's catching up would slow that job.
        assert taken.id == first.id
        assert wait_until(lambda: stopped(sentry_of(second)), timeout=5)
    try:
        assert not stopped(sentry_of(second))
    finally:
        taken.destroy()


def test_the_next_in_line_is_paused_once_it_waited_with_no_take_and_a_take_resumes_it(pool_factory, monkeypatch):
    import readie_worker.warm as warm

    monkeypatch.setattr(warm, "PAUSE_NEXT_IN_LINE_AFTER_S", 0.5)  # 10 s in earnest: a take then pings it
    pool = pool_factory("base", target=1)
    assert pool.wait_until_full(timeout=60)
    [head] = [entry.sandbox for entry in pool._ready]
    sentry = sentry_of(head)
    assert wait_until(lambda: stopped(sentry), timeout=5)  # no take came: stopped
    before = cpu_ticks(sentry)
    time.sleep(1.0)
    assert cpu_ticks(sentry) == before
    taken = pool.take()
    try:
        assert taken.id == head.id and not stopped(sentry)
        assert taken.alive()
    finally:
        taken.destroy()
