"""What every task of the pool runs with, a job's or a session's: the engine's and the driver's one collaborator.

A task (a job, a session step, a close, a hibernation) waits for one of the
``workers`` slots, reaches the backend with a host callback and an output
sink made for its request, can be cancelled by the id of its request, and
ends with exactly one answer, which releases the permit its line holds once
written. :class:`PoolTasks` owns those parts; the engine owns intake, the
lifecycle and the writer that drains :attr:`PoolTasks.outbox`, and
``_session_driver`` owns the sessions. Neither reaches into the other.

A job with inline code or a session's later step that finds a slot free is
handed to the backend by intake itself (:meth:`PoolTasks.start`: a threaded
backend's job thread has it when that returns), and has no task: its answer is
in :attr:`PoolTasks.running` until the callback it was given
(:meth:`PoolTasks.follow`) has finished it on the loop, as its task would have
(decision 0033, "The hop into the job thread").

A job's or a step's result line is written by its job thread the moment the
backend has the outcome (:class:`ResultAhead`, decision 0033), when that can
be done as a host call's line is (``write_now``: a pipe with room, one line of
at most ``PIPE_BUF`` bytes, nothing put before it unwritten, none of its
task's call lines still on their way to the loop, not a streaming task);
otherwise the loop writes it, as every line before. The loop then does the
rest (the counters, the session's table and timers, the permit, released as
a written line's is) before it accepts any line read after the write:
:attr:`PoolTasks.written_ahead` counts the lines it has not caught up with,
and the engine's intake waits for it to be 0, so a client answering a result
at once finds the pool as if the loop had written it.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import itertools
import threading
from collections.abc import Awaitable, Callable
from typing import Any, Generic, TypeVar

import structlog
from readie_protocol.connection import PoolConnection, PoolEvent
from readie_protocol.events import OutputEvent
from readie_protocol.requests import JobRequest
from readie_protocol.results import Result
from readie_protocol.wire import RequestId
from readie_protocol.cancel import Cancellation
from readie_protocol.errors import Cancelled, ReadieError
from readie_policy.jobs import CodeJob, HostFunction, JobOutcome, OutputChunk, OutputSink

from ._backend import JobBackend
from ._events import Stats, job_log_line
from ._host import HostCalls, host_function
from ._results import error_result
from ._setup import PoolSetup

__all__ = ["Outbox", "PoolTasks", "ResultAhead", "Started"]

log = structlog.get_logger("readie.pool")

_Answer = TypeVar("_Answer")
_Outcome = TypeVar("_Outcome")

# Each line with the budget it releases once written (None: a call or output event); None ends it.
Outbox = asyncio.Queue[tuple[bytes, asyncio.BoundedSemaphore | None] | None]


class PoolTasks:
    """The slots, the running tasks, their cancellations, host calls and output, and their answers."""

    def __init__(
        self,
        setup: PoolSetup,
        backend: JobBackend,
        connection: PoolConnection,
        permits: asyncio.BoundedSemaphore,
        changed: asyncio.Event,
        *,
        log_job: Callable[..., object] | None,
        monotonic_ns: Callable[[], int],
        wall_ms: Callable[[], int],
    ) -> None:
        self.setup = setup
        self.backend = backend
        self.stats = Stats()
        self.now_ns = monotonic_ns
        self.slots = asyncio.Semaphore(setup.workers)
        self.outbox: Outbox = asyncio.Queue()
        self.running: set[asyncio.Future[Any]] = set()  # tasks, and backend answers followed without one
        self._connection = connection
        self.host_calls = HostCalls(connection.send)
        self._permits = permits  # what an answer releases unless it says otherwise
        self._changed = changed  # intake's conditions may have changed (a call waits)
        self._log_job = log_job  # a structlog method: the job line is in the one log schema
        self._wall_ms = wall_ms
        # stdout's write from any thread, for a call line that can go out at once (the engine's
        # sink's ``write_now``, set once it serves; None: every line goes through the outbox).
        self.write_now: Callable[[bytes], bool] | None = None
        # Lines put in the outbox and not yet written (the engine's writer counts them out): a job
        # thread writes its call line itself only when none is, so it never overtakes a line
        # finished before it (a session's previous result, say).
        self.unwritten = 0
        # Counted on job threads under the lock (read anywhere): result lines a job thread wrote
        # whose bookkeeping the loop has not done yet (intake waits for 0), and call lines a job
        # thread handed to the loop that are not in the outbox yet (a result must not pass them).
        self._thread_lock = threading.Lock()
        self.written_ahead = 0
        self._calls_on_the_way = 0
        # The jobs a client may still cancel (queued or running), by request id.
        self._cancels: dict[RequestId, Cancellation] = {}

    # ------------------------------------------------------------------ tasks

    def spawn(self, work: Any) -> None:
        task = asyncio.create_task(work)
        self.running.add(task)
        task.add_done_callback(self.running.discard)

    def cancellable(self, request_id: RequestId) -> Cancellation:
        """A job's or step's cancellation, known before its task starts: a cancel on the next line finds it."""
        cancel = self._cancels[request_id] = Cancellation()
        return cancel

    def cancelled_with(self, request_id: RequestId, cancel: Cancellation) -> None:
        """The task of ``request_id`` is answered: a cancel no longer finds it."""
        if self._cancels.get(request_id) is cancel:  # a later task may reuse the id
            del self._cancels[request_id]

    def cancel(self, target: RequestId) -> bool:
        """Cancel the task of ``target``; whether one was found."""
        cancel = self._cancels.get(target)
        if cancel is not None:
            cancel.cancel()
        return cancel is not None

    # ------------------------------------------------------------------ the backend

    async def on_backend(
        self,
        request: JobRequest,
        job: CodeJob,
        parsed_at: int,
        cancel: Cancellation,
        call: Callable[[HostFunction | None, OutputSink | None], Awaitable[_Answer]],
        *,
        what: str = "job",
        session: str | None = None,
        ahead: ResultAhead[_Answer] | None = None,
    ) -> tuple[_Answer, int] | Result:
        """``call`` the backend for ``request`` on one of the slots: its answer and the task's queue
        time, or the result line for the error it raised.

        The one path a backend's failure takes to a line (``JobBackend``'s rule: an
        error is raised when no worker took the job, an outcome returned once one
        did). ``job`` is what the line reports as its policy unless the backend
        refused the job (``error_result``).
        """
        await self.slots.acquire()
        return await self.reached(self.start(request, job, parsed_at, cancel, call, what=what, session=session, ahead=ahead))

    def start(
        self,
        request: JobRequest,
        job: CodeJob,
        parsed_at: int,
        cancel: Cancellation,
        call: Callable[[HostFunction | None, OutputSink | None], Awaitable[_Answer]],
        *,
        what: str = "job",
        session: str | None = None,
        ahead: ResultAhead[_Answer] | None = None,
    ) -> Started[_Answer]:
        """:meth:`on_backend`'s first half, on the loop with a slot taken (by it, or by intake when one
        was free: then a threaded backend's job thread has the job before any task starts); what
        :meth:`reached` awaits, and which releases the slot."""
        started: Started[_Answer] = Started(request.id, job, session)
        try:
            started.queue_us = max(0, (self.now_ns() - parsed_at) // 1000)
            if ahead is not None:
                ahead.queue_us = started.queue_us
            if cancel.cancelled:
                raise Cancelled(f"the {what} was cancelled by the client before it ran")
            started.answer = call(self.host_for(request, job.functions), self.output_for(request))
        except ReadieError as exc:
            started.error = exc
        except BaseException:
            self.slots.release()
            raise
        return started

    async def reached(self, started: Started[_Answer]) -> tuple[_Answer, int] | Result:
        """The backend's answer to what :meth:`start` began, or the line for its error; the slot is free after."""
        try:
            if started.error is None:
                assert started.answer is not None
                try:
                    return await started.answer, started.queue_us
                except ReadieError as exc:
                    started.error = exc
            return self._error_line(started)
        finally:
            self.slots.release()

    def follow(
        self, started: Started[_Answer], then: Callable[[Callable[[], tuple[_Answer, int] | Result] | None], None]
    ) -> None:
        """:meth:`reached` without a task: once the backend answers, ``then`` is called on the loop (in the
        answer's callback) with what gives what :meth:`reached` would (or raises the bug it would), or
        None when the answer was cancelled, as an abort cancels a task. The answer is in :attr:`running`
        until ``then`` has returned."""
        if started.error is not None:
            self.slots.release()
            then(functools.partial(self._error_line, started))
            return
        assert started.answer is not None
        answer = asyncio.ensure_future(started.answer)
        self.running.add(answer)

        def settled(answer: asyncio.Future[_Answer]) -> None:
            try:
                if answer.cancelled():
                    self.slots.release()
                    then(None)
                else:
                    then(functools.partial(self._answered, started, answer))
            finally:
                self.running.discard(answer)

        answer.add_done_callback(settled)

    def _answered(self, started: Started[_Answer], answer: asyncio.Future[_Answer]) -> tuple[_Answer, int] | Result:
        try:
            try:
                return answer.result(), started.queue_us
            except ReadieError as exc:
                started.error = exc
                return self._error_line(started)
        finally:
            self.slots.release()

    def _error_line(self, started: Started[Any]) -> Result:
        assert started.error is not None
        return error_result(
            started.request_id, started.error, runtime=self.setup.runtime, job=started.job,
            queue_us=started.queue_us, session=started.session,
        )

    def slot_free(self) -> bool:
        """A slot can be taken now without waiting (and nobody waits for one before)."""
        return not self.slots.locked()

    # ------------------------------------------------------------------ host functions and output

    def host_for(self, request: JobRequest, functions: tuple[str, ...]) -> HostFunction | None:
        """The host callback for a task of ``request`` (None when it declared no functions). A task
        that streams hands its call lines to the outbox, behind its output events."""
        if not functions:
            return None
        write_now = self._hand_call if request.stream or self.write_now is None else self._write_call_now
        return host_function(asyncio.get_running_loop(), self.host_calls, write_now, self._posted_call, request.id)

    def _write_call_now(self, line: bytes) -> bool:
        # On a job thread: ``unwritten`` is read once, and a line put after that is not before this call.
        if self.unwritten == 0 and self.write_now is not None and self.write_now(line):
            return True
        return self._hand_call(line)

    def _hand_call(self, line: bytes) -> bool:
        # On a job thread: host_function hands the line to the loop (_posted_call) next.
        with self._thread_lock:
            self._calls_on_the_way += 1
        return False

    def ahead_for(self, request: JobRequest) -> ResultAhead[Any] | None:
        """What writes ``request``'s result line on its job thread (once given its ``build``); None
        when only the loop may write it: a task that streams
        (its output events go through the loop, and its result must not pass them), or a sink
        that cannot write from a thread."""
        if request.stream or self.write_now is None:
            return None
        return ResultAhead(self)

    def _write_result_now(self, line: bytes) -> bool:
        """On a job thread: write a result line now if it passes nothing still to be written; counted
        in :attr:`written_ahead` before the write, so a line the client sends in answer finds it."""
        with self._thread_lock:
            if self._calls_on_the_way or self.unwritten or self.write_now is None:
                return False
            self.written_ahead += 1
        written = False
        try:
            written = self.write_now(line)
        finally:
            if not written:  # refused, or raised: the loop writes it, and intake must not wait for it
                with self._thread_lock:
                    self.written_ahead -= 1
        return written

    def output_for(self, request: JobRequest) -> OutputSink | None:
        """The output sink of a task that asked for ``stream`` (None otherwise): runs on a job
        thread, and hands each chunk to the loop as an output event, numbered in order.

        Its events need no permit: they come before the result that releases the
        task's, and the worker bounds them (its max_output, per stream).
        """
        if not request.stream:
            return None
        loop = asyncio.get_running_loop()
        numbers = itertools.count(1)

        def post(chunk: OutputChunk) -> None:
            event = OutputEvent(request.id, chunk.stream, chunk.data, next(numbers))
            self._put(self._connection.send(event), None)

        def output(chunk: OutputChunk) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is closed: the pool is gone
                loop.call_soon_threadsafe(post, chunk)

        return output

    def _posted_call(self, line: bytes | None) -> None:
        """A job thread posted a call: written already (``line`` None), or to write."""
        self.stats.host_calls += 1
        if line is not None:
            self._put(line, None)  # no permit: its task holds one, and waits
            with self._thread_lock:
                self._calls_on_the_way -= 1
        self._changed.set()  # a call waits: intake may read ahead for its reply

    def count_host(self, outcome: JobOutcome) -> None:
        if outcome.host is not None:
            self.stats.host_frames_refused += outcome.host.refused

    # ------------------------------------------------------------------ answers

    def finish(
        self, result: Result, budget: asyncio.BoundedSemaphore | None = None, *, ahead: ResultAhead[Any] | None = None
    ) -> None:
        """Write ``result``; once written it releases ``budget`` (default: the permit it holds).
        ``ahead``: what built it on its job thread (:class:`ResultAhead`), which may have logged
        and written it already; the rest is done here."""
        if ahead is not None and ahead.written and ahead.built is not result:
            # Its line is out, and the runner failed after it (its own bookkeeping): that line was
            # the answer, and one request gets one.
            assert ahead.built is not None
            log.error("a runner failed after its job's result was written", id=ahead.built.id,
                      error=None if result.error is None else result.error.message)
            result = ahead.built
        self.stats.record(result)
        from_thread = ahead is not None and ahead.built is result
        if not (from_thread and ahead.logged):  # type: ignore[union-attr]
            self.log_result(result)
        if not (from_thread and ahead.written):  # type: ignore[union-attr]
            self._put(self._connection.send(result), budget or self._permits)
            if ahead is not None:  # its thread may have counted a write it then gave up: intake may wait
                self._changed.set()
            return
        (budget or self._permits).release()
        with self._thread_lock:
            self.written_ahead -= 1
        self._changed.set()  # a permit is free, and intake may wait for written_ahead

    def bug_result(self, request_id: RequestId, error: Result | ReadieError, ahead: ResultAhead[Any] | None) -> Result:
        """The answer of a task that failed with a bug: ``error`` (a result, or the error to make one
        of), unless its job thread built and logged (or wrote) its line already: then that line is
        the answer, and one request never has two log lines."""
        if ahead is not None and ahead.logged and ahead.built is not None:
            return ahead.built  # written, or logged already: that line is the answer
        return error if isinstance(error, Result) else error_result(request_id, error, runtime=self.setup.runtime)

    def log_result(self, result: Result) -> None:
        """The ``--log=json`` line of a finished task, on stderr before its result on stdout."""
        if self._log_job is not None and self.setup.log_jobs:
            line = job_log_line(result, self._wall_ms())
            with contextlib.suppress(OSError, ValueError):  # stderr gone: the result still goes out
                self._log_job(line.pop("event"), **line)

    def answer(self, event: PoolEvent) -> None:
        self._put(self._connection.send(event), self._permits)

    def _put(self, line: bytes, budget: asyncio.BoundedSemaphore | None) -> None:
        self.unwritten += 1
        self.outbox.put_nowait((line, budget))


