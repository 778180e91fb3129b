"""Reaping the sandboxes that runsc leaves to us.

``runsc run|restore --detach`` exits and leaves the sandbox, gofer and helper
processes behind. Orphans normally go to the VM's init, which reaps them so
slowly here that ``runsc delete`` after ``kill`` takes ~1.7 s. As a child
subreaper we adopt them and reap them ourselves (~25 ms).

Reaping "any zombie child" must not steal the exit status of a child that
``subprocess`` is waiting for, so every process this package starts goes
through :func:`popen`, which records it under the same lock the reaper takes.
"""

from __future__ import annotations

import ctypes
import errno
import math
import os
import select
import subprocess
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import structlog

PR_SET_CHILD_SUBREAPER = 36
# How often orphans are reaped while a runsc kill or delete waits for them to go.
REAP_POLL_S = 0.005

log = structlog.get_logger("readie.reaper")

_lock = threading.Lock()
_owned: weakref.WeakSet[subprocess.Popen[Any]] = weakref.WeakSet()
_subreaper = False


def become_subreaper() -> bool:
    global _subreaper
    if not _subreaper:
        libc = ctypes.CDLL(None, use_errno=True)
        _subreaper = libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0
    return _subreaper


def popen(args: Sequence[str], **kwargs: Any) -> subprocess.Popen[Any]:
    become_subreaper()
    with _lock:
        process = subprocess.Popen(args, **kwargs)
        _owned.add(process)
    return process


def run(
    args: Sequence[str], *, timeout: float, stderr: Any = subprocess.PIPE, input: str | None = None, reaping: bool = False
) -> subprocess.CompletedProcess[str]:
    """Like ``subprocess.run(args, stdout=PIPE, text=True)``, and the way for this package to run
    a command: started through :func:`popen`, its exit status is never the reaper's to take (a
    status taken by another thread reads as 0 to ``subprocess``: a failed command would pass).

    With ``reaping``, reap orphans until it finishes: ``runsc kill`` and ``delete``
    wait for the sandbox's processes to go away, and those are our zombies to reap:
    reaping while waiting is what makes a delete take milliseconds instead of the
    5 s it waits before giving up.
    """
    assert input is None or not reaping, "input goes in before the wait"
    stdin = subprocess.DEVNULL if input is None else subprocess.PIPE
    process = popen(args, stdin=stdin, stdout=subprocess.PIPE, stderr=stderr, text=True)
    deadline = time.monotonic() + timeout
    try:
        if reaping:
            with _ExitWatch(process) as exited:
                while not exited(REAP_POLL_S):
                    if time.monotonic() >= deadline:
                        raise subprocess.TimeoutExpired(args, timeout)
                    reap_orphans()
        stdout, errors = process.communicate(input, timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        process.kill()
        process.communicate()
        raise
    return subprocess.CompletedProcess(args, process.returncode, stdout, errors)


def wait_exit(process: subprocess.Popen[Any], timeout: float) -> int:
    """``process.wait(timeout)``, woken by the exit itself.

    Python's own timed wait polls with sleeps that double up to 50 ms, so it
    saw a ``runsc restore --detach`` of 80-250 ms end 15-35 ms late here: time
    every restore spent waiting on nothing. Raises ``subprocess.TimeoutExpired``.
    """
    with _ExitWatch(process) as exited:
        if not exited(timeout):
            raise subprocess.TimeoutExpired(process.args, timeout)
    return process.wait()


# pidfd_open(2) refused as such: a kernel before 5.3, or a seccomp filter that does not know it.
_NO_PIDFDS = frozenset({errno.ENOSYS, errno.EPERM, errno.EACCES})


class _ExitWatch:
    """Waits for one child of ours to exit, through a pidfd: ``exited(seconds)`` returns as soon
    as it has, or False after ``seconds``. The child is not reaped here (``wait`` does that), and
    no one else can reap it meanwhile: :func:`reap_orphans` leaves what :func:`popen` started
    alone, so the pid names this child until it is waited for. Without pidfds (an old kernel,
    a seccomp filter), it polls as ``Popen.poll`` does."""

    def __init__(self, process: subprocess.Popen[Any]) -> None:
        assert process in _owned, "only what popen started is safe from the reaper"
        self._process = process
        self._poll: select.poll | None = None
        self._pidfd = -1

    def __enter__(self) -> Callable[[float], bool]:
        if self._process.returncode is not None:
            return self._polled
        try:
            self._pidfd = os.pidfd_open(self._process.pid)
        except OSError as exc:
            if exc.errno not in _NO_PIDFDS:  # out of descriptors, say: never worse than polling
                log.warning("cannot wait on a pidfd, polling instead", error=exc.strerror)
            return self._polled
        try:
            self._poll = select.poll()
            self._poll.register(self._pidfd, select.POLLIN)
        except BaseException:
            os.close(self._pidfd)
            raise
        return self._woken

    def __exit__(self, *exc_info: object) -> None:
        if self._pidfd >= 0:
            os.close(self._pidfd)

    def _woken(self, seconds: float) -> bool:
        assert self._poll is not None
        return bool(self._poll.poll(max(0, math.ceil(seconds * 1000))))

    def _polled(self, seconds: float) -> bool:
        deadline = time.monotonic() + seconds
        while self._process.poll() is None:
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(left, REAP_POLL_S))
        return True


def reap_orphans() -> list[int]:
    """Reap the adopted zombies there are now; their pids."""
    return _reap_adopted() if _a_child_exited() else []  # the probe first, unlocked: most polls stop there


def _reap_adopted() -> list[int]:
    """Reap the zombies among :func:`_orphans`, leaving alone what :func:`popen` started."""
    reaped = []
    with _lock:
        owned = {process.pid for process in _owned if process.returncode is None}
        for pid in _orphans():
            if pid not in owned:
                try:
                    done, _ = os.waitpid(pid, os.WNOHANG)  # reaps it if it is a zombie, else nothing
                except ChildProcessError:
                    continue
                if done:
                    reaped.append(pid)
    return reaped


def _a_child_exited() -> bool:
    """Whether any child of ours is a zombie, asked without reaping it: one syscall.

    Finding which ones costs more (:func:`_orphans`); done every few milliseconds while a runsc
    delete waits, it cost more CPU than the delete. Most polls find nothing.
    """
    try:
        return os.waitid(os.P_ALL, 0, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # no children at all
        return False


def _orphans() -> list[int]:
    """The children adopted here, and any the main thread started: the main thread's
    ``children`` list, one file.

    The kernel gives an orphan to the first live thread of its subreaper (``find_new_reaper``,
    ``find_alive_thread``; Linux 3.19 on, before which it was the thread that forked): the main
    thread, for as long as the process runs. A child a thread started is on that thread's list,
    and ``subprocess`` waits for it. Reading every thread's list cost ~200 us a poll under load,
    14 polls a delete: a quarter of the pool's own CPU per job (decision 33). Without the lists
    (a kernel without CONFIG_PROC_CHILDREN), every process in /proc whose parent we are.
    """
    me = os.getpid()
    try:
        with open(f"/proc/self/task/{me}/children", "rb") as children:
            return [int(pid) for pid in children.read().split()]
    except FileNotFoundError:
        return [pid for pid in (int(entry) for entry in os.listdir("/proc") if entry.isdigit()) if _parent(pid) == me]


def _parent(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return int(stat.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return None
