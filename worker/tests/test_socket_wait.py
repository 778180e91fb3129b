"""The wait for a launched executor's socket (``_socket_wait.wait_for_socket``), against real
processes standing in for it: woken by the end of its stdout, which an executor lets go of once
it listens; probing on its own while stdout stays open; an end of stdout with no socket after it
is the executor's death, and no socket at all a timeout."""

from __future__ import annotations

import socket
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from readie_worker import _socket_wait
from readie_worker.errors import SandboxSetupError
from readie_worker.runsc import Launched

# A stand-in executor: after DELAY s it listens on PATH (unless LISTEN is false), closes its stdout
# (unless KEEP is true; "flood": writes to it without end), then waits to be killed.
EXECUTOR = """
import os, socket, sys, time
path, delay, listen, keep = sys.argv[1], float(sys.argv[2]), sys.argv[3] == "1", sys.argv[4]
time.sleep(delay)
while keep == "flood":
    os.write(1, b"x" * 65536)
if listen:
    server = socket.socket(socket.AF_UNIX)
    server.bind(path)
    server.listen(1)
if keep == "0":
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
time.sleep(60)
"""


def wait(short_tmp: Path, *, delay: float, listen: bool = True, keep_stdout: bool | str = False, timeout: float = 10.0) -> float:
    path = short_tmp / "executor.sock"
    launched = Launched.popen([sys.executable, "-c", EXECUTOR, str(path), str(delay), str(int(listen)), str(keep_stdout if isinstance(keep_stdout, str) else int(keep_stdout))])
    started = time.monotonic()
    try:
        _socket_wait.wait_for_socket(SimpleNamespace(id="rd-test", socket_path=path), launched, timeout)  # type: ignore[arg-type]
        return time.monotonic() - started
    finally:
        launched.process.kill()
        launched.process.wait()
        launched.close()


def test_the_end_of_stdout_wakes_the_wait(short_tmp: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_socket_wait, "SOCKET_PROBE_S", 30.0)  # no probe before the test's own timeout
    assert 0.3 <= wait(short_tmp, delay=0.3) < 5  # the wait's own timeout is 10 s


def test_with_stdout_left_open_the_socket_is_probed(short_tmp: Path) -> None:
    assert 0.3 <= wait(short_tmp, delay=0.3, keep_stdout=True) < 10


def test_an_end_of_stdout_with_no_socket_is_the_executors_death(short_tmp: Path) -> None:
    started = time.monotonic()
    with pytest.raises(SandboxSetupError, match="executor exited before binding its socket"):
        wait(short_tmp, delay=0.1, listen=False)
    assert time.monotonic() - started < 0.1 + _socket_wait.STDOUT_END_GRACE_S + 1.0


def test_no_socket_at_all_is_a_timeout(short_tmp: Path) -> None:
    with pytest.raises(SandboxSetupError, match="no executor socket after 1 s"):
        wait(short_tmp, delay=0.0, listen=False, keep_stdout=True, timeout=1.0)


def test_an_executor_writing_to_stdout_does_not_make_the_wait_spin(short_tmp: Path) -> None:
    cpu = time.thread_time()
    with pytest.raises(SandboxSetupError, match="no executor socket after 1 s"):
        wait(short_tmp, delay=0.0, listen=False, keep_stdout="flood", timeout=1.0)
    assert time.thread_time() - cpu < 0.5  # read and dropped at most every SOCKET_POLL_S


def test_a_link_in_place_of_the_socket_is_refused_never_followed(short_tmp: Path) -> None:
    elsewhere = socket.socket(socket.AF_UNIX)  # a host socket the sandbox would like the worker to reach
    elsewhere.bind(str(short_tmp / "elsewhere.sock"))
    elsewhere.listen(1)
    (short_tmp / "executor.sock").symlink_to(short_tmp / "elsewhere.sock")
    with pytest.raises(_socket_wait.NotASocket), socket.socket(socket.AF_UNIX) as connection:
        _socket_wait.connect_executor(connection, short_tmp / "executor.sock")
    started = time.monotonic()
    with pytest.raises(SandboxSetupError, match="something other than a socket in place of the executor's socket"):
        wait(short_tmp, delay=0.0, listen=False, keep_stdout=True)
    assert time.monotonic() - started < 5  # at once, not at the wait's timeout
    elsewhere.setblocking(False)
    with pytest.raises(BlockingIOError):
        elsewhere.accept()  # nothing ever connected to it
    elsewhere.close()


def test_a_listener_with_a_full_backlog_does_not_hold_the_wait(short_tmp: Path) -> None:
    path = short_tmp / "executor.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(0)
    held = []
    for _ in range(3):  # more than the backlog takes: the next blocking connect would hang
        client = socket.socket(socket.AF_UNIX)
        client.setblocking(False)
        try:
            client.connect(str(path))
        except BlockingIOError:
            client.close()
            break
        held.append(client)
    started = time.monotonic()
    assert not _socket_wait._answers(path)
    assert time.monotonic() - started < 1
    for client in held:
        client.close()
    listener.close()
