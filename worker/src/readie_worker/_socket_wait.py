"""The wait for a launched executor's socket: from ``runsc restore`` (or ``run``) until the
executor inside answers on it, or is known dead (``sandbox.launch``)."""

from __future__ import annotations

import errno
import math
import os
import select
import socket
import stat
import time
from pathlib import Path
from typing import IO, TYPE_CHECKING

from .errors import SandboxSetupError, log_host_facts
from .runsc import STDERR_SETTLE_S, Launched

if TYPE_CHECKING:
    from ._sandbox_dir import SandboxDir

__all__ = ["SOCKET_POLL_S", "NotASocket", "connect_executor", "wait_for_socket"]

# How often the socket is tried once the executor's stdout ended (and by a resumed session's
# step checkpoint, ``_step_checkpoint``).
SOCKET_POLL_S = 0.002
# How often the socket is tried while the executor's stdout is open. Its end (the executor lets
# go of stdout once it listens) wakes the wait at once; this only bounds the wait with a runsc
# that keeps the container's stdout open itself.
SOCKET_PROBE_S = 0.010
# How long a socket may take to answer after the executor's stdout ended: beyond this, the
# executor died instead.
STDOUT_END_GRACE_S = 1.0


def wait_for_socket(sandbox: SandboxDir, launched: Launched, timeout: float) -> None:
    """Until the executor's socket answers: woken by the end of its stdout, which it lets go of
    once it listens (the socket answers by then, ~0.5 ms before, measured), not by polling every
    2 ms, which cost the pool ~1-2 ms of CPU per restore under load (decision 33). An end of
    stdout is the executor's death when no socket follows within STDOUT_END_GRACE_S."""
    deadline = time.monotonic() + timeout
    path = sandbox.socket_path
    stdout = launched.process.stdout
    watch = select.poll()
    if stdout is not None:
        watch.register(stdout, select.POLLIN)
    gone_at: float | None = None  # when its stdout ended
    while True:
        try:
            if _answers(path):
                return
        except NotASocket as exc:  # the sandbox put something there: it is not trusted
            raise SandboxSetupError(f"sandbox {sandbox.id}: {exc.strerror}") from None
        now = time.monotonic()
        if gone_at is not None and now - gone_at >= STDOUT_END_GRACE_S:
            raise SandboxSetupError(
                f"sandbox {sandbox.id}: executor exited before binding its socket{_stderr_tail(sandbox.id, launched)}"
            )
        if now >= deadline:
            raise SandboxSetupError(
                f"sandbox {sandbox.id}: no executor socket after {timeout:.0f} s{_stderr_tail(sandbox.id, launched)}"
            )
        if gone_at is not None:
            time.sleep(SOCKET_POLL_S)
        elif watch.poll(math.ceil(min(SOCKET_PROBE_S, deadline - now) * 1000)):
            if _at_end(stdout):
                gone_at = time.monotonic()
            else:  # it wrote instead (a resumed session's executor is the job's to rewrite): no busy loop
                time.sleep(SOCKET_POLL_S)


class NotASocket(OSError):
    """Something other than a socket where the executor's socket belongs: a link above all."""


def connect_executor(connection: socket.socket, path: Path) -> None:
    """Connect ``connection`` to the executor's socket at ``path``, never through a link.

    The directory is the sandbox's to write (its ``/readie/run``), and ``connect()`` by path
    would follow a link put there to any socket on the host (another sandbox's executor). The
    socket is opened ``O_PATH | O_NOFOLLOW``, checked to be one, and connected through that
    descriptor. Raises OSError: FileNotFoundError before it is bound, :class:`NotASocket`.
    """
    fd = os.open(path, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        if not stat.S_ISSOCK(os.fstat(fd).st_mode):
            raise NotASocket(errno.ENOTSOCK, "something other than a socket in place of the executor's socket")
        connection.connect(f"/proc/self/fd/{fd}")
    finally:
        os.close(fd)


def _answers(path: Path) -> bool:
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)  # a listener with a full backlog answers EAGAIN at once, never blocks
    try:
        connect_executor(probe, path)
        return True
    except NotASocket:
        raise
    except OSError:
        return False
    finally:
        probe.close()


def _at_end(readable: IO[bytes] | None) -> bool:
    """Whether a pipe poll() found readable is at its end (what it held instead is read and
    dropped: the executor writes nothing to stdout once it serves)."""
    return readable is not None and not os.read(readable.fileno(), 4096)


def _stderr_tail(sandbox_id: str, launched: Launched) -> str:
    """Where the sandbox's last words are: they go to the worker's log (runsc's own lines name
    host paths and pids), not into the error a client reads."""
    tail = launched.stderr.text(wait_s=STDERR_SETTLE_S)[-1500:].strip()
    return f"; {log_host_facts('sandbox did not start', sandbox=sandbox_id, stderr=tail)}" if tail else ""
