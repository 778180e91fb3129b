"""The sandbox lifecycle around a launcher that fails on demand: cold fallback, cleanup of a
failed start, warm sandboxes that refill, die and are replaced. Real executor processes on the
host (``LocalProcess`` under ``testing.FaultyLauncher``), no gVisor: seconds, not minutes.

The same logic under runsc is test_restore.py's and test_warm.py's.
"""

from __future__ import annotations

import time

import pytest
from readie_worker.bundle import serve_env
from readie_worker.errors import SandboxSetupError
from readie_worker.jobs import CodeJob, run_in_sandbox
from readie_worker.sandbox import SandboxFactory
from readie_worker.testing import FaultyLauncher, stopped, wait_until
from readie_worker import warm as warm_module
from readie_worker.warm import RefillBudget, WarmSandboxes


def factory(tmp_path, primary: FaultyLauncher, fallback: FaultyLauncher | None = None) -> SandboxFactory:
    run_dir = tmp_path / "run"
    run_dir.mkdir(exist_ok=True)
    return SandboxFactory(primary=primary, fallback=fallback, run_dir=run_dir, env=serve_env(()), socket_wait_s=20)


def leftovers(made: SandboxFactory) -> list[str]:
    return sorted(path.name for path in made.run_dir.iterdir())


def test_a_failed_start_falls_back_and_the_failed_one_leaves_nothing(tmp_path):
    primary, fallback = FaultyLauncher(fail_starts=1), FaultyLauncher()
    made = factory(tmp_path, primary, fallback)
    sandbox = made.create()
    try:
        assert sandbox.launcher is fallback and sandbox.alive()
        assert (primary.starts, primary.destroys, fallback.starts) == (1, 1, 1)
        assert leftovers(made) == [sandbox.id]  # the failed start's directory is gone
        outcome = run_in_sandbox(sandbox, CodeJob(checkpoint="x", code="print(6 * 7)"), links=())
        assert (outcome.exit, outcome.stdout) == (0, "42\n"), outcome
    finally:
        sandbox.destroy()
    assert leftovers(made) == [] and fallback.destroys == 1


def test_a_start_that_fails_everywhere_is_a_setup_error_and_leaves_nothing(tmp_path):
    primary, fallback = FaultyLauncher(fail_starts=1), FaultyLauncher(fail_starts=1)
    made = factory(tmp_path, primary, fallback)
    with pytest.raises(SandboxSetupError, match="start failed as the test asked"):
        made.create()
    assert (primary.destroys, fallback.destroys) == (1, 1)
    assert leftovers(made) == []


def test_warm_sandboxes_refill_to_their_target_and_hand_out_warmed_ones(tmp_path):
    launcher = FaultyLauncher()
    warm = WarmSandboxes("fast", factory(tmp_path, launcher), target=2, budget=RefillBudget()).start()
    taken = None
    try:
        assert wait_until(lambda: warm.ready_count == 2, 30)
        taken = warm.take()
        assert (warm.hits, warm.misses) == (1, 0)
        assert wait_until(lambda: warm.ready_count == 2, 30)  # refilled behind the take
        assert launcher.starts == 3
        outcome = run_in_sandbox(taken, CodeJob(checkpoint="x", code="print('warm')"), links=())
        assert outcome.stdout == "warm\n", outcome
    finally:
        if taken is not None:
            taken.destroy()
        warm.close()
    assert launcher.destroys == 3 and leftovers(warm.factory) == []


def test_a_warm_sandbox_that_died_is_destroyed_and_never_handed_out(tmp_path):
    launcher = FaultyLauncher()
    warm = WarmSandboxes("fast", factory(tmp_path, launcher), target=1, budget=RefillBudget()).start()
    try:
        assert wait_until(lambda: warm.ready_count == 1, 30)
        (entry,) = list(warm._ready)
        entry.sandbox.launched.process.kill()
        entry.sandbox.launched.process.wait()
        taken = warm.take()
        try:
            assert taken is not entry.sandbox and taken.alive()
            assert entry.sandbox.destroyed
        finally:
            taken.destroy()
    finally:
        warm.close()


def test_a_refill_that_fails_is_retried_and_the_pool_recovers(tmp_path):
    launcher = FaultyLauncher(fail_starts=2)
    warm = WarmSandboxes("fast", factory(tmp_path, launcher), target=1, budget=RefillBudget()).start()
    try:
        assert wait_until(lambda: warm.ready_count == 1, 30)
        assert launcher.starts == 3 and launcher.destroys == 2
    finally:
        warm.close()
    assert leftovers(warm.factory) == []


def test_a_refill_waits_for_the_job_that_took_its_sandbox_never_past_its_bound_nor_after_a_miss(tmp_path, monkeypatch):
    monkeypatch.setattr(warm_module, "REFILL_HOLD_MAX_S", 1.0)  # long enough to tell apart here
    launcher = FaultyLauncher()
    warm = WarmSandboxes("fast", factory(tmp_path, launcher), target=1, budget=RefillBudget()).start()
    taken = []
    try:
        assert wait_until(lambda: warm.ready_count == 1, 30) and launcher.starts == 1
        with warm.refill_held():  # a job: its take's refill waits for it...
            taken.append(warm.take())
            time.sleep(0.3)
            assert launcher.starts == 1
        assert wait_until(lambda: launcher.starts == 2, 0.5)  # ...and starts the moment it is done
        assert wait_until(lambda: warm.ready_count == 1, 30)
        with warm.refill_held():  # a job longer than the bound
            taken.append(warm.take())
            started = time.monotonic()
            assert wait_until(lambda: launcher.starts == 3, 3)
            assert 0.9 < time.monotonic() - started < 2.0
            assert wait_until(lambda: warm.ready_count == 1, 30)
        with warm.refill_held():  # two jobs at once, the second a miss: demand outruns the set
            taken.append(warm.take())
            taken.append(warm.take())  # restored on demand: start 4
            assert warm.misses == 1
            assert wait_until(lambda: launcher.starts == 5, 0.5)  # the refill did not wait
    finally:
        for sandbox in taken:
            sandbox.destroy()
        warm.close()
    assert leftovers(warm.factory) == []


def test_a_warm_sandbox_that_cannot_be_resumed_is_destroyed_and_never_handed_out(tmp_path):
    launcher = FaultyLauncher()
    warm = WarmSandboxes("fast", factory(tmp_path, launcher), target=2, budget=RefillBudget()).start()
    try:
        assert wait_until(lambda: warm.ready_count == 2, 30)
        head, behind = (entry.sandbox for entry in warm._ready)
        # Paused, behind the next in line (stopped a moment after the signal).
        assert wait_until(lambda: stopped(behind.launched.process.pid), 5)
        launcher.fail_resumes = 100  # it stays stopped from now on
        first = warm.take()  # the head, never paused; the one behind it stays stopped
        second = warm.take()
        try:
            assert first is head and second is not behind and behind.destroyed
            outcome = run_in_sandbox(second, CodeJob(checkpoint="x", code="print('ran')"), links=())
            assert outcome.stdout == "ran\n", outcome
        finally:
            first.destroy()
            second.destroy()
    finally:
        warm.close()
