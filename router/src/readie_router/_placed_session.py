"""A session on the worker ``Placement`` chose for it: steps, hibernation, forks and files there.

:class:`OpenSessions` is the set of them the router has open, each holding a
session place on its worker in the :class:`~._roster.Roster` until it ends;
when the router shuts down it lets go of what is left of them (a session with
a key is detached into the store, one without is closed).

A session with a key (decision 32) is not bound to its worker: when that
worker hands it over (a drain) or its stream breaks, its next request
re-places it (``Placement``'s attach, ``take_over`` after a break, the lost
worker evicted) and runs there; a step in flight when the stream broke is
lost (StepLost), and the session goes on.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from readie_rpc.remote_session import RemoteSession, SessionLost
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import StepLost
from readie_worker.errors import PoolWorkerError
from readie_worker.jobs import CodeJob, HostFunction, OutputSink, Step
from readie_worker.sessions import StepOutcome
from readie_protocol.workspace import FileChunk, FileListing

from ._members import Member
from ._roster import Roster

__all__ = ["OpenSessions", "PlacedSession"]

_T = TypeVar("_T")

#: How a session is placed anew by its key (``Placement._attach``): ``(key, take_over, job)`` to
#: the member chosen (its session place taken), the session attached there and its last step.
Attach = Callable[[str, bool, CodeJob], tuple[Member, RemoteSession, int]]


class OpenSessions:
    """The sessions this router placed and has not seen end (under the roster's lock)."""

    def __init__(self, roster: Roster, attach: Attach) -> None:
        self.roster = roster
        self.attach = attach
        self._sessions: set[PlacedSession] = set()

    def __len__(self) -> int:
        with self.roster.lock:
            return len(self._sessions)

    def add(self, member: Member, remote: RemoteSession) -> PlacedSession:
        """The session ``remote`` on ``member``, whose session place it now holds."""
        placed = PlacedSession(self, member, remote)
        with self.roster.lock:
            self._sessions.add(placed)
        return placed

    def moved(self, session: PlacedSession, old: Member) -> None:
        """``session`` holds a place on its new member (taken by the attach): give back ``old``'s."""
        with self.roster.lock:
            if session not in self._sessions:
                return
            old.sessions -= 1
            self.roster.lock.notify_all()
            dropped = self.roster.drop_if_done(old)
        if dropped:
            old.client.close()

    def ended(self, session: PlacedSession) -> None:
        """Give back ``session``'s place on its worker (once; later calls do nothing)."""
        member = session.member
        with self.roster.lock:
            if session not in self._sessions:
                return
            self._sessions.discard(session)
            member.sessions -= 1
            self.roster.lock.notify_all()
            dropped = self.roster.drop_if_done(member)
        if dropped:
            member.client.close()

    def let_go_all(self, reason: str) -> None:
        """Let go of every open session, all at once (each waits for its worker): one with a key
        is detached into the store (another router attaches it by its key), one without is closed,
        its sandbox destroyed; the next step of each here says ``reason``."""
        with self.roster.lock:
            sessions = list(self._sessions)
        if sessions:
            for session in sessions:
                session.ended_by = reason
            with ThreadPoolExecutor(max_workers=len(sessions), thread_name_prefix="close-session") as closing:
                list(closing.map(PlacedSession.detach, sessions))


class PlacedSession:
    """A session on the worker ``Placement`` chose for it: its steps count against that worker's slots."""

    def __init__(self, open_sessions: OpenSessions, member: Member, remote: RemoteSession) -> None:
        self._open = open_sessions  # it holds one of the member's session places until it ends
        self._roster = open_sessions.roster
        self.member = member
        self._remote = remote
        remote.reconnect = self._placed_anew  # re-placed by the router, not re-attached to the same worker
        self.id = remote.id
        # Why the router ended it under its client, if it did: the next step is then the
        # router's failure (PoolWorkerError, the session gone), not the client's mistake.
        self.ended_by: str | None = None

    @property
    def ended(self) -> bool:
        return self._remote.ended

    @property
    def key(self) -> str | None:
        return self._remote.key

    @property
    def job(self) -> CodeJob:
        return self._remote.job

    def _placed_anew(self, key: str, take_over: bool) -> tuple[RemoteSession, int]:
        """The session's ``reconnect``: its worker handed it over, or its stream broke (then that
        worker is evicted, as for a job lost with it); placed where ``Placement`` chooses now."""
        old = self.member
        if take_over:
            self._roster.mark_failed(old)
        member, remote, stored = self._open.attach(key, take_over, self._remote.job)
        self.member = member
        self._open.moved(self, old)
        return remote, stored

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
        member = self.member  # re-placed meanwhile, maybe: the slot is the one taken here
        self._roster.take_slot(member)
        try:
            return self._remote.run_step(step, job_id=job_id, host=host, cancel=cancel, output=output)
        except (SessionLost, StepLost):
            self._roster.mark_failed(self.member)  # as for a job lost with its worker
            raise
        finally:
            self._roster.release(member)
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
        member = self.member
        self._roster.take_slot(member)
        try:
            return self._remote.hibernate(cancel)
        except (SessionLost, StepLost):
            self._roster.mark_failed(self.member)  # as for a step lost with its worker
            raise
        finally:
            self._roster.release(member)
            if self._remote.ended:
                self._forget()

    # Files in the session's workspace (decision 31), relayed to its worker. A chunk takes no
    # slot there (it runs no code, and a transfer must not wait behind other sessions' steps),
    # unless the session is hibernated: its worker resumes it first, which costs a slot's CPU.

    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel: Cancellation = NEVER) -> int:
        return self._relay(lambda: self._remote.upload_chunk(path, offset, data, size, cancel=cancel))

    def download_chunk(self, path: str, offset: int, length: int, *, cancel: Cancellation = NEVER) -> FileChunk:
        return self._relay(lambda: self._remote.download_chunk(path, offset, length, cancel=cancel))

    def list_files(self, path: str, *, cancel: Cancellation = NEVER) -> FileListing:
        return self._relay(lambda: self._remote.list_files(path, cancel=cancel))

    def _relay(self, request: Callable[[], _T]) -> _T:
        if self.ended_by is not None:
            raise PoolWorkerError(f"the session has ended: {self.ended_by}")
        member, slot = self.member, self._remote.hibernated
        if slot:
            self._roster.take_slot(member)
        try:
            return request()
        except (SessionLost, StepLost):
            self._roster.mark_failed(self.member)  # as for a step lost with its worker
            raise
        finally:
            if slot:
                self._roster.release(member)
            if self._remote.ended:
                self._forget()

    def fork(self, cancel: Cancellation = NEVER) -> tuple[PlacedSession, float]:
        """``RemoteSession.fork`` on a slot of this session's worker, where the fork stays too:
        it takes a session place there and under the router's ``max_sessions``."""
        if self.ended_by is not None:
            raise PoolWorkerError(f"the session has ended: {self.ended_by}")
        roster, member = self._roster, self.member
        roster.take_fork_place(member)
        try:
            remote, fork_ms = self._remote.fork(cancel)
        except BaseException as exc:
            roster.release(member, session=True)
            if isinstance(exc, SessionLost):
                roster.mark_failed(member)
            raise
        finally:
            if self._remote.ended:
                self._forget()
        roster.release(member)  # the slot; the session place is the fork's now
        return self._open.add(member, remote), fork_ms

    def close(self) -> None:
        try:
            self._remote.close()
        finally:
            self._forget()

    def detach(self, cancel: Cancellation = NEVER) -> None:
        """Let go without ending it (decision 32): its worker detaches it into the store; one
        without a key is closed."""
        try:
            self._remote.detach(cancel)
        finally:
            self._forget()

    def _forget(self) -> None:
        self._open.ended(self)
