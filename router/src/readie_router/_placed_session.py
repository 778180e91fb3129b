"""A session on the worker ``Placement`` chose for it: steps, hibernation and forks there."""

from __future__ import annotations

from typing import TYPE_CHECKING

from readie_rpc.remote_session import RemoteSession, SessionLost
from readie_protocol.cancel import NEVER, Cancellation
from readie_worker.errors import PoolWorkerError
from readie_worker.jobs import HostFunction, OutputSink, Step
from readie_worker.sessions import StepOutcome

from ._members import Member

if TYPE_CHECKING:
    from ._placement import Placement

__all__ = ["PlacedSession"]


class PlacedSession:
    """A session on the worker ``Placement`` chose for it: its steps count against that worker's slots."""

    def __init__(self, placement: Placement, member: Member, remote: RemoteSession) -> None:
        self._placement = placement
        self._member = member
        self._remote = remote
        self.id = remote.id
        self._counted = True  # holds one of the member's session places until it ends
        # Why the router ended it under its client, if it did: the next step is then the
        # router's failure (PoolWorkerError, the session gone), not the client's mistake.
        self.ended_by: str | None = None

    @property
    def ended(self) -> bool:
        return self._remote.ended

    def run_step(
        self,
        step: Step,
        *,
        job_id: str | None = None,
        host: HostFunction | None = None,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> StepOutcome:
        """``RemoteSession.run_step`` once the session's worker has a free slot, counted as in flight there."""
        if self.ended_by is not None:
            raise PoolWorkerError(f"the session has ended: {self.ended_by}")
        placement = self._placement
        placement._take_slot(self._member)
        try:
            return self._remote.run_step(step, job_id=job_id, host=host, cancel=cancel, output=output)
        except SessionLost:
            placement._mark_failed(self._member)  # as for a job lost with its worker
            raise
        finally:
            placement._release(self._member)
            if self._remote.ended:
                self._forget()

    @property
    def hibernated(self) -> bool:
        return self._remote.hibernated

    def hibernate(self, cancel: Cancellation = NEVER) -> float:
        """``RemoteSession.hibernate`` on a slot of the session's worker: a checkpoint costs it CPU.
        The session stays pinned to that worker, whose disk holds its image (decision 0022)."""
        if self.ended_by is not None:
            raise PoolWorkerError(f"the session has ended: {self.ended_by}")
        self._placement._take_slot(self._member)
        try:
            return self._remote.hibernate(cancel)
        except SessionLost:
            self._placement._mark_failed(self._member)  # as for a step lost with its worker
            raise
        finally:
            self._placement._release(self._member)
            if self._remote.ended:
                self._forget()

    def fork(self, cancel: Cancellation = NEVER) -> tuple[PlacedSession, float]:
        """``RemoteSession.fork`` on a slot of this session's worker, where the fork stays too:
        it takes a session place there and under the router's ``max_sessions``."""
        if self.ended_by is not None:
            raise PoolWorkerError(f"the session has ended: {self.ended_by}")
        placement, member = self._placement, self._member
        placement._take_fork_place(member)
        try:
            remote, fork_ms = self._remote.fork(cancel)
        except BaseException as exc:
            placement._release(member, session=True)
            if isinstance(exc, SessionLost):
                placement._mark_failed(member)
            raise
        finally:
            if self._remote.ended:
                self._forget()
        placement._release(member)  # the slot; the session place is the fork's now
        fork = PlacedSession(placement, member, remote)
        with placement._lock:
            placement._sessions.add(fork)
        return fork, fork_ms

    def close(self) -> None:
        try:
            self._remote.close()
        finally:
            self._forget()

    def _forget(self) -> None:
        placement = self._placement
        with placement._lock:
            if not self._counted:
                return
            self._counted = False
            self._member.sessions -= 1
            placement._sessions.discard(self)
            placement._lock.notify_all()
            dropped = placement._drop_if_done(self._member)
        if dropped:
            self._member.client.close()
