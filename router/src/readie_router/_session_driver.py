"""The session driver: what ``readie pool`` does with the steps and closes of named sessions.

``_sessions`` decides what a line naming a session means; this runs it.
Each accepted step or close is a task of the engine's, holds a permit until
it is answered, and waits for the request of its session read before it; a
step holds one of the engine's ``workers`` slots only while it runs, so an
idle session costs a sandbox and no slot. The first step opens the session
through the backend (``open_session``) with a job built as any job is
(``_job_building``); later steps go to its handle. A session idle for
``session_idle`` is closed by a timer, without an output line (nobody asked).

The driver shares the engine's slots, stats, output and task set: it is the
engine's session half, split out to keep each readable, not a second engine.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

import structlog
from readie_worker.cancel import Cancellation
from readie_worker.errors import Cancelled, PoolWorkerError, ReadieError, RequestError
from readie_worker.policy import Policy, resolve_step
from readie_worker.sessions import StepOutcome

from readie_worker.jobs import DEFAULT_INLINE_NAME, Step

from ._backend import BackendSession
from readie_protocol.events import ClosedEvent

from ._events import JobResult
from ._job_building import check_max_output, code_job, request_policy
from readie_protocol.requests import CloseSession, JobRequest
from ._results import job_result
from ._sessions import NamedSession, SessionPhase, SessionTable

if TYPE_CHECKING:
    from ._engine import PoolEngine

__all__ = ["SessionDriver"]

log = structlog.get_logger("readie.pool")


class SessionDriver:
    """Steps and closes of the sessions in :attr:`table`, run on the engine's slots and output."""

    def __init__(self, engine: PoolEngine) -> None:
        self._engine = engine
        self._setup = engine.setup
        self.table = SessionTable(engine.setup.max_sessions)

    def accept_step(self, request: JobRequest, parsed_at: int, cancel: Cancellation) -> None:
        """Queue a step; ``cancel`` (the client's cancel of it) stops it, which ends its session."""
        try:
            session, first = self.table.admit(request)
        except RequestError as exc:
            self._engine._cancelled_with(request.id, cancel)
            self._engine._finish(
                JobResult.from_error(request.id, exc, runtime=self._setup.runtime, session=request.session)
            )
            return
        if first:
            self._engine.stats.session_started()
        previous, done = session.enqueue()
        self._engine._spawn(self._session_step(session, request, parsed_at, previous, done, cancel))

    def accept_close(self, request: CloseSession) -> None:
        session = self.table.get(request.session)
        if session is None:  # never opened, or ended already: closed either way
            self._engine._answer(ClosedEvent(request.id, request.session))
            return
        if self.table.closing(session):
            self._engine.stats.session_ended()
        previous, done = session.enqueue()
        self._engine._spawn(self._session_close(session, request, previous, done))

    async def _session_step(
        self,
        session: NamedSession,
        request: JobRequest,
        parsed_at: int,
        previous: asyncio.Event | None,
        done: asyncio.Event,
        cancel: Cancellation,
    ) -> None:
        result: JobResult | None = None
        try:
            if previous is not None:
                await previous.wait()
            result = await self._step_result(session, request, parsed_at, cancel)
        except Exception as exc:  # a bug must cost this step (and its session), never the pool
            log.exception("internal error running a session step", id=request.id)
            error = PoolWorkerError(f"internal error: {type(exc).__name__}: {exc}")
            result = JobResult.from_error(
                request.id, error, runtime=self._setup.runtime, session=session.name
            )
            self.close_in_background(session, "internal error")
        finally:
            # Answered before the next request of the session may start.
            self._engine._cancelled_with(request.id, cancel)
            session.answered()
            if result is not None:
                self._engine._finish(result)
            done.set()
            self._arm_idle_timer(session)

    async def _step_result(
        self, session: NamedSession, request: JobRequest, parsed_at: int, cancel: Cancellation
    ) -> JobResult:
        runtime, name = self._setup.runtime, session.name
        if session.ended:
            why = RequestError(f"session {name!r} ended before this step ran", "session")
            return JobResult.from_error(request.id, why, runtime=runtime, session=name)
        first = session.handle is None
        try:
            if first:
                policy = request_policy(self._setup, request)
                job = await code_job(self._setup, request, policy)
                session.functions = job.functions
            else:
                assert session.policy is not None
                policy = resolve_step(session.policy, request, self._setup.config.limits)
                check_max_output(policy)
        except ReadieError as exc:  # refused before anything ran
            if first:
                self._end_session(session)
            return JobResult.from_error(request.id, exc, runtime=runtime, session=name)
        async with self._engine._slots:
            queue_us = max(0, (self._engine._now_ns() - parsed_at) // 1000)
            host = self._engine._host_for(request.id, session.functions)
            output = self._engine._output_for(request)
            try:
                if cancel.cancelled:
                    raise Cancelled("the step was cancelled by the client before it ran")
                if first:
                    opened = await self._engine.backend.open_session(job, str(request.id), host, output, cancel)
                    session.handle, outcome = opened
                    session.policy = policy
                    if session.phase is SessionPhase.OPENING:  # not CLOSING already
                        session.move(SessionPhase.OPEN)
                else:
                    assert session.handle is not None
                    step = Step(
                        code=request.code or "",
                        name=request.name or DEFAULT_INLINE_NAME,
                        args=request.args,
                        timeout_ms=policy.timeout_ms,
                        max_output=policy.max_output,
                        report_files=request.report_files,
                    )
                    outcome = await session.handle.run_step(step, str(request.id), host, output, cancel)
                self._engine._count_host(outcome.outcome)
            except ReadieError as exc:
                # A refusal of the first step leaves no session; any other failure ends it.
                if first or not isinstance(exc, RequestError):
                    self.close_in_background(session, "its backend failed")
                return JobResult.from_error(
                    request.id,
                    exc,
                    runtime=runtime,
                    policy=None if isinstance(exc, RequestError) else policy,
                    queue_us=queue_us,
                    session=name,
                )
        if outcome.session_ended:
            self._end_session(session)  # the backend's side has ended already
        return self._step_line(request, outcome, policy, queue_us, name)

    def _step_line(
        self, request: JobRequest, outcome: StepOutcome, policy: Policy, queue_us: int, name: str
    ) -> JobResult:
        return job_result(
            request.id,
            outcome.outcome,
            runtime=self._setup.runtime,
            policy=policy,
            queue_us=queue_us,
            session=name,
            step=outcome.step,
            session_ended=outcome.session_ended,
        )

    async def _session_close(
        self,
        session: NamedSession,
        request: CloseSession,
        previous: asyncio.Event | None,
        done: asyncio.Event,
    ) -> None:
        try:
            if previous is not None:
                await previous.wait()
            handle = self._end_session(session)
            if handle is not None:
                await handle.close()
        except Exception:  # the session is out of the table either way; the close is answered
            log.exception("internal error closing a session", session=session.name)
        finally:
            session.answered()
            self._engine._answer(ClosedEvent(request.id, request.session))
            done.set()

    def _end_session(self, session: NamedSession) -> BackendSession | None:
        """Take ``session`` out of the table and the count, at once, so the next request under
        its name starts a new one; returns its handle for the caller to close (or None)."""
        if self.table.end(session):
            self._engine.stats.session_ended()
        return session.handle

    def close_in_background(self, session: NamedSession, why: str) -> None:
        handle = self._end_session(session)
        if handle is not None:
            log.info("closing a session", session=session.name, why=why)
            self._engine._spawn(handle.close())

    def _arm_idle_timer(self, session: NamedSession) -> None:
        if session.phase is not SessionPhase.OPEN or session.pending or not self._engine.serving:
            return
        session.stop_idle_timer()
        loop = asyncio.get_running_loop()
        session.idle = loop.call_later(
            self._setup.session_idle_ms / 1000, self._idle_expired, session
        )

    def _idle_expired(self, session: NamedSession) -> None:
        session.idle = None
        if session.phase is SessionPhase.OPEN and not session.pending:
            self.close_in_background(session, "idle")
