"""Idle sessions wait paused (decision 0033, "Idle sandboxes wait paused").

An idle gVisor sentry still wakes every 400 µs (systrap's fast-path controller, in the runsc
these machines run): 3-4 % of a core for each session that waits between steps, for as long as
its client keeps it (``session_idle``, ten minutes by default). A session that has waited
``session_pause`` (``WorkerConfig.session_pause_s``, 10 s by default; 0: never) with its sandbox
quiet is paused (frozen, as a warm set's sandboxes behind the next in line are: ``Sandbox.pause``);
anything that holds the session next (a step, a hibernation, a file) resumes it first
(``SandboxSession._start_running``).

"Quiet" is what keeps a session's own work running: a session whose code goes on between steps
(a thread or a child process that computes) uses more than ``MAX_IDLE_CPU_SHARE`` of a core and is
never paused. What a pause does delay is a thread that sleeps on a timer: it runs when the next
step resumes the sandbox. A networked session is never paused: its peers would see it stop
answering.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import structlog

from .sandbox import Sandbox

__all__ = ["IdleClock", "IdlePauser"]

log = structlog.get_logger("readie.worker")

# How often the worker looks at its idle sessions (twice per session_pause when that is shorter,
# but never more often than MIN_CHECK_EVERY_S: each look reads a cgroup file per idle session);
# also the window their CPU is measured over.
CHECK_EVERY_S = 2.5
MIN_CHECK_EVERY_S = 0.1
# An idle sentry takes 3-4 % of a core here; a thread that computes takes far more than this.
MAX_IDLE_CPU_SHARE = 0.1


@dataclass
class IdleClock:
    """One session's idleness: since when, and its sandbox's CPU at the pauser's last look (the
    session's lock guards it)."""

    since: float | None = None  # waiting between steps since; None while held
    paused: bool = False  # its sandbox waits paused now (the worker's gauge reads it without the lock)
    _seen: tuple[float, int] | None = None  # (when, CPU ns) at the last look in this wait

    def idle(self) -> None:
        self.since, self._seen = time.monotonic(), None

    def held(self, sandbox: Sandbox | None) -> None:
        """The session is taken for a step, a hibernation or a file: its sandbox runs again. One
        that cannot be resumed is interrupted, so that what uses it next fails at once and the
        session ends, as after a sandbox that broke (a stopped sentry would make it wait out its
        timeout, or runsc's)."""
        self.since, self.paused = None, False
        if sandbox is not None and not sandbox.resume():
            sandbox.interrupt()

    def pause_if_quiet(self, lock: threading.Lock, idle_sandbox: Callable[[], Sandbox | None], after_s: float) -> bool:
        """Pause the session's sandbox (``idle_sandbox()``, None unless the session is idle) if it has
        idled ``after_s`` and stayed quiet since the last look; whether it did. Under
        the session's ``lock``, never waiting for it: a session whose lock is taken is not idle,
        and the pauser must not wait behind its work."""
        if not lock.acquire(blocking=False):
            return False
        try:
            return self._pause_if_quiet(idle_sandbox(), after_s)
        finally:
            lock.release()

    def _pause_if_quiet(self, sandbox: Sandbox | None, after_s: float) -> bool:
        if self.since is None or sandbox is None or sandbox.paused or sandbox.network is not None:
            return False
        now, cpu = time.monotonic(), sandbox.cpu_ns()
        seen, self._seen = self._seen, None if cpu is None else (now, cpu)
        if seen is None or cpu is None or now - self.since < after_s:
            return False
        if (cpu - seen[1]) / ((now - seen[0]) * 1e9) >= MAX_IDLE_CPU_SHARE:
            return False  # its own code runs between steps
        sandbox.pause()
        self.paused = sandbox.paused
        log.debug("idle session's sandbox paused", sandbox=sandbox.id)
        return self.paused


class Pausable(Protocol):
    def pause_if_idle(self, after_s: float) -> bool: ...


class IdlePauser:
    """The worker's thread that looks at its sessions, pausing those idle ``after_s`` and quiet."""

    def __init__(self, sessions: Callable[[], Iterable[Pausable]], after_s: float) -> None:
        self._sessions = sessions
        self._after_s = after_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="idle-pause", daemon=True)

    def start(self) -> IdlePauser:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self) -> None:
        while not self._stop.wait(max(MIN_CHECK_EVERY_S, min(CHECK_EVERY_S, self._after_s / 2))):
            for session in self._sessions():
                try:
                    session.pause_if_idle(self._after_s)
                except Exception:  # a bug must cost a pause, never the pauser
                    log.exception("internal error pausing an idle session")
