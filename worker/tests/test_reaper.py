"""The reaper finds the zombies it adopted among its own children's lists (``_reaper._children``),
an orphan made from a thread that has since ended included, and leaves alone a child that
``subprocess`` waits for. In a process of its own: a subreaper adopts for the whole process."""

from __future__ import annotations

import subprocess
import sys

import pytest

SCRIPT = """
import subprocess, threading, time
from readie_worker import _reaper
assert _reaper.become_subreaper()
def orphan():  # sh exits at once; its background sleep is adopted by us, then exits too
    _reaper.popen(["sh", "-c", "sleep 0.05 & exit 0"]).wait()
thread = threading.Thread(target=orphan)
thread.start()
thread.join()
waited = _reaper.popen(["true"])  # ours, exited, not yet waited for: not the reaper's to take
deadline = time.monotonic() + 5
reaped = []
while not reaped and time.monotonic() < deadline:
    time.sleep(0.1)
    reaped = _reaper.reap_orphans()
assert len(reaped) == 1 and reaped[0] != waited.pid, (reaped, waited.pid)
assert waited.wait(timeout=5) == 0
print("ok")
"""


def test_an_adopted_orphan_is_reaped_and_a_waited_child_is_left_alone() -> None:
    done = subprocess.run([sys.executable, "-c", SCRIPT], capture_output=True, text=True, timeout=60)
    assert done.stdout == "ok\n", done.stderr


def test_wait_exit_gives_the_status_and_times_out_without_reaping() -> None:
    from readie_worker import _reaper

    assert _reaper.wait_exit(_reaper.popen(["sh", "-c", "exit 3"]), 5.0) == 3
    sleeper = _reaper.popen(["sleep", "5"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _reaper.wait_exit(sleeper, 0.05)
        assert sleeper.returncode is None  # still ours to kill and wait for
    finally:
        sleeper.kill()
    assert _reaper.wait_exit(sleeper, 5.0) == -9


def test_wait_exit_without_pidfds_polls_instead(monkeypatch: pytest.MonkeyPatch) -> None:
    from readie_worker import _reaper

    def refused(pid: int) -> int:
        raise OSError(38, "Function not implemented")

    monkeypatch.setattr(_reaper.os, "pidfd_open", refused)
    assert _reaper.wait_exit(_reaper.popen(["sh", "-c", "sleep 0.02; exit 4"]), 5.0) == 4
    sleeper = _reaper.popen(["sleep", "5"])
    try:
        with pytest.raises(subprocess.TimeoutExpired):
            _reaper.wait_exit(sleeper, 0.02)
    finally:
        sleeper.kill()
        sleeper.wait()
