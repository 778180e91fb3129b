"""A named session's idle timers: closed at ``session_idle``, hibernated at ``session_hibernate``.

The session driver (``_session_driver``) arms them each time a session's last queued request is
answered (:meth:`IdleTimers.arm`); a request queued in the session stops them
(:meth:`~readie_pool._sessions.NamedSession.enqueue`). A close timer ends the session without an
output line (nobody asked); a hibernation timer queues the pool's own hibernation in the session,
as a request would be, while the close timer keeps running (decision 0022).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

import structlog
from readie_protocol.connection import PoolEvent
from readie_protocol.results import Result

from ._sessions import NamedSession, SessionPhase
from ._tasks import PoolTasks

__all__ = ["IdleTimers"]

log = structlog.get_logger("readie.pool")


class IdleTimers:
    """The idle timers of the driver's sessions; ``close`` and ``hibernate`` are the driver's."""

    def __init__(
        self,
        tasks: PoolTasks,
        serving: Callable[[], bool],
        close: Callable[[NamedSession, str], None],
        hibernate: Callable[[NamedSession], Awaitable[PoolEvent | Result]],
    ) -> None:
        self._tasks = tasks
        self._setup = tasks.setup
        self._serving = serving  # the engine's: no idle timers once it drains
        self._close = close
        self._hibernate = hibernate

    def arm(self, session: NamedSession) -> None:
        """Start ``session``'s idle timers, if it is open, idle, and the pool serves."""
        if session.phase is not SessionPhase.OPEN or session.pending or not self._serving():
            return
        session.stop_idle_timer()
        loop = asyncio.get_running_loop()
        session.idle_since = loop.time()
        session.idle = loop.call_later(self._setup.session_idle_ms / 1000, self._expired, session)
        hibernate_ms = self._setup.session_hibernate_ms
        if hibernate_ms is not None and session.handle is not None and not session.handle.hibernated:
            session.hibernation = loop.call_later(hibernate_ms / 1000, self._hibernate_now, session)

    def _expired(self, session: NamedSession) -> None:
        session.idle = None
        if session.phase is SessionPhase.OPEN and not session.pending:
            self._close(session, "idle")

    def _hibernate_now(self, session: NamedSession) -> None:
        session.hibernation = None
        if session.phase is SessionPhase.OPEN and not session.pending and session.handle is not None:
            previous, done = session.enqueue(idle=True)
            self._tasks.spawn(self._hibernation(session, previous, done))

    async def _hibernation(self, session: NamedSession, previous: asyncio.Event | None, done: asyncio.Event) -> None:
        try:
            if previous is not None:
                await previous.wait()
            answer = await self._hibernate(session)
            if isinstance(answer, Result) and answer.error is not None:  # nobody asked: logged, not answered
                log.warning("a session could not hibernate", session=session.name, error=answer.error.message)
        except Exception:  # a bug must cost this session, never the pool
            log.exception("internal error hibernating an idle session", session=session.name)
            self._close(session, "internal error")
        finally:
            session.answered()
            done.set()
            if session.idle is None and session.phase is SessionPhase.OPEN and not session.pending and self._serving():
                # Its close timer came due while it hibernated: what is left of session_idle.
                loop = asyncio.get_running_loop()
                left = session.idle_since + self._setup.session_idle_ms / 1000 - loop.time()
                session.idle = loop.call_later(max(0.0, left), self._expired, session)