class Started(Generic[_Answer]):
    """A task's call to the backend, begun (:meth:`PoolTasks.start`): what it awaits, or the error it
    raised at once; and what the line of an error reports."""

    def __init__(self, request_id: RequestId, job: CodeJob, session: str | None) -> None:
        self.request_id = request_id
        self.job = job
        self.session = session
        self.queue_us = 0
        self.answer: Awaitable[_Answer] | None = None
        self.error: ReadieError | None = None


class ResultAhead(Generic[_Outcome]):
    """Called on a job thread with the backend's outcome (a backend's ``then``): builds the task's
    result (:attr:`built`, which the task's answer then is: ``finish(built, ahead=...)``), logs it
    and writes its line there if it can (:meth:`PoolTasks.ahead_for`)."""

    def __init__(self, tasks: PoolTasks) -> None:
        self._tasks = tasks
        # The line from the outcome and the queue time, once the loop knows the task's job; None: not
        # here, the loop builds it.
        self.build: Callable[[_Outcome, int], Result] | None = None
        self.queue_us = 0  # set on the loop before the backend runs the task
        self.built: Result | None = None
        self.logged = False
        self.written = False

    def __call__(self, outcome: _Outcome) -> None:
        if self.build is None:
            return
        try:
            result = self.build(outcome, self.queue_us)
            line = self._tasks._connection.send(result)
        except Exception:  # the loop builds it again, and answers whatever that gives
            log.exception("internal error writing a result on its job thread")
            return
        self.built = result
        try:  # ``then`` must not raise: the job ran, and the loop answers what was not written here
            self._tasks.log_result(result)
            self.logged = True
            self.written = self._tasks._write_result_now(line)
        except Exception:
            log.exception("internal error writing a result on its job thread")
