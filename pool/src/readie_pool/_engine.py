"""The pool engine: JSONL requests in, results out in completion order, over any byte streams.

One asyncio task reads (intake), one writes, and each accepted job is a task
of its own that waits for one of ``workers`` slots and then for the
:class:`~readie_pool._backend.JobBackend` (whose job thread writes the result
line itself when it can: ``_tasks``, ``ResultAhead``). A job with inline code
that finds a slot free is handed to the backend by intake, before its task
starts (decision 0033: a threaded backend's job thread has it at once), and
its task only awaits the answer; so is a session's later step. Everything the protocol decides
is delegated to the pure layers: :mod:`readie_protocol.lines` splits,
:mod:`readie_protocol.requests` parses, :mod:`readie_policy.policy` resolves
(through ``_job_building``), ``_results`` and ``_events`` build what is written.

Backpressure (the spec: "the pool's queue holds twice the worker count and
stdout backpressure blocks it"): every line the pool accepts holds one of
``QUEUE_FACTOR * workers`` permits until the line that answers it has been
written to stdout. Intake takes a permit before it takes the next line, so
with the permits gone it stops reading stdin, and a client that does not
read stdout stops the pool taking work once its results fill the pipe.
Every accepted line is answered by exactly one output line (a result, a
refusal or a stats event), which is what keeps the count exact.

Host functions (``_host``) add two kinds of line that hold no permit, so
they can never deadlock that accounting: ``call`` events (at most one per
running task: its thread waits for the reply) and ``reply`` lines. Intake
reads a reply as soon as it reaches it and hands it to its call; while a
call waits, intake also reads ahead past lines that wait for a permit
(keeping them in order, at most :data:`MAX_PARKED_BYTES`), so a reply
queued behind them still gets through. A reply no call waits for is
answered with a RequestError line from a budget of its own
(``queue_limit`` unwritten lines), not a permit.

Lifecycle, one direction only::

    SERVING --(EOF on stdin, stdout failed, or first drain())--> DRAINING
    DRAINING --(second drain())--> ABORTING

Draining stops intake (lines not yet read are never answered), lets every
accepted job finish and writes its result, then closes every open session
(sessions end with the pool), or, after :meth:`PoolEngine.detach_sessions`,
detaches each into the session store for a later attach (decision 32). Aborting closes the backend at once, so
running jobs end with a worker error; their results are still written if
stdout takes them within :data:`ABORT_WRITE_GRACE_S`.

What every task runs with (the slots, cancellations, host calls and output
streams, the one answer per line) is ``_tasks``'s; sessions are driven by
``_session_driver`` on the same tasks; jobs are built (policy, script, cwd)
by ``_job_building``; intake's buffers are ``_intake``'s.
"""

from __future__ import annotations

import asyncio
import enum
import time
from collections.abc import Callable
from typing import Protocol

import structlog
from readie_protocol.connection import PoolConnection, Role
from readie_protocol.events import CancelledEvent
from readie_protocol.cancel import Cancellation
from readie_worker.errors import ReadieError, RequestError, internal_error
from readie_worker.jobs import CodeJob, JobOutcome

from ._backend import JobBackend
from ._intake import MAX_PARKED_BYTES, ByteSource, Parked, RequestReader
from ._job_building import FALLBACK_CWD, MAX_SCRIPT_BYTES, code_job, code_job_now
from readie_protocol.requests import (
    AttachSession, CancelJob, CloseSession, DownloadChunk, ForkSession, HibernateSession, JobRequest, ListFiles,
    Refused, ReplyRequest, Request, StatsRequest, UploadChunk,
)
from readie_protocol.results import Result
from ._results import error_result, job_result, refused_result
from ._session_driver import SessionDriver
from ._setup import QUEUE_FACTOR, PoolSetup
from ._tasks import PoolTasks, ResultAhead, Started

__all__ = [
    "ABORT_WRITE_GRACE_S",
    "FALLBACK_CWD",
    "MAX_PARKED_BYTES",
    "MAX_SCRIPT_BYTES",
    "QUEUE_FACTOR",
    "ByteSink",
    "ByteSource",
    "PoolEngine",
    "PoolSetup",
    "PoolState",
]

