"""The router's workers and what each holds: its slots in flight and its session places.

Both a placement (a job, a new session) and a placed session (its steps,
its forks, its end) take and give back the same slots and places, under one
lock; the roster is that bookkeeping and nothing else. Which worker to choose,
probing and discovery are ``_placement``'s.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import structlog

from readie_worker.errors import SandboxSetupError
from readie_worker.metrics import Metrics

from ._members import Member

log = structlog.get_logger("readie.placement")

__all__ = ["EVICT_AFTER_FAILURES", "PLACEMENT_POLL_S", "Roster"]

# One missed probe can be a hiccup; three in a row is a dead worker.
EVICT_AFTER_FAILURES = 3
PLACEMENT_POLL_S = 0.02


@dataclass(eq=False)
class Roster:
    """The members and their counts; ``lock`` guards both and is notified whenever one frees up."""

    wait_s: float  # how long a step waits for a slot on its session's worker
    max_sessions: int  # sessions the router keeps open across its workers
    metrics: Metrics | None = None
    members: list[Member] = field(default_factory=list)
    lock: threading.Condition = field(default_factory=threading.Condition)

    def take_slot(self, member: Member) -> None:
        """A slot on ``member``, as ``_choose`` would give, for a session's step: it cannot go elsewhere.

        Waits (up to ``wait_s``) for one, so the step does not queue on the
        worker behind other work; if the worker is unhealthy or none frees up,
        the step is sent anyway and its stream tells what became of the worker.
        """
        deadline = time.monotonic() + self.wait_s
        with self.lock:
            while member.healthy and member.free() <= 0 and (remaining := deadline - time.monotonic()) > 0:
                self.lock.wait(min(remaining, PLACEMENT_POLL_S * 50))
            member.in_flight += 1

    def take_fork_place(self, member: Member) -> None:
        """A slot and a session place on ``member``, for a fork of one of its sessions (which
        cannot go elsewhere: its image is there); SandboxSetupError past ``max_sessions``."""
        with self.lock:
            if sum(m.sessions for m in self.members) >= self.max_sessions:
                raise SandboxSetupError(f"this router keeps at most {self.max_sessions} sessions, and all are open")
            member.sessions += 1
        try:
            self.take_slot(member)
        except BaseException:
            with self.lock:
                member.sessions -= 1
            raise

    def release(self, member: Member, *, session: bool = False) -> None:
        """A slot (and a session place) taken by ``_choose`` given back."""
        with self.lock:
            member.in_flight -= 1
            if session:
                member.sessions -= 1
            self.lock.notify_all()
            dropped = self.drop_if_done(member)
        if dropped:
            member.client.close()

    def mark_failed(self, member: Member) -> None:
        with self.lock:
            if member.healthy:  # several calls lost with it count as one eviction
                self.count_eviction("lost")
            member.healthy = False
            member.failures = EVICT_AFTER_FAILURES
        log.warning("worker lost under a job; evicted until it answers a probe", worker=member.name or member.client.address)

    def drop_if_done(self, member: Member) -> bool:
        """Forget ``member`` if it is retired and nothing runs there any more (under the lock); the
        caller closes its channel, outside the lock."""
        if not (member.retired and member.idle() and member in self.members):
            return False
        self.members.remove(member)
        log.info("retired worker dropped", worker=member.name or member.client.address)
        return True

    def count_eviction(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.worker_evicted(reason)
