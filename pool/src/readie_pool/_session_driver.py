"""The session driver: what ``readie pool`` does with the steps and closes of named sessions.

``_sessions`` decides what a line naming a session means; this runs it.
Each accepted step or close is a task of the engine's, holds a permit until
it is answered, and waits for the request of its session read before it; a
step holds one of the engine's ``workers`` slots only while it runs, so an
idle session costs a sandbox and no slot. The first step opens the session
through the backend (``open_session``) with a job built as any job is
(``_job_building``); later steps go to its handle, from intake itself when nothing
waits before them and a slot is free (decision 0033: no task, the answer's callback
finishes the step). A session idle for ``session_idle`` is closed by a timer
(``_session_idle``), without an output line (nobody asked).

Hibernation (decision 0022): ``{"hibernate": true}`` and ``{"fork": name}``
queue in their session like a step and hold a slot while they run. A
session's file transfers (decision 31: ``upload``, ``download``, ``list``;
``_transfers`` moves them, one chunk per request) queue in it too, but take
no slot, as the worker's take none: a large file moving never holds back
other sessions' steps, nor do their steps hold it back. A fork's
new name is in the table at once (OPENING), so its first steps wait for the
fork. A session idle for ``session_hibernate`` is hibernated by a timer, as
the pool's own queued request: its close timer keeps running meanwhile.

Durable sessions (decision 32): a session's first result carries its
``session_key``; ``{"attach": key}`` holds a stored session under a name of
this pool's (reserved at once, as a fork's, so its first steps wait for the
attach; the attach holds a slot, since its holder may make it wait); a step
whose worker was lost (``StepLost``) is answered ``lost`` and leaves the
session open; :meth:`SessionDriver.detach_all` lets every session go into the
store instead of closing it. Keys are never logged.

The driver runs on the same :class:`~readie_pool._tasks.PoolTasks` as the
engine's jobs (slots, stats, answers, the task set), and knows of the engine
only whether it is still serving.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeAlias

import structlog
from readie_protocol.cancel import Cancellation
from readie_worker.errors import ErrorType, ReadieError, RequestError, SandboxSetupError, internal_error
from readie_worker.sessions import StepOutcome

from readie_worker.jobs import CodeJob, HostFunction, OutputSink, Step

from ._backend import BackendSession, detach_logged
from readie_protocol.connection import PoolEvent
from readie_protocol.events import AttachedEvent, ClosedEvent, ForkedEvent, HibernatedEvent

from ._job_building import code_job, later_step
from readie_protocol.requests import AttachSession, CloseSession, ForkSession, HibernateSession, JobRequest
from readie_protocol.wire import RequestId
from readie_protocol.results import Result
from ._results import error_result, step_result
from ._session_idle import IdleTimers
from ._sessions import NamedSession, SessionPhase, SessionTable, not_open
from ._tasks import PoolTasks, ResultAhead, Started
from ._transfers import Transfer, TransferEvent, move

__all__ = ["SessionDriver"]

log = structlog.get_logger("readie.pool")

#: What a request queued in its session like a hibernation answers with: its event, or a result.
_Answer: TypeAlias = PoolEvent | Result


class SessionDriver:
    """Steps and closes of the sessions in :attr:`table`, run as the pool's tasks (:class:`PoolTasks`)."""

    def __init__(self, tasks: PoolTasks, serving: Callable[[], bool]) -> None:
        self._tasks = tasks
        self._setup = tasks.setup
        self.table = SessionTable(tasks.setup.max_sessions)
        self._idle = IdleTimers(tasks, serving, self.close_in_background, lambda session: self._hibernated(session, None))

    async def accept_step(self, request: JobRequest, parsed_at: int, cancel: Cancellation) -> None:
        """Queue a step; ``cancel`` (the client's cancel of it) stops it, which ends its session. A later step
        with nothing before it and a slot free goes to the backend here, before its task starts."""
        try:
            session, first = self.table.admit(request)
        except RequestError as exc:
            self._tasks.cancelled_with(request.id, cancel)
            return self._refuse(request.id, request.session, exc)
        if first:
            self._tasks.stats.session_started()
        previous, done = session.enqueue()
        ahead: ResultAhead[StepOutcome] | None = self._tasks.ahead_for(request)  # a later step's
        idle = previous is None or previous.is_set()  # every request before it answered
        started = await self._start_now(session, request, parsed_at, cancel, ahead) if idle else None
        if started is None:
            self._tasks.spawn(self._session_step(session, request, parsed_at, previous, done, cancel, ahead))
            return

        def answered(reached: Callable[[], tuple[StepOutcome, int] | Result] | None) -> None:
            result: Result | None = None
            try:
                if reached is not None:
                    result = self._step_answer(session, request, started, reached(), ahead, first=False)
            except Exception as exc:  # a bug must cost this step (and its session), never the pool
                result = self._step_bug(session, request, exc, ahead)
            finally:
                self._step_answered(session, request, cancel, done, ahead, result)

        self._tasks.follow(started, answered)

    def accept_close(self, request: CloseSession) -> None:
        session = self.table.get(request.session)
        if session is None:  # never opened, or ended already: closed either way
            self._tasks.answer(ClosedEvent(request.id, request.session))
            return
        if self.table.closing(session):
            self._tasks.stats.session_ended()
        previous, done = session.enqueue()
        self._tasks.spawn(self._session_close(session, request, previous, done))

    def accept_hibernate(self, request: HibernateSession) -> None:
        self._in_turn(request, "hibernating", lambda session: self._hibernated(session, request.id))

    def accept_transfer(self, request: Transfer) -> None:
        """Queue an upload, download or list chunk in its session, as a hibernation is."""
        self._in_turn(request, "moving files of", lambda session: self._transferred(session, request))

    def _in_turn(
        self, request: HibernateSession | Transfer, doing: str, work: Callable[[NamedSession], Awaitable[_Answer]]
    ) -> None:
        """Answer ``request`` with what ``work`` gives once its session's requests before it are answered;
        refused at once when no session of its name is open."""
        session = self.table.get(request.session)
        if session is None:
            self._refuse(request.id, request.session, not_open(request.session), ended=True)
            return
        previous, done = session.enqueue()
        self._tasks.spawn(self._queued(session, request.id, previous, done, doing, work))

    def accept_fork(self, request: ForkSession) -> None:
        source = self.table.get(request.session)
        if source is None:
            self._refuse(request.id, request.session, not_open(request.session), ended=True)
            return
        try:
            target = self.table.reserve(request.fork)
        except RequestError as exc:
            self._refuse(request.id, request.session, exc)
            return
        self._tasks.stats.session_started()
        previous, done = source.enqueue()
        _, target_done = target.enqueue()  # the fork's own steps wait for it
        self._tasks.spawn(self._session_fork(source, target, request, previous, (done, target_done)))

    def accept_attach(self, request: AttachSession) -> None:
        """Hold the session stored under ``request.key`` as ``request.session``; refused at once when
        that name is open here or ``max_sessions`` are."""
        try:
            target = self.table.reserve(request.session, field="session")
        except RequestError as exc:
            self._refuse(request.id, request.session, exc)
            return
        self._tasks.stats.session_started()
        _, done = target.enqueue()  # its steps wait for the attach
        self._tasks.spawn(self._session_attach(target, request, done))

    def sessions_hibernated(self) -> int:
        return sum(1 for session in self.table.sessions() if session.handle is not None and session.handle.hibernated)

    def _refuse(self, request_id: RequestId, name: str, error: ReadieError, *, ended: bool = False) -> None:
        """A refused step, hibernate or fork; ``ended``: the session is not open (an idle close, say),
        which the result says with ``session_ended``, so a client stops taking it for open."""
        self._tasks.finish(
            error_result(request_id, error, runtime=self._setup.runtime, session=name, session_ended=ended)
        )

    async def _queued(
        self,
        session: NamedSession,
        request_id: RequestId,
        previous: asyncio.Event | None,
        done: asyncio.Event,
        doing: str,
        work: Callable[[NamedSession], Awaitable[_Answer]],
    ) -> None:
        answer: _Answer | None = None
        try:
            if previous is not None:
                await previous.wait()
            answer = await work(session)
        except Exception as exc:  # a bug must cost this session, never the pool
            log.exception(f"internal error {doing} a session", session=session.name)
            answer = self._failed(request_id, session, internal_error(exc), "internal error")
        finally:
            session.answered()
            self._send(answer)
            done.set()
            self._idle.arm(session)

    async def _hibernated(self, session: NamedSession, request_id: RequestId | None) -> HibernatedEvent | Result:
        if session.ended or session.handle is None:
            why = RequestError(f"session {session.name!r} ended before it could hibernate", "session")
            return error_result(request_id, why, runtime=self._setup.runtime, session=session.name)
        try:
            async with self._tasks.slots:
                hibernate_ms = await session.handle.hibernate()
        except ReadieError as exc:
            return self._failed(request_id, session, exc, "it could not hibernate")
        if hibernate_ms:
            self._tasks.stats.session_image("hibernations", hibernate_ms)
        return HibernatedEvent(request_id, session.name, round(hibernate_ms))  # type: ignore[arg-type]

    async def _session_fork(
        self,
        source: NamedSession,
        target: NamedSession,
        request: ForkSession,
        previous: asyncio.Event | None,
        done: tuple[asyncio.Event, asyncio.Event],
    ) -> None:
        answer: ForkedEvent | Result | None = None
        try:
            if previous is not None:
                await previous.wait()
            answer = await self._forked(source, target, request.id)
        except Exception as exc:  # a bug must cost these sessions, never the pool
            log.exception("internal error forking a session", session=source.name)
            answer = self._failed(request.id, source, internal_error(exc), "it could not fork")
        finally:
            if target.handle is None:
                self._end_session(target)
            for session, event in zip((source, target), done, strict=True):
                session.answered()
                event.set()
            self._send(answer)
            for session in (source, target):
                self._idle.arm(session)

    async def _forked(self, source: NamedSession, target: NamedSession, request_id: RequestId) -> ForkedEvent | Result:
        if source.ended or source.handle is None or target.ended:
            why = RequestError(f"session {source.name!r} ended before it could fork", "session")
            return error_result(request_id, why, runtime=self._setup.runtime, session=source.name)
        try:
            async with self._tasks.slots:
                handle, fork_ms = await source.handle.fork()
        except ReadieError as exc:
            return self._failed(request_id, source, exc, "it could not fork")
        self._tasks.stats.session_image("forks", fork_ms)
        target.handle, target.job, target.functions = handle, source.job, source.functions
        if target.phase is SessionPhase.OPENING:
            target.move(SessionPhase.OPEN)
        elif target.ended:  # the pool is ending: nobody will close it otherwise
            self._tasks.spawn(handle.close())
        return ForkedEvent(request_id, source.name, target.name, round(fork_ms), session_key=handle.key)

    async def _session_attach(self, session: NamedSession, request: AttachSession, done: asyncio.Event) -> None:
        answer: AttachedEvent | Result | None = None
        try:
            answer = await self._attached(session, request)
        except Exception as exc:  # a bug must cost this attach, never the pool
            log.exception("internal error attaching a session", session=session.name)
            answer = error_result(request.id, internal_error(exc), runtime=self._setup.runtime,
                                  session=session.name, session_ended=True)
        finally:
            if session.handle is None:
                self._end_session(session)
            session.answered()
            done.set()
            self._send(answer)
            self._idle.arm(session)

    async def _attached(self, session: NamedSession, request: AttachSession) -> AttachedEvent | Result:
        try:
            async with self._tasks.slots:
                handle, step = await self._tasks.backend.attach_session(request.key)
        except ReadieError as exc:  # no session of that name here: say so (session_ended)
            return error_result(request.id, exc, runtime=self._setup.runtime, session=session.name, session_ended=True)
        session.handle, session.job, session.functions = handle, handle.job, handle.job.functions
        if session.phase is SessionPhase.OPENING:  # not CLOSING already: its close follows
            session.move(SessionPhase.OPEN)
        log.info("attached a session", session=session.name, step=step)
        return AttachedEvent(request.id, session.name, step)

    def _failed(self, request_id: RequestId | None, session: NamedSession, error: ReadieError, why: str) -> Result:
        """The answer to a hibernate, fork or transfer that failed: refused (RequestError, or the worker's
        image bounds: SandboxSetupError), the session goes on; anything else has ended it."""
        ended = not isinstance(error, RequestError | SandboxSetupError)
        if ended:
            self.close_in_background(session, why)
        return error_result(
            request_id, error, runtime=self._setup.runtime, session=session.name, session_ended=ended
        )

    async def _transferred(self, session: NamedSession, request: Transfer) -> TransferEvent | Result:
        if session.ended or session.handle is None or session.job is None:
            why = RequestError(f"session {session.name!r} ended before its files could move", "session")
            return error_result(request.id, why, runtime=self._setup.runtime, session=session.name, session_ended=True)
        try:
            return await move(session.handle, request, session.job)  # no slot: see the module docstring
        except ReadieError as exc:
            return self._failed(request.id, session, exc, "its files could not move")

    def _send(self, answer: _Answer | None) -> None:
        if isinstance(answer, Result):
            self._tasks.finish(answer)
        elif answer is not None:
            self._tasks.answer(answer)

    async def _session_step(
        self,
        session: NamedSession,
        request: JobRequest,
        parsed_at: int,
        previous: asyncio.Event | None,
        done: asyncio.Event,
        cancel: Cancellation,
        ahead: ResultAhead[StepOutcome] | None,
    ) -> None:
        result: Result | None = None
        try:
            if previous is not None:
                await previous.wait()
            result = await self._step_result(session, request, parsed_at, cancel, ahead)
        except Exception as exc:  # a bug must cost this step (and its session), never the pool
            result = self._step_bug(session, request, exc, ahead)
        finally:
            self._step_answered(session, request, cancel, done, ahead, result)

    def _step_bug(
        self, session: NamedSession, request: JobRequest, exc: Exception, ahead: ResultAhead[StepOutcome] | None
    ) -> Result:
        log.exception("internal error running a session step", id=request.id)
        error = error_result(request.id, internal_error(exc), runtime=self._setup.runtime, session=session.name)
        self.close_in_background(session, "internal error")
        return self._tasks.bug_result(request.id, error, ahead)

    def _step_answered(
        self, session: NamedSession, request: JobRequest, cancel: Cancellation, done: asyncio.Event,
        ahead: ResultAhead[StepOutcome] | None, result: Result | None,
    ) -> None:
        # Answered before the next request of the session may start.
        self._tasks.cancelled_with(request.id, cancel)
        session.answered()
        if result is not None:
            self._tasks.finish(result, ahead=ahead)
        done.set()
        self._idle.arm(session)

    async def _step_result(
        self, session: NamedSession, request: JobRequest, parsed_at: int, cancel: Cancellation,
        ahead: ResultAhead[StepOutcome] | None,
    ) -> Result:
        """The step's result; ``ahead`` builds it on the job's thread for a later step (a first step's line
        carries the key of the handle the loop keeps)."""
        runtime, name = self._setup.runtime, session.name
        first = session.handle is None
        if session.ended:
            why = RequestError(f"session {name!r} ended before this step ran", "session")
            return error_result(request.id, why, runtime=runtime, session=name)
        try:
            if first:
                job, step = await code_job(self._setup, request), None
                session.functions = job.functions
            else:
                assert session.job is not None
                step, job = later_step(self._setup, session.job, request)
        except ReadieError as exc:  # refused before anything ran
            if first:
                self._end_session(session)
            return error_result(request.id, exc, runtime=runtime, session=name)
        await self._tasks.slots.acquire()
        started = self._start(session, request, parsed_at, cancel, None if first else ahead, job, step)
        return self._step_answer(session, request, started, await self._tasks.reached(started), ahead, first=first)

    def _step_answer(
        self, session: NamedSession, request: JobRequest, started: Started[StepOutcome],
        reached: tuple[StepOutcome, int] | Result, ahead: ResultAhead[StepOutcome] | None, *, first: bool,
    ) -> Result:
        """A step's result from what the backend answered (``reached``), the session's table and stats
        kept: on the loop, in the step's task or (``accept_step``) the answer's callback."""
        if isinstance(reached, Result):
            # A refusal of the first step leaves no session; a lost step (decision 32) leaves it open
            # (its next step resumes from the store); any other failure ends it.
            ends = reached.error is None or reached.error.type != ErrorType.REQUEST
            if first or (ends and not reached.lost):
                self.close_in_background(session, "its backend failed")
            return reached
        outcome, queue_us = reached
        self._tasks.count_host(outcome.outcome)
        if outcome.session_ended:
            self._end_session(session)  # the backend's side has ended already
        if outcome.resumed_ms is not None:
            self._tasks.stats.session_image("resumes", outcome.resumed_ms)
        if ahead is not None and ahead.built is not None:
            return ahead.built
        key = session.handle.key if first and session.handle is not None and not outcome.session_ended else None
        return step_result(
            request.id, outcome, runtime=self._setup.runtime, job=started.job, queue_us=queue_us,
            session=session.name, session_key=key,
        )

    async def _start_now(
        self, session: NamedSession, request: JobRequest, parsed_at: int, cancel: Cancellation,
        ahead: ResultAhead[StepOutcome] | None,
    ) -> Started[StepOutcome] | None:
        """A later step handed to the backend at once, with a slot free; None: its task does it all."""
        if session.handle is None or session.job is None or not self._tasks.slot_free():
            return None  # a first step (its job is built off the loop), or no slot
        try:
            step, job = later_step(self._setup, session.job, request)
            await self._tasks.slots.acquire()  # free: cannot wait
            # PoolTasks.start frees the slot if the hand-over raised.
            return self._start(session, request, parsed_at, cancel, ahead, job, step)
        except ReadieError:  # its task refuses it, as any refused step
            return None
        except Exception:  # a bug: its task meets it again, and answers it
            log.exception("internal error starting a session step", id=request.id)
            return None

    def _start(
        self, session: NamedSession, request: JobRequest, parsed_at: int, cancel: Cancellation,
        ahead: ResultAhead[StepOutcome] | None, job: CodeJob, step: Step | None,
    ) -> Started[StepOutcome]:
        """With a slot taken: the step (or, ``step`` None, the session's opening) handed to the backend."""
        if ahead is not None:
            ahead.build = lambda outcome, queue_us: step_result(
                request.id, outcome, runtime=self._setup.runtime, job=job, queue_us=queue_us, session=session.name
            )
        reach = self._reach(session, job, step, request, cancel, ahead)
        return self._tasks.start(request, job, parsed_at, cancel, reach, what="step", session=session.name, ahead=ahead)

    def _reach(
        self, session: NamedSession, job: CodeJob, step: Step | None, request: JobRequest, cancel: Cancellation,
        then: ResultAhead[StepOutcome] | None,
    ) -> Callable[[HostFunction | None, OutputSink | None], Awaitable[StepOutcome]]:
        """The backend call of a step: a step of its handle (started when called), or the session's
        opening (``step`` None)."""
        if step is not None:
            handle = session.handle
            assert handle is not None
            return lambda host, output: handle.run_step(step, str(request.id), host, output, cancel, then=then)

        async def opening(host: HostFunction | None, output: OutputSink | None) -> StepOutcome:
            session.handle, outcome = await self._tasks.backend.open_session(job, str(request.id), host, output, cancel)
            session.job = job
            if session.phase is SessionPhase.OPENING:  # not CLOSING already
                session.move(SessionPhase.OPEN)
            return outcome

        return opening

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
            self._tasks.answer(ClosedEvent(request.id, request.session))
            done.set()

    def _end_session(self, session: NamedSession) -> BackendSession | None:
        """Take ``session`` out of the table and the count, at once, so the next request under
        its name starts a new one; returns its handle for the caller to close (or None)."""
        if self.table.end(session):
            self._tasks.stats.session_ended()
        return session.handle

    def detach_all(self) -> None:
        """Let every session in the table go without ending it (decision 32): each is detached into
        the session store, where a later attach with its key finds it; one without a key closes."""
        for session in self.table.sessions():
            handle = self._end_session(session)
            if handle is not None:
                log.info("detaching a session", session=session.name)
                self._tasks.spawn(detach_logged(handle, session.name))

    def close_in_background(self, session: NamedSession, why: str) -> None:
        handle = self._end_session(session)
        if handle is not None:
            log.info("closing a session", session=session.name, why=why)
            self._tasks.spawn(handle.close())