log = structlog.get_logger("readie.pool")

#: After a second signal: how long the pool still tries to write the results
#: of the jobs it stopped before giving up on a stdout nobody reads.
ABORT_WRITE_GRACE_S = 5.0

# Why a waiting host call gets no reply once intake stops.
_STDIN_ENDED = "stdin has ended, so no reply can come"
_INTAKE_STOPPED = "the pool stopped reading requests, so no reply can come"


class PoolState(enum.Enum):
    SERVING = "serving"
    DRAINING = "draining"
    ABORTING = "aborting"


# The only moves a pool makes; anything else is a bug.
_TRANSITIONS = {
    PoolState.SERVING: frozenset({PoolState.DRAINING}),
    PoolState.DRAINING: frozenset({PoolState.ABORTING}),
    PoolState.ABORTING: frozenset(),
}


class ByteSink(Protocol):
    async def write(self, data: bytes) -> None:
        """Returns once ``data`` is written; raises OSError when it cannot be."""
        ...


class PoolEngine:
    """Serves one pool session over a byte source and sink; see the module docstring."""

    def __init__(
        self,
        setup: PoolSetup,
        backend: JobBackend,
        *,
        log_job: Callable[..., object] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.setup = setup
        self.backend = backend
        self.state = PoolState.SERVING
        self._now_ns = monotonic_ns
        self._started_ns = monotonic_ns()
        self._permits = asyncio.BoundedSemaphore(setup.queue_limit)
        # Answers to replies no call waits for: their own budget, never a permit.
        self._strays = asyncio.BoundedSemaphore(setup.queue_limit)
        self._changed = asyncio.Event()  # intake's conditions may have changed (see _until)
        # The pool's end of the protocol: requests in, events out.
        self._connection = PoolConnection(Role.POOL)
        self._tasks = PoolTasks(
            setup, backend, self._connection, self._permits, self._changed,
            log_job=log_job, monotonic_ns=monotonic_ns, wall_ms=wall_ms,
        )
        self.stats = self._tasks.stats
        self._host_calls = self._tasks.host_calls
        self._jobs = self._tasks.running  # every task: jobs, steps, closes
        self._intake_task: asyncio.Task[None] | None = None
        self._aborted = asyncio.Event()
        self._drain_calls = 0
        self._detach_at_end = False  # detach_sessions(): sessions outlive the pool
        self._output_lost = False
        self.accepted = 0  # lines that took a permit so far (tests and logs); replies take none
        self._session_driver = SessionDriver(self._tasks, lambda: self.serving)

    # ------------------------------------------------------------------ control

    def drain(self) -> None:
        """Stop taking lines and finish what was accepted; a second call aborts.

        Only calls count (one per signal): a pool already draining because
        stdin ended still drains gracefully on the first signal, so a
        supervisor that closes stdin and then sends SIGTERM loses no job.
        """
        self._drain_calls += 1
        if self._drain_calls == 1:
            self._stop_intake("draining: no new requests; finishing accepted jobs")
        elif self.state is PoolState.DRAINING:
            self._move(PoolState.ABORTING)
            self._aborted.set()
            log.warning("aborting: stopping running jobs", accepted_jobs=len(self._jobs))

    def detach_sessions(self) -> None:
        """End the pool keeping its sessions: it drains as :meth:`drain` does (and counts as its
        call: a later one aborts), but then detaches every open session (decision 32: hibernated
        into the session store, where an attach with its key continues it, here or in another
        pool) instead of closing it; a session without a key is closed. For a SIGTERM of a pool
        with a session store, and a served stream that broke (nobody asked to close its sessions)."""
        self._detach_at_end = True
        self.drain()

    def _stop_intake(self, why: str) -> None:
        # State first, log last: a log that cannot be written must not stop the drain.
        serving = self.state is PoolState.SERVING
        if serving:
            self._move(PoolState.DRAINING)
        if self._intake_task is not None:
            self._intake_task.cancel()
        if serving:
            log.info(why, accepted_jobs=len(self._jobs))

    @property
    def serving(self) -> bool:
        return self.state is PoolState.SERVING

    def _move(self, state: PoolState) -> None:
        if state not in _TRANSITIONS[self.state]:
            raise RuntimeError(f"pool cannot go from {self.state.value} to {state.value}")
        self.state = state

    async def serve(self, source: ByteSource, sink: ByteSink) -> int:
        """Write the ready event, serve until EOF or drain, return the exit status.

        0 when every accepted line was answered on stdout; 1 when stdout
        failed or an abort gave up on writing.
        """
        try:
            await sink.write(self._connection.send(self.setup.ready_event()))
        except OSError as exc:
            log.error("cannot write the ready event", error=str(exc))
            return 1
        # A call line may go out from its job's thread when the sink can write from any (FdWriter).
        self._tasks.write_now = getattr(sink, "write_now", None)
        writer = asyncio.create_task(self._write_out(sink), name="readie-pool-writer")
        self._intake_task = asyncio.create_task(self._intake(source), name="readie-pool-intake")
        if self.state is not PoolState.SERVING:  # drained before serving began
            self._intake_task.cancel()
        await asyncio.wait({self._intake_task})
        if not self._intake_task.cancelled() and self._intake_task.exception() is not None:
            error = self._intake_task.exception()
            log.error("intake failed; draining", error=f"{type(error).__name__}: {error}")
        if self.state is PoolState.SERVING:
            self._move(PoolState.DRAINING)  # EOF
        finishing = asyncio.create_task(self._finish_all(writer), name="readie-pool-finish")
        aborted = asyncio.create_task(self._aborted.wait())
        await asyncio.wait({finishing, aborted}, return_when=asyncio.FIRST_COMPLETED)
        if not finishing.done():
            # Abort: the backend's close ends running jobs; their results follow.
            try:
                await self.backend.close()
            except Exception:
                log.exception("closing the backend failed during an abort")
            done, _ = await asyncio.wait({finishing}, timeout=ABORT_WRITE_GRACE_S)
            if not done:
                log.error("gave up writing results after an abort")
                finishing.cancel()
                writer.cancel()
                for job in list(self._jobs):
                    job.cancel()
                return 1
        aborted.cancel()
        return 1 if self._output_lost else 0

    async def _finish_all(self, writer: asyncio.Task[None]) -> None:
        while self._jobs:
            await asyncio.wait(set(self._jobs))
        # Sessions end with the pool (or, asked, outlive it in the store): every step was answered,
        # nobody waits on a close.
        if self._detach_at_end:
            self._session_driver.detach_all()
        for session in self._session_driver.table.sessions():
            self._session_driver.close_in_background(session, "the pool is draining")
        while self._jobs:
            await asyncio.wait(set(self._jobs))
        self._tasks.outbox.put_nowait(None)
        await writer

    # ------------------------------------------------------------------ intake

    async def _intake(self, source: ByteSource) -> None:
        """Read lines: replies go to their calls at once, others take a permit, here when one is free
        and no line waits before them, else in ``parked``.

        A line is read when nothing waits for a permit and one is free (so with
        the permits gone, stdin is not read), or, while a host call waits for
        its reply, up to :data:`MAX_PARKED_BYTES` ahead. :meth:`_admit` takes
        the parked lines in order, a permit each.
        """
        requests = RequestReader(source, self._connection)
        parked = Parked()
        admitting = asyncio.create_task(self._admit(parked), name="readie-pool-admit")
        try:
            while True:
                await self._until(lambda: self._may_read(parked))
                received = await requests.next()
                if received is None:
                    break
                request, size = received
                if self._tasks.written_ahead:  # a job thread wrote a result: its bookkeeping comes first
                    await self._until(lambda: not self._tasks.written_ahead)
                parsed_at = self._now_ns()
                if isinstance(request, ReplyRequest):
                    await self._accept_reply(request, size)
                    continue
                if not parked.lines and not self._permits.locked():
                    # Nothing waits before it and a permit is free: taken here (acquire cannot wait),
                    # without the hop through the admitting task.
                    await self._permits.acquire()
                    await self._admit_one(request, parsed_at)
                    continue
                parked.push(request, parsed_at, size)
                self._changed.set()
            self._host_calls.close(_STDIN_ENDED)
            parked.ended = True
            self._changed.set()
            await admitting
        finally:
            admitting.cancel()
            self._host_calls.close(_INTAKE_STOPPED)

    def _may_read(self, parked: Parked) -> bool:
        if not parked.lines and not self._permits.locked():
            return True
        return len(self._host_calls) > 0 and parked.size < MAX_PARKED_BYTES

    async def _admit(self, parked: Parked) -> None:
        while True:
            await self._until(lambda: bool(parked.lines) or parked.ended)
            if not parked.lines:
                return
            await self._permits.acquire()
            request, parsed_at = parked.pop()
            await self._admit_one(request, parsed_at)

    async def _admit_one(self, request: Request | Refused, parsed_at: int) -> None:
        """Answer (or start the task that answers) a line that has just taken its permit; never waits."""
        self._changed.set()
        self.accepted += 1
        try:
            await self._accept(request, parsed_at)
        except Exception as exc:  # a bug must cost one line, never the pool
            log.exception("internal error handling a line")
            self._tasks.finish(error_result(None, internal_error(exc)))

    async def _until(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``; it is checked again whenever ``_changed`` is set."""
        while True:
            self._changed.clear()
            if ready():
                return
            await self._changed.wait()

    async def _accept(self, request: Request | Refused, parsed_at: int) -> None:
        """Answer ``request`` now, or start the task that will. Exactly one answer either way. Never
        waits: what it awaits (a free slot) is there."""
        if isinstance(request, Refused):
            self._tasks.finish(refused_result(request, self.setup.runtime))
        elif isinstance(request, StatsRequest):
            hibernated = self._session_driver.sessions_hibernated()
            self._tasks.answer(self.stats.snapshot(request.id, self._uptime_ms(), self.setup.workers, hibernated))
        elif isinstance(request, CloseSession):
            self._session_driver.accept_close(request)
        elif isinstance(request, HibernateSession):
            self._session_driver.accept_hibernate(request)
        elif isinstance(request, ForkSession):
            self._session_driver.accept_fork(request)
        elif isinstance(request, AttachSession):
            self._session_driver.accept_attach(request)
        elif isinstance(request, UploadChunk | DownloadChunk | ListFiles):
            self._session_driver.accept_transfer(request)
        elif isinstance(request, JobRequest) and request.session is not None:
            await self._session_driver.accept_step(request, parsed_at, self._tasks.cancellable(request.id))
        elif isinstance(request, CancelJob):
            found = self._tasks.cancel(request.target)
            self._tasks.answer(CancelledEvent(request.id, request.target, found=found))
        elif isinstance(request, JobRequest):
            cancel = self._tasks.cancellable(request.id)
            ahead: ResultAhead[JobOutcome] | None = self._tasks.ahead_for(request)
            started = await self._start_now(request, parsed_at, cancel, ahead)
            if started is None:
                self._tasks.spawn(self._run(request, parsed_at, cancel, ahead))
            else:
                self._tasks.follow(started, lambda reached: self._answered(request, cancel, ahead, started, reached))
        else:  # pragma: no cover - replies never take a permit (_intake)
            raise TypeError(f"unhandled request {type(request).__name__}")

    # ------------------------------------------------------------------ jobs

    async def _start_now(
        self, request: JobRequest, parsed_at: int, cancel: Cancellation, ahead: ResultAhead[JobOutcome] | None
    ) -> Started[JobOutcome] | None:
        """A job with inline code, handed to the backend before its task starts when a slot is free
        (taking it cannot wait then); None: its task does it all."""
        if not self._tasks.slot_free():
            return None
        try:
            job = code_job_now(self.setup, request)
        except Exception:  # noqa: BLE001 - refused, or a bug: its task meets it again and answers it, by its id
            return None
        if job is None:  # a script, read off the loop by its task
            return None
        await self._tasks.slots.acquire()  # free: cannot wait
        try:
            # PoolTasks.start frees the slot if the hand-over raised.
            return self._start(request, job, parsed_at, cancel, ahead)
        except Exception:  # a bug: its task meets it again, and answers it
            log.exception("internal error starting a job", id=request.id)
            return None

    def _start(
        self, request: JobRequest, job: CodeJob, parsed_at: int, cancel: Cancellation, ahead: ResultAhead[JobOutcome] | None
    ) -> Started[JobOutcome]:
        """With a slot taken: ``job`` handed to the backend."""
        runtime = self.setup.runtime
        if ahead is not None:
            ahead.build = lambda outcome, queue_us: job_result(
                request.id, outcome, runtime=runtime, job=job, queue_us=queue_us
            )
        return self._tasks.start(
            request, job, parsed_at, cancel,
            lambda host, output: self.backend.run(job, str(request.id), host, cancel, output, then=ahead),
            ahead=ahead,
        )

    async def _run(
        self, request: JobRequest, parsed_at: int, cancel: Cancellation, ahead: ResultAhead[JobOutcome] | None
    ) -> None:
        try:
            result = await self._result_for(request, parsed_at, cancel, ahead)
        except Exception as exc:  # a bug must cost this job, never the pool's accounting
            log.exception("internal error running a job", id=request.id)
            result = self._tasks.bug_result(request.id, internal_error(exc), ahead)
        finally:
            self._tasks.cancelled_with(request.id, cancel)
        self._tasks.finish(result, ahead=ahead)

    def _answered(
        self, request: JobRequest, cancel: Cancellation, ahead: ResultAhead[JobOutcome] | None,
        started: Started[JobOutcome], reached: Callable[[], tuple[JobOutcome, int] | Result] | None,
    ) -> None:
        """:meth:`_run` for a job intake started, in its answer's callback (None: cancelled by an abort)."""
        try:
            if reached is None:
                return
            result = self._job_answer(request, ahead, started, reached())
        except Exception as exc:  # a bug must cost this job, never the pool's accounting
            log.exception("internal error running a job", id=request.id)
            result = self._tasks.bug_result(request.id, internal_error(exc), ahead)
        finally:
            self._tasks.cancelled_with(request.id, cancel)
        self._tasks.finish(result, ahead=ahead)

    async def _result_for(
        self, request: JobRequest, parsed_at: int, cancel: Cancellation, ahead: ResultAhead[JobOutcome] | None
    ) -> Result:
        try:
            job = await code_job(self.setup, request)
        except ReadieError as exc:  # refused before anything ran: no policy, no queue time
            return error_result(request.id, exc, runtime=self.setup.runtime)
        await self._tasks.slots.acquire()
        started = self._start(request, job, parsed_at, cancel, ahead)
        return self._job_answer(request, ahead, started, await self._tasks.reached(started))

    def _job_answer(
        self, request: JobRequest, ahead: ResultAhead[JobOutcome] | None, started: Started[JobOutcome],
        reached: tuple[JobOutcome, int] | Result,
    ) -> Result:
        if isinstance(reached, Result):
            return reached
        outcome, queue_us = reached
        self._tasks.count_host(outcome)
        if ahead is not None and ahead.built is not None:
            return ahead.built
        return job_result(request.id, outcome, runtime=self.setup.runtime, job=started.job, queue_us=queue_us)

    # ------------------------------------------------------------------ host functions

    async def _accept_reply(self, reply: ReplyRequest, line_bytes: int) -> None:
        if self._host_calls.deliver(reply, line_bytes):
            self.stats.host_replies += 1
            return  # a reply that reaches its call is not answered
        await self._strays.acquire()
        error = RequestError(
            f"no call waits for a reply with call_id {reply.call_id} (it was answered already, "
            "its task ended or ran out of time, or it was never made)",
            "reply.call_id",
        )
        self.stats.late_replies += 1
        self._tasks.finish(error_result(None, error, runtime=self.setup.runtime), budget=self._strays)

    # ------------------------------------------------------------------ output

    async def _write_out(self, sink: ByteSink) -> None:
        while (item := await self._tasks.outbox.get()) is not None:
            data, budget = item
            try:
                if not self._output_lost:
                    await sink.write(data)
            except OSError as exc:
                self._output_lost = True
                log.error("stdout failed; results are dropped and the pool drains", error=str(exc))
                self._stop_intake("stdout failed: draining")
            finally:
                self._tasks.unwritten -= 1
                if budget is not None:
                    budget.release()
                    self._changed.set()

    def _uptime_ms(self) -> int:
        return (self._now_ns() - self._started_ns) // 1_000_000


