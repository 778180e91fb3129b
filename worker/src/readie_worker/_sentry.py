"""Signals to a sandbox's sentry (its ``runsc-sandbox`` process), checked through a pidfd.

SIGKILL ends a sandbox without asking runsc (``Runsc.destroy``). SIGSTOP and
SIGCONT pause and resume an idle sandbox (a warm set's, a session's:
``Sandbox.pause``) only where it has no freezer cgroup to freeze
(``cgroups.freeze``): systrap's sentry wakes every 400 µs even when its sandbox
is idle, which costs a few percent of a core per sandbox here.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

__all__ = ["MAX_PID_FILE_BYTES", "kill_sandbox_process", "signal_sandbox_process", "signal_sentry_pid"]


# A pid file holds a decimal pid and a newline.
MAX_PID_FILE_BYTES = 32


def kill_sandbox_process(container_id: str, pid_file: Path) -> bool:
    """SIGKILL the runsc-sandbox process of ``container_id`` named in ``pid_file``; whether it was.
    It dies stopped or not; frozen, once thawed (``Runsc.destroy``)."""
    return signal_sandbox_process(container_id, pid_file, signal.SIGKILL)


def signal_sandbox_process(container_id: str, pid_file: Path, signum: int) -> bool:
    """Send ``signum`` to the runsc-sandbox process (the sentry) of ``container_id`` named in
    ``pid_file``; whether it was sent.

    The pid is checked through a pidfd: once open, it names that process for
    good, so the command line read next (``runsc-sandbox ... <id>``) proves
    that a pid reused since the sandbox died is not signalled.
    """
    try:
        pid = int(pid_file.read_bytes()[:MAX_PID_FILE_BYTES])
    except (OSError, ValueError):
        return False
    return signal_sentry_pid(container_id, pid, signum)


def signal_sentry_pid(container_id: str, pid: int, signum: int) -> bool:
    """``signal_sandbox_process`` for a pid known otherwise (runsc's state of the container)."""
    try:
        pidfd = os.pidfd_open(pid)
    except (OSError, ValueError, OverflowError):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            argv = cmdline.read(64 * 1024).split(b"\0")
        if argv[0] != b"runsc-sandbox" or container_id.encode() not in argv:
            return False
        signal.pidfd_send_signal(pidfd, signum)
        return True
    except OSError:
        return False
    finally:
        os.close(pidfd)
