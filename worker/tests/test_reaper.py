"""The reaper finds the zombies it adopted on its main thread's children list (``_reaper._orphans``),
an orphan made from a thread that is still alive included, and leaves alone a child that
``subprocess`` waits for (that one in a process of its own: a subreaper adopts for the whole
process). ``wait_exit`` is woken by the exit, not by a poll, and ``run`` keeps a failed
command's status from the reaper."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

SCRIPT = """
import subprocess, threading, time
from readie_worker import _reaper
assert _reaper.become_subreaper()
made, done = threading.Event(), threading.Event()
def orphan():  # sh exits at once; its background sleep is adopted by us, then exits too
    _reaper.popen(["sh", "-c", "sleep 0.05 & exit 0"]).wait()
    made.set()
    done.wait()  # this thread lives on while the orphan is reaped: it must not be on its list
thread = threading.Thread(target=orphan)
thread.start()
made.wait()
waited = _reaper.popen(["true"])  # ours, exited, not yet waited for: not the reaper's to take
deadline = time.monotonic() + 5
reaped = []
while not reaped and time.monotonic() < deadline:
    time.sleep(0.1)
    reaped = _reaper.reap_orphans()
done.set()
thread.join()
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


def test_wait_exit_is_woken_by_the_exit_not_by_polling(monkeypatch: pytest.MonkeyPatch) -> None:
    from readie_worker import _reaper

    def no_sleeping(seconds: float) -> None:
        raise AssertionError("wait_exit polled")

    monkeypatch.setattr(_reaper.time, "sleep", no_sleeping)
    assert _reaper.wait_exit(_reaper.popen(["sh", "-c", "sleep 0.1; exit 5"]), 5.0) == 5


def test_a_failed_command_keeps_its_status_while_the_reaper_runs() -> None:
    """A status taken by another thread's reap reads as 0 to subprocess: ``run`` starts its
    command through popen, so the reaper polling beside it leaves that status alone."""
    from readie_worker import _reaper

    stop = threading.Event()

    def reaping() -> None:
        while not stop.is_set():
            _reaper.reap_orphans()

    reaper = threading.Thread(target=reaping)
    reaper.start()
    try:
        statuses = {_reaper.run(["sh", "-c", "exit 7"], timeout=5.0).returncode for _ in range(50)}
    finally:
        stop.set()
        reaper.join()
    assert statuses == {7}
    assert _reaper.run(["cat"], input="fed\n", timeout=5.0).stdout == "fed\n"


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


def test_every_command_the_worker_runs_goes_through_the_reaper() -> None:
    """A process started past ``_reaper.popen`` is fair game to the reaper's ``waitpid``."""
    import ast
    from pathlib import Path

    import readie_worker

    starters = {"run", "Popen", "call", "check_call", "check_output"}
    found = []
    for path in Path(readie_worker.__file__).parent.glob("*.py"):
        if path.name == "_reaper.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and isinstance(node.func.value, ast.Name)
                and (node.func.value.id, node.func.attr) in {("subprocess", name) for name in starters} | {("os", "system"), ("os", "popen")}
            ):
                found.append(f"{path.name}:{node.lineno}")
    assert found == []
