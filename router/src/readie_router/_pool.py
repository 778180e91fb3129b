"""The pool engine: JSONL requests in, results out in completion order, over any byte streams.

One asyncio task reads (intake), one writes, and each accepted job is a task
of its own that waits for one of ``workers`` slots and then for the
:class:`~readie_router._backend.JobBackend`. Everything the protocol decides
is delegated to the pure layers: ``_lines`` splits, ``_requests`` parses,
``_policy`` resolves, ``_results`` and ``_events`` build what is written.

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
(sessions end with the pool). Aborting closes the backend at once, so
running jobs end with a worker error; their results are still written if
stdout takes them within :data:`ABORT_WRITE_GRACE_S`.

Sessions (``_sessions`` decides what a line naming one means): each
accepted step or close is a task like a job's and holds a permit until it
is answered, but waits for the request of its session read before it; a
step holds one of the ``workers`` slots only while it runs, so an idle
session costs a sandbox and no slot. The first step's task opens the
session through the backend (``open_session``); later steps go to its
handle. A session idle for ``session_idle`` is closed by a timer, without
an output line (nobody asked).
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import importlib.util
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog
from readie_executor.jobs import bounds
from readie_worker.jobs import CodeJob, HostFunction, JobOutcome
from readie_worker.paths import PathRefused, read_no_follow
from readie_worker.sessions import StepOutcome

from ._backend import BackendSession, JobBackend, Step
from readie_worker.config import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_IDLE_MS, Config
from readie_worker.errors import PoolWorkerError, ReadieError, RequestError
from ._events import (
    JobResult,
    RuntimeInfo,
    Stats,
    closed_event,
    job_log_line,
    ready_event,
    result_line,
)
from ._host import HostCalls, WaitingCall, host_function
from readie_protocol.lines import Line, LineEvent, LineSplitter
from readie_worker.policy import Policy, resolve_policy, resolve_script, resolve_step
from ._requests import (
    CloseSession,
    JobRequest,
    Refused,
    ReplyRequest,
    Request,
    StatsRequest,
    parse_event,
)
from ._results import job_result
from ._sessions import Session, SessionPhase, SessionTable
from readie_protocol.wire import RequestId, encode_line

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

#: The spec: "the pool's queue holds twice the worker count". One batch runs
#: while the next waits, so a worker never idles between jobs, and no more.
QUEUE_FACTOR = 2
#: A script is read whole into the pool and sent as the job's code; every
#: queued job may hold one. 16 MiB is far beyond hand-written code and keeps
#: a queue of 2 x workers bounded. (Inline code is bounded by the 1 MiB line.)
MAX_SCRIPT_BYTES = 16 * 1024 * 1024
#: The largest max_output the in-sandbox runner accepts (its capture ceiling).
MAX_OUTPUT_BYTES = bounds.MAX_OUTPUT_LIMIT
#: Working directory of a job that cannot see the pool's (see ``_job_cwd``):
#: the sandbox's own /tmp, which is also the job's HOME.
FALLBACK_CWD = "/tmp"
#: After a second signal: how long the pool still tries to write the results
#: of the jobs it stopped before giving up on a stdout nobody reads.
ABORT_WRITE_GRACE_S = 5.0
#: While a host call waits for its reply, intake reads past lines that wait
#: for a permit, so the reply is not stuck behind them; this bounds the bytes
#: of such lines held (at least one is always held). A client that writes
#: more than this ahead of its reply waits for the call's timeout.
MAX_PARKED_BYTES = 8 * 1024 * 1024

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


class ByteSource(Protocol):
    async def read(self) -> bytes:
        """The next bytes, ``b""`` at the end."""
        ...


class ByteSink(Protocol):
    async def write(self, data: bytes) -> None:
        """Returns once ``data`` is written; raises OSError when it cannot be."""
        ...


@dataclass(frozen=True, slots=True)
class PoolSetup:
    """What the operator fixed at start-up; nothing here comes off the wire."""

    workers: int
    checkpoint: str
    runtime: RuntimeInfo
    cwd: Path  # absolute and resolved; relative request paths resolve against it
    config: Config = field(default_factory=Config)
    package_dirs: tuple[Path, ...] = ()  # the pool's own, absolute; every job gets them
    log_jobs: bool = False  # --log=json: one job_log_line per finished job
    max_sessions: int = DEFAULT_MAX_SESSIONS  # [pool] max_sessions after --max-sessions
    session_idle_ms: int = DEFAULT_SESSION_IDLE_MS  # [pool] session_idle after --session-idle

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not self.cwd.is_absolute():
            raise ValueError(f"cwd must be absolute, got {self.cwd}")

    @property
    def queue_limit(self) -> int:
        return QUEUE_FACTOR * self.workers


class PoolEngine:
    """Serves one pool session over a byte source and sink; see the module docstring."""

    def __init__(
        self,
        setup: PoolSetup,
        backend: JobBackend,
        *,
        log_line: Callable[[str], None] | None = None,
        monotonic_ns: Callable[[], int] = time.monotonic_ns,
        wall_ms: Callable[[], int] = lambda: time.time_ns() // 1_000_000,
    ) -> None:
        self.setup = setup
        self.backend = backend
        self.stats = Stats()
        self.state = PoolState.SERVING
        self._log_line = log_line
        self._now_ns = monotonic_ns
        self._wall_ms = wall_ms
        self._started_ns = monotonic_ns()
        self._permits = asyncio.BoundedSemaphore(setup.queue_limit)
        # Answers to replies no call waits for: their own budget, never a permit.
        self._strays = asyncio.BoundedSemaphore(setup.queue_limit)
        self._slots = asyncio.Semaphore(setup.workers)
        # Each line with the budget it releases once written (None: a call event).
        self._outbox: asyncio.Queue[tuple[bytes, asyncio.BoundedSemaphore | None] | None] = asyncio.Queue()
        self._changed = asyncio.Event()  # intake's conditions may have changed (see _until)
        self._host_calls = HostCalls()
        self._jobs: set[asyncio.Task[None]] = set()
        self._intake_task: asyncio.Task[None] | None = None
        self._aborted = asyncio.Event()
        self._drain_calls = 0
        self._output_lost = False
        self.accepted = 0  # lines that took a permit so far (tests and logs); replies take none
        self.sessions = SessionTable(setup.max_sessions)

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

    def _stop_intake(self, why: str) -> None:
        # State first, log last: a log that cannot be written must not stop the drain.
        serving = self.state is PoolState.SERVING
        if serving:
            self._move(PoolState.DRAINING)
        if self._intake_task is not None:
            self._intake_task.cancel()
        if serving:
            log.info(why, accepted_jobs=len(self._jobs))

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
            await sink.write(encode_line(self._ready()))
        except OSError as exc:
            log.error("cannot write the ready event", error=str(exc))
            return 1
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
        # Sessions end with the pool: every step was answered, nobody waits on a close.
        for session in self.sessions.sessions():
            self._close_in_background(session, "the pool is draining")
        while self._jobs:
            await asyncio.wait(set(self._jobs))
        self._outbox.put_nowait(None)
        await writer

    # ------------------------------------------------------------------ intake

    async def _intake(self, source: ByteSource) -> None:
        """Read lines: replies go to their calls at once, others wait in ``parked`` for a permit.

        A line is read when nothing waits for a permit and one is free (so with
        the permits gone, stdin is not read), or, while a host call waits for
        its reply, up to :data:`MAX_PARKED_BYTES` ahead. :meth:`_admit` takes
        the parked lines in order, a permit each.
        """
        lines = _LineReader(source)
        parked = _Parked()
        admitting = asyncio.create_task(self._admit(parked), name="readie-pool-admit")
        try:
            while True:
                await self._until(lambda: self._may_read(parked))
                event = await lines.next()
                if event is None:
                    break
                parsed_at = self._now_ns()
                request = parse_event(event)
                if isinstance(request, ReplyRequest):
                    await self._accept_reply(request)
                    continue
                parked.push(request, parsed_at, len(event.data) if isinstance(event, Line) else 0)
                self._changed.set()
            self._host_calls.close(_STDIN_ENDED)
            parked.ended = True
            self._changed.set()
            await admitting
        finally:
            admitting.cancel()
            self._host_calls.close(_INTAKE_STOPPED)

    def _may_read(self, parked: _Parked) -> bool:
        if not parked.lines and not self._permits.locked():
            return True
        return len(self._host_calls) > 0 and parked.size < MAX_PARKED_BYTES

    async def _admit(self, parked: _Parked) -> None:
        while True:
            await self._until(lambda: bool(parked.lines) or parked.ended)
            if not parked.lines:
                return
            await self._permits.acquire()
            request, parsed_at = parked.pop()
            self._changed.set()
            self.accepted += 1
            try:
                self._accept(request, parsed_at)
            except Exception as exc:  # a bug must cost one line, never the pool
                log.exception("internal error handling a line")
                self._finish(JobResult.from_error(None, PoolWorkerError(f"internal error: {exc}")))

    async def _until(self, ready: Callable[[], bool]) -> None:
        """Wait until ``ready()``; it is checked again whenever ``_changed`` is set."""
        while True:
            self._changed.clear()
            if ready():
                return
            await self._changed.wait()

    def _accept(self, request: Request | Refused, parsed_at: int) -> None:
        """Answer ``request`` now, or start the task that will. Exactly one answer either way."""
        if isinstance(request, Refused):
            self._finish(JobResult.refused(request, self.setup.runtime))
        elif isinstance(request, StatsRequest):
            self._answer(self.stats.snapshot(request.id, self._uptime_ms(), self.setup.workers))
        elif isinstance(request, CloseSession):
            self._accept_close(request)
        elif isinstance(request, JobRequest) and request.session is not None:
            self._accept_step(request, parsed_at)
        elif isinstance(request, JobRequest):
            self._spawn(self._run(request, parsed_at))
        else:  # pragma: no cover - replies never take a permit (_intake)
            raise TypeError(f"unhandled request {type(request).__name__}")

    def _spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self._jobs.add(task)
        task.add_done_callback(self._jobs.discard)

    # ------------------------------------------------------------------ jobs

    async def _run(self, request: JobRequest, parsed_at: int) -> None:
        try:
            result = await self._result_for(request, parsed_at)
        except Exception as exc:  # a bug must cost this job, never the pool's accounting
            log.exception("internal error running a job", id=request.id)
            error = PoolWorkerError(f"internal error: {type(exc).__name__}: {exc}")
            result = JobResult.from_error(request.id, error, runtime=self.setup.runtime)
        self._finish(result)

    async def _result_for(self, request: JobRequest, parsed_at: int) -> JobResult:
        runtime = self.setup.runtime
        try:
            policy = resolve_policy(
                request,
                cwd=self.setup.cwd,
                limits=self.setup.config.limits,
                profiles=self.setup.config.profile_map,
                protected=self.setup.package_dirs,
            )
            job = await self._code_job(request, policy)
        except ReadieError as exc:  # refused before anything ran: no policy, no queue time
            return JobResult.from_error(request.id, exc, runtime=runtime)
        async with self._slots:
            queue_us = max(0, (self._now_ns() - parsed_at) // 1000)
            try:
                host = self._host_for(request.id, job.functions)
                outcome = await self.backend.run(job, str(request.id), host)
                self._count_host(outcome)
            except RequestError as exc:  # the worker refused: nothing was granted
                return JobResult.from_error(request.id, exc, runtime=runtime, queue_us=queue_us)
            except ReadieError as exc:
                return JobResult.from_error(
                    request.id, exc, runtime=runtime, policy=policy, queue_us=queue_us
                )
        return job_result(request.id, outcome, runtime=runtime, policy=policy, queue_us=queue_us)

    async def _code_job(self, request: JobRequest, policy: Policy) -> CodeJob:
        setup = self.setup
        self._check_max_output(policy)
        script = resolve_script(request, cwd=setup.cwd, limits=setup.config.limits)
        if script is not None:
            code = await asyncio.to_thread(read_script, script, str(request.script))
            # What the request wrote, as python3 shows the path it was given.
            name = request.name or str(request.script)
        else:
            code, name = request.code or "", request.name or "<string>"
        package_dirs = dict.fromkeys((*setup.package_dirs, *policy.package_dirs))
        return CodeJob(
            checkpoint=setup.checkpoint,
            code=code,
            name=name,
            args=request.args,
            env=dict(policy.env),
            cwd=_job_cwd(setup.cwd, policy),
            allow_read=tuple(str(p) for p in policy.allow_read),
            allow_write=tuple(str(p) for p in policy.allow_write),
            package_dirs=tuple(str(p) for p in package_dirs),
            packages=request.packages or (),
            network=policy.network,
            timeout_ms=policy.timeout_ms,
            memory_bytes=policy.memory_bytes,
            max_output=policy.max_output,
            max_file_size=policy.max_file_size,
            functions=request.functions or (),
        )

    # ------------------------------------------------------------------ host functions

    def _host_for(self, request_id: RequestId, functions: tuple[str, ...]) -> HostFunction | None:
        """The host callback for a task of ``request_id`` (None when it declared no functions)."""
        if not functions:
            return None
        return host_function(asyncio.get_running_loop(), self._post_call, self._host_calls.forget, request_id)

    def _post_call(self, waiting: WaitingCall) -> None:
        line = self._host_calls.post(waiting)
        if line is not None:
            self.stats.host_calls += 1
            self._outbox.put_nowait((line, None))  # no permit: its task holds one, and waits
            self._changed.set()  # a call waits: intake may read ahead for its reply

    async def _accept_reply(self, reply: ReplyRequest) -> None:
        if self._host_calls.deliver(reply):
            self.stats.host_replies += 1
            return  # a reply that reaches its call is not answered
        await self._strays.acquire()
        error = RequestError(
            f"no call waits for a reply with call_id {reply.call_id} (it was answered already, "
            "its task ended or ran out of time, or it was never made)",
            "reply.call_id",
        )
        self.stats.late_replies += 1
        self._finish(JobResult.from_error(None, error, runtime=self.setup.runtime), budget=self._strays)

    def _count_host(self, outcome: JobOutcome) -> None:
        if outcome.host is not None:
            self.stats.host_frames_refused += outcome.host.refused

    # ------------------------------------------------------------------ sessions

    def _accept_step(self, request: JobRequest, parsed_at: int) -> None:
        try:
            session, first = self.sessions.admit(request)
        except RequestError as exc:
            self._finish(
                JobResult.from_error(request.id, exc, runtime=self.setup.runtime, session=request.session)
            )
            return
        if first:
            self.stats.session_started()
        previous, done = session.enqueue()
        self._spawn(self._session_step(session, request, parsed_at, previous, done))

    def _accept_close(self, request: CloseSession) -> None:
        session = self.sessions.get(request.session)
        if session is None:  # never opened, or ended already: closed either way
            self._answer(closed_event(request.id, request.session))
            return
        if self.sessions.closing(session):
            self.stats.session_ended()
        previous, done = session.enqueue()
        self._spawn(self._session_close(session, request, previous, done))

    async def _session_step(
        self,
        session: Session,
        request: JobRequest,
        parsed_at: int,
        previous: asyncio.Event | None,
        done: asyncio.Event,
    ) -> None:
        result: JobResult | None = None
        try:
            if previous is not None:
                await previous.wait()
            result = await self._step_result(session, request, parsed_at)
        except Exception as exc:  # a bug must cost this step (and its session), never the pool
            log.exception("internal error running a session step", id=request.id)
            error = PoolWorkerError(f"internal error: {type(exc).__name__}: {exc}")
            result = JobResult.from_error(
                request.id, error, runtime=self.setup.runtime, session=session.name
            )
            self._close_in_background(session, "internal error")
        finally:
            # Answered before the next request of the session may start.
            session.answered()
            if result is not None:
                self._finish(result)
            done.set()
            self._arm_idle_timer(session)

    async def _step_result(self, session: Session, request: JobRequest, parsed_at: int) -> JobResult:
        runtime, name = self.setup.runtime, session.name
        if session.ended:
            why = RequestError(f"session {name!r} ended before this step ran", "session")
            return JobResult.from_error(request.id, why, runtime=runtime, session=name)
        first = session.handle is None
        try:
            if first:
                policy = resolve_policy(
                    request,
                    cwd=self.setup.cwd,
                    limits=self.setup.config.limits,
                    profiles=self.setup.config.profile_map,
                    protected=self.setup.package_dirs,
                )
                job = await self._code_job(request, policy)
                session.functions = job.functions
            else:
                assert session.policy is not None
                policy = resolve_step(session.policy, request, self.setup.config.limits)
                self._check_max_output(policy)
        except ReadieError as exc:  # refused before anything ran
            if first:
                self._end_session(session)
            return JobResult.from_error(request.id, exc, runtime=runtime, session=name)
        async with self._slots:
            queue_us = max(0, (self._now_ns() - parsed_at) // 1000)
            host = self._host_for(request.id, session.functions)
            try:
                if first:
                    session.handle, outcome = await self.backend.open_session(job, str(request.id), host)
                    session.policy = policy
                    if session.phase is SessionPhase.OPENING:  # not CLOSING already
                        session.move(SessionPhase.OPEN)
                else:
                    assert session.handle is not None
                    step = Step(
                        code=request.code or "",
                        name=request.name or "<string>",
                        args=request.args,
                        timeout_ms=policy.timeout_ms,
                        max_output=policy.max_output,
                    )
                    outcome = await session.handle.run_step(step, str(request.id), host)
                self._count_host(outcome.outcome)
            except ReadieError as exc:
                # A refusal of the first step leaves no session; any other failure ends it.
                if first or not isinstance(exc, RequestError):
                    self._close_in_background(session, "its backend failed")
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
            runtime=self.setup.runtime,
            policy=policy,
            queue_us=queue_us,
            session=name,
            step=outcome.step,
            session_ended=outcome.session_ended,
        )

    async def _session_close(
        self,
        session: Session,
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
            self._answer(closed_event(request.id, request.session))
            done.set()

    def _end_session(self, session: Session) -> BackendSession | None:
        """Take ``session`` out of the table and the count, at once, so the next request under
        its name starts a new one; returns its handle for the caller to close (or None)."""
        if self.sessions.end(session):
            self.stats.session_ended()
        return session.handle

    def _close_in_background(self, session: Session, why: str) -> None:
        handle = self._end_session(session)
        if handle is not None:
            log.info("closing a session", session=session.name, why=why)
            self._spawn(handle.close())

    def _arm_idle_timer(self, session: Session) -> None:
        if session.phase is not SessionPhase.OPEN or session.pending or self.state is not PoolState.SERVING:
            return
        session.stop_idle_timer()
        loop = asyncio.get_running_loop()
        session.idle = loop.call_later(
            self.setup.session_idle_ms / 1000, self._idle_expired, session
        )

    def _idle_expired(self, session: Session) -> None:
        session.idle = None
        if session.phase is SessionPhase.OPEN and not session.pending:
            self._close_in_background(session, "idle")

    @staticmethod
    def _check_max_output(policy: Policy) -> None:
        if policy.max_output > MAX_OUTPUT_BYTES:
            raise RequestError(
                f"{policy.max_output} bytes is above the sandbox's capture limit of "
                f"{MAX_OUTPUT_BYTES}",
                "max_output",
            )

    # ------------------------------------------------------------------ output

    def _finish(self, result: JobResult, budget: asyncio.BoundedSemaphore | None = None) -> None:
        """Write ``result``; once written it releases ``budget`` (default: the permit it holds)."""
        self.stats.record(result)
        if self._log_line is not None and self.setup.log_jobs:
            line = encode_line(job_log_line(result, self._wall_ms()))
            with contextlib.suppress(OSError, ValueError):  # stderr gone: the result still goes out
                self._log_line(line.decode("utf-8").rstrip("\n"))
        self._outbox.put_nowait((encode_line(result_line(result)), budget or self._permits))

    def _answer(self, obj: dict[str, Any]) -> None:
        self._outbox.put_nowait((encode_line(obj), self._permits))

    async def _write_out(self, sink: ByteSink) -> None:
        while (item := await self._outbox.get()) is not None:
            data, budget = item
            try:
                if not self._output_lost:
                    await sink.write(data)
            except OSError as exc:
                self._output_lost = True
                log.error("stdout failed; results are dropped and the pool drains", error=str(exc))
                self._stop_intake("stdout failed: draining")
            finally:
                if budget is not None:
                    budget.release()
                    self._changed.set()

    def _ready(self) -> dict[str, Any]:
        setup = self.setup
        return ready_event(
            workers=setup.workers,
            preloaded_modules=setup.runtime.preloaded_modules,
            package_dirs=setup.package_dirs,
            config=setup.config.path,
            profiles=setup.config.profile_names,
        )

    def _uptime_ms(self) -> int:
        return (self._now_ns() - self._started_ns) // 1_000_000


# --------------------------------------------------------------------------- helpers


class _LineReader:
    """stdin as lines: one read of the source only when no split line is left."""

    def __init__(self, source: ByteSource) -> None:
        self._source = source
        self._splitter = LineSplitter()
        self._pending: deque[LineEvent] = deque()

    async def next(self) -> LineEvent | None:
        """The next line, None at the end."""
        while not self._pending and not self._splitter.ended:
            try:
                data = await self._source.read()
            except OSError as exc:
                log.error("cannot read stdin; treating it as ended", error=str(exc))
                data = b""
            self._pending.extend(self._splitter.feed(data))
        return self._pending.popleft() if self._pending else None


@dataclass
class _Parked:
    """Lines read and parsed that wait, in order, for a permit."""

    # (request, parsed_at, size in bytes)
    lines: deque[tuple[Request | Refused, int, int]] = field(default_factory=deque)
    size: int = 0  # bytes of the lines held
    ended: bool = False  # stdin ended: no more lines come

    def push(self, request: Request | Refused, parsed_at: int, size: int) -> None:
        self.lines.append((request, parsed_at, size))
        self.size += size

    def pop(self) -> tuple[Request | Refused, int]:
        request, parsed_at, size = self.lines.popleft()
        self.size -= size
        return request, parsed_at


def _job_cwd(cwd: Path, policy: Policy) -> str:
    """The pool's working directory when the job can see it, else :data:`FALLBACK_CWD`.

    Inside the sandbox a grant appears at its host path, and the directories
    above it are created on the way (empty but for the grant). So the pool's
    directory exists there exactly when a grant lies beneath it (or it lies
    beneath a grant), and then relative paths in the code mean what the
    request's relative grants meant. A job with no grant there sees nothing
    of the pool's directory anyway.
    """
    for grant in (*policy.allow_read, *policy.allow_write):
        if grant.is_relative_to(cwd) or cwd.is_relative_to(grant):
            return str(cwd)
    return FALLBACK_CWD


def read_script(path: Path, shown: str) -> str:
    """The source of a script the pool runs, or RequestError naming ``script`` and quoting
    ``shown`` (the path as the request wrote it).

    Opened without following a symlink anywhere along the path and read from
    that descriptor (``readie_worker.paths``), so a job that swaps the file
    for a link after the check cannot make the pool read another file; a
    FIFO or a device is refused before it is opened for reading. Decoded as
    python3 would (a BOM or a coding cookie, else UTF-8).
    """
    try:
        source = read_no_follow(str(path), MAX_SCRIPT_BYTES)
    except PathRefused as refused:
        raise RequestError(f"{shown!r} {refused.reason}", "script") from None
    try:
        return importlib.util.decode_source(source)
    except (SyntaxError, UnicodeDecodeError, LookupError) as exc:
        raise RequestError(f"{shown!r} is not readable as Python source: {exc}", "script") from None
