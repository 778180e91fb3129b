"""Where a job's time goes inside the runner: each named phase's microseconds, in its result.

The clock starts when the executor begins the call (:func:`readie_executor._calls.call_started_ns`:
before the request is unpickled) and every :meth:`PhaseClock.lap` charges the time since the
previous lap to one phase of :data:`._bounds.RUNNER_PHASES`. What is left outside is the
framing and the two socket hops, which only the worker's clock sees.

These are the runner's own figures, for the bench: the job runs in this process and could forge
them, so the worker only checks their shape (``_job_result``). Only a job that asks (its spec's
``phases``) is timed: a lap is a clock read, and for about a second after a restore gVisor has no
calibrated clock to offer in the vDSO, so every read is a system call (decision 33).
"""

from __future__ import annotations

import time

from ._bounds import RUNNER_PHASES

__all__ = ["PhaseClock", "UNTIMED"]


class PhaseClock:
    """Laps on one monotonic clock, summed per phase (a phase may be lapped more than once)."""

    __slots__ = ("_last", "_spent_ns", "on")

    def __init__(self, started_ns: int | None = None, *, on: bool = True) -> None:
        # None: not inside an executor call (a test calling run_job): the clock starts now.
        self.on = on
        self._last = 0 if not on else time.perf_counter_ns() if started_ns is None else started_ns
        self._spent_ns: dict[str, int] = {}

    def lap(self, phase: str) -> None:
        """Charge the time since the last lap to ``phase`` (one of RUNNER_PHASES)."""
        if not self.on:
            return
        now = time.perf_counter_ns()
        self._spent_ns[phase] = self._spent_ns.get(phase, 0) + max(0, now - self._last)
        self._last = now

    def microseconds(self) -> dict[str, int]:
        """The phases lapped so far, in RUNNER_PHASES' order, in whole microseconds."""
        return {phase: self._spent_ns[phase] // 1000 for phase in RUNNER_PHASES if phase in self._spent_ns}


# The clock of a job that did not ask to be timed: it reads nothing.
UNTIMED = PhaseClock(on=False)
