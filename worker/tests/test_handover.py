"""The hand-over line (readie_worker._handover) on a real pipe to a real child process."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

import readie_worker._handover as handover
from readie_worker.errors import SandboxSetupError


def test_an_executor_that_stops_reading_its_stdin_fails_a_hand_over_instead_of_holding_it(monkeypatch):
    """A job can make its executor stop reading: the lines of per-step checkpoints fill the pipe,
    and a blocking write would hold the checkpoint's thread (and the session's teardown) forever."""
    monkeypatch.setattr(handover, "HANDOVER_WAIT_S", 0.3)
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], stdin=subprocess.PIPE)
    try:
        with pytest.raises(SandboxSetupError, match="does not read it"):
            for _ in range(100_000):  # ~12 bytes a line: a 64 KiB pipe fills in ~5,500
                handover.hand_over(child, {})
        started = time.monotonic()
        with pytest.raises(SandboxSetupError):
            handover.hand_over(child, {})
        assert time.monotonic() - started < 2
    finally:
        child.kill()
        child.wait()


def test_a_line_larger_than_the_pipe_goes_whole_to_a_reader():
    reader = subprocess.Popen([sys.executable, "-c", "import sys; print(len(sys.stdin.buffer.readline()))"],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        env = {"BIG": "x" * 300_000}  # a job's env can be larger than the pipe
        handover.hand_over(reader, env)
        out, _ = reader.communicate(timeout=10)
        assert int(out) == len(b'{"env": {"BIG": ""}}\n') + 300_000
    finally:
        reader.kill()
