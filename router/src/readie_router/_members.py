"""One worker as ``Placement`` sees it: its client, health, the work this router has there."""

from __future__ import annotations

from dataclasses import dataclass

from readie_rpc.client import WorkerClient
from readie_policy.jobs import Capacity


# Compared by identity: two members are never the same worker, and lists of them are searched.
@dataclass(eq=False)
class Member:
    client: WorkerClient
    name: str = ""
    healthy: bool = False
    capacity: Capacity | None = None
    failures: int = 0
    in_flight: int = 0
    # When its next failed probe is logged: at once, then ever more rarely (see _complain).
    next_complaint: float = 0.0
    complaint_gap_s: float = 0.0
    sessions: int = 0  # placed here by this router and not yet ended
    discovered: bool = False  # found by DNS, not named by --worker: it may be retired
    retired: bool = False  # left the DNS answer: no new work; dropped once idle

    def idle(self) -> bool:
        return self.in_flight == 0 and self.sessions == 0

    def free(self) -> int:
        if not self.healthy or self.capacity is None or self.capacity.draining:
            return 0
        return self.capacity.slots - self.in_flight

    def could_take(self, session: bool) -> bool:
        """Whether the worker takes such new work at all, busy or not."""
        if not self.healthy or self.retired:
            return False
        return not session or (self.capacity is not None and self.capacity.max_sessions > 0)

    def session_room(self) -> int:
        if self.free() <= 0:  # the first step needs a slot too
            return 0
        assert self.capacity is not None
        # The probe counts other routers' sessions too, but is up to an interval old.
        return self.capacity.max_sessions - max(self.capacity.sessions, self.sessions)

    def session_load(self) -> tuple[float, float]:
        assert self.capacity is not None
        return self.sessions / max(1, self.capacity.max_sessions), self.load()

    def load(self) -> float:
        assert self.capacity is not None
        return self.in_flight / max(1, self.capacity.slots)
