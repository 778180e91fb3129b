"""``AsyncPool``: ``readie.Pool`` on asyncio, the same ``readie pool`` process and protocol, awaited.

The protocol is the one :class:`~readie_protocol.connection.PoolConnection`
the sync :class:`~readie.Pool` drives; only the I/O differs. One task reads
the pool's stdout into the connection and resolves each request's future;
every caller awaits its own. Everything runs on the event loop, so the
connection needs no lock, and a write is one ``write`` of a whole line
(asyncio's transport never interleaves two) followed by ``drain``, which is
where the pool's own queue pushes back.

Host functions may be plain callables (run on a thread, as in the sync
client, so a slow one never stops the loop) or coroutine functions (awaited
on the loop), and so may output callbacks, which run in the task that
awaits ``run``, in order. A task that stops awaiting :meth:`AsyncPool.run`
(cancelled, its ``wait_timeout``, a callback that raised) sends the pool a
cancel for the job, which frees its sandbox. A task that stops awaiting
:meth:`AsyncSession.run <readie.AsyncSession.run>` ends the session: its
sandbox is freed once the running step ends (at its timeout at most), and the
next ``run`` starts a new one. Cancelling the wait for
:meth:`AsyncSession.hibernate <readie.AsyncSession.hibernate>` does not stop
the hibernation; the session stays open either way.

:class:`~readie.AsyncSession` is the source :class:`~readie.Session` is
generated from (scripts/unasync.py); the two pools are written twice, since
what differs between them is how they wait, not what they say
(docs/decisions/0029-async-written-once.md).
"""

from __future__ import annotations

import asyncio
import inspect
import itertools
import logging
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Self

from readie_protocol.connection import ENDED, NEED_DATA, PoolConnection, Role, Stray
from readie_protocol.events import CallEvent, OutputEvent, ReadyEvent, Result, StatsEvent
from readie_protocol.requests import CancelJob

from ._errors import PoolError, ReadieError, WaitTimeout
from ._host import HostFunctions, check_functions, failed_reply, missing_reply, value_reply
from ._output import OutputCallback, OutputCallbacks, delivering
from ._pool import MAX_EVENT_LINE_BYTES, READ_BYTES, START_TIMEOUT_S
from ._process import CLOSE_KILL_GRACE_S, EXIT_WAIT_S, PoolStderrTail, pool_argv
from ._async_session import AsyncSession, attach_session
from ._requests import (
    AnsweredRequest,
    Duration,
    Files,
    PathArg,
    RequestId,
    Size,
    cancel_request,
    job_request,
    session_setup,
    stats_request,
)
from ._session_images import Answer, new_session_name, raise_if_refused

__all__ = ["AsyncPool"]

log = logging.getLogger("readie")


class AsyncPool:
    """A ``readie pool`` driven from asyncio: ``async with AsyncPool(...) as pool``, then ``await pool.run(...)``.

    The arguments are :class:`~readie.Pool`'s. The process starts in
    :meth:`start` (or on entering the ``async with``), not in the constructor.
    """

    def __init__(
        self,
        workers: int | None = None,
        preload: Iterable[str] = (),
        package_dirs: Iterable[PathArg] = (),
        config: PathArg | None = None,
        command: Sequence[str] | None = None,
        router: str | None = None,
        cwd: PathArg | None = None,
        *,
        checkpoints: PathArg | None = None,
        start_timeout: float = START_TIMEOUT_S,
        token_file: PathArg | None = None,
        tls_ca: PathArg | None = None,
        tls_cert: PathArg | None = None,
        tls_key: PathArg | None = None,
    ) -> None:
        self.cwd = Path(os.path.abspath(cwd if cwd is not None else os.getcwd()))
        self.argv = pool_argv(
            workers, preload, package_dirs, config, command, router, checkpoints,
            token_file=token_file, tls_ca=tls_ca, tls_cert=tls_cert, tls_key=tls_key,
        )
        self._start_timeout = start_timeout
        self._connection = PoolConnection(Role.CLIENT, max_line_bytes=MAX_EVENT_LINE_BYTES)
        self._pending: dict[RequestId, asyncio.Future[Answer]] = {}
        self._functions: dict[RequestId, dict[str, Callable[..., Any]]] = {}
        # Output events of requests whose caller takes them, in order (bounded by the pool: max_output).
        self._outputs: dict[RequestId, asyncio.Queue[OutputEvent]] = {}
        self._ids = itertools.count(1)
        self._process: asyncio.subprocess.Process | None = None
        self._ready: asyncio.Future[ReadyEvent] | None = None
        self._tasks: set[asyncio.Task[Any]] = set()
        # One line at a time into stdin, each drained before the next: a line waits here, not in the
        # transport's buffer, so many callers cannot pile their lines up behind a pool that pushes back.
        self._write_lock = asyncio.Lock()
        # Calls waiting for their reply, by request: a pool makes at most one per task at a time.
        self._calls_waiting: set[RequestId] = set()
        self._tail = PoolStderrTail()
        self._failure: str | None = None  # why the pool is unusable, once it is
        self._closed = False
        self.ready: ReadyEvent

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> Self:
        """Start ``readie pool`` and wait for its ready event; :class:`~readie.PoolError` if it is not ready in time."""
        if self._process is not None:
            if self._failure is not None:
                raise PoolError(self._failure)
            return self
        try:
            self._process = await asyncio.create_subprocess_exec(
                *self.argv, cwd=self.cwd,
                stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
            )
        except OSError as exc:
            raise PoolError(f"cannot start {' '.join(self.argv)}: {exc}") from None
        self._ready = asyncio.get_running_loop().create_future()
        # Retrieved here even when nobody awaits it any more (a start that timed out or was cancelled).
        self._ready.add_done_callback(lambda ready: ready.cancelled() or ready.exception())
        self._reader = self._spawn(self._read_stdout())
        self._stderr = self._spawn(self._keep_stderr())
        try:
            self.ready = await asyncio.wait_for(asyncio.shield(self._ready), self._start_timeout)
        except TimeoutError:
            await self._abandon("it was not ready in time")
            raise PoolError(f"readie pool was not ready within {self._start_timeout} s{self._suffix()}") from None
        except BaseException:  # its own error, or the caller's cancellation: no process outlives it
            await asyncio.shield(self._abandon("its start failed or was cancelled"))
            raise
        return self

    async def _abandon(self, why: str) -> None:
        """A start that did not finish: stop the process, and refuse every later use."""
        self._failure = self._failure or f"readie pool is unusable: {why}"
        self._closed = True
        await self._stop()

    async def close(self, timeout: float | None = None) -> None:
        """End stdin, let the pool finish every accepted job and wait for it to exit (see :meth:`Pool.close`)."""
        if self._closed or self._process is None:
            self._closed = True
            return
        self._closed = True
        assert self._process.stdin is not None
        self._process.stdin.close()
        try:
            status = await asyncio.wait_for(self._process.wait(), timeout)
        except TimeoutError:
            await self._stop()
            raise PoolError(f"readie pool did not finish within {timeout} s and was stopped{self._suffix()}") from None
        finally:
            await asyncio.wait({self._reader, self._stderr}, timeout=EXIT_WAIT_S)
        if status != 0:
            raise PoolError(f"readie pool exited with status {status}{self._suffix()}")

    async def __aenter__(self) -> Self:
        return await self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            await self.close()
            return
        try:  # an exception is already on its way out; a failing close must not replace it
            await self.close()
        except PoolError as close_error:
            log.warning("closing the pool after an error failed too: %s", close_error)

    @property
    def stderr_tail(self) -> str:
        return self._tail.text

    # ------------------------------------------------------------------ requests

    async def run(
        self,
        code: str | None = None,
        *,
        script: PathArg | None = None,
        name: str | None = None,
        args: Iterable[str] = (),
        allow_read: Iterable[PathArg] = (),
        allow_write: Iterable[PathArg] = (),
        package_dirs: Iterable[PathArg] = (),
        env: Mapping[str, str] | None = None,
        allow_network: bool | Iterable[str] = False,
        timeout: Duration | None = None,
        memory: Size | None = None,
        max_output: Size | None = None,
        max_file_size: Size | None = None,
        profile: str | None = None,
        packages: Iterable[str] = (),
        functions: HostFunctions | None = None,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        wait_timeout: float | None = None,
        report_files: bool = False,
        files: Files | None = None,
        collect: Iterable[str] = (),
    ) -> Result:
        """Run one job and await its result (see :meth:`Pool.run`); ``functions`` and the output
        callbacks may be coroutine functions. Cancelling the wait, or its ``wait_timeout``
        (:class:`~readie.WaitTimeout`), cancels the job."""
        declared = check_functions(functions)
        callbacks = OutputCallbacks.of(on_stdout, on_stderr)
        request = job_request(
            self._next_id(), code, script=script, name=name, args=args, allow_read=allow_read,
            allow_write=allow_write, package_dirs=package_dirs, env=env, allow_network=allow_network,
            timeout=timeout, memory=memory, max_output=max_output, max_file_size=max_file_size,
            profile=profile, packages=packages, functions=declared, stream=callbacks is not None,
            report_files=report_files, files=files, collect=collect,
        )
        try:
            async with asyncio.timeout(wait_timeout) as waiting:
                result = await self._exchange(request, declared, callbacks)
        except TimeoutError:
            if not waiting.expired():  # a callback's own TimeoutError
                raise
            raise WaitTimeout(
                f"no answer to request {request.id!r} within {wait_timeout} s; the job was cancelled"
            ) from None
        assert isinstance(result, Result)
        raise_if_refused(result)
        return result

    def session(self, name: str | None = None, *, functions: HostFunctions | None = None, **grants: Any) -> AsyncSession:
        """An :class:`AsyncSession` (see :meth:`Pool.session` for the grants and limits it takes)."""
        declared = check_functions(functions)
        setup = session_setup(functions=declared, **grants)
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        return AsyncSession(self, name or new_session_name(), setup, declared)

    async def attach(self, name: str, key: str, *, functions: HostFunctions | None = None) -> AsyncSession:
        """Continue a stored session (decision 32) as this pool's session ``name``: the
        :attr:`AsyncSession.key` of a session whose pool let it go into the session store this
        pool shares (``readie pool --session-store``; a SIGTERM, a broken stream). ``functions``
        answer its host calls. Raises :class:`~readie.RequestError` for a wrong or unknown key (the
        same refusal) and for a name open here already."""
        return await attach_session(self, name, key, check_functions(functions))

    async def stats(self) -> dict[str, Any]:
        """The pool's counters, as the pool wrote them."""
        stats = await self._exchange(stats_request(self._next_id()))
        assert isinstance(stats, StatsEvent)
        return stats.to_json()

    def _next_id(self) -> int:
        return next(self._ids)

    async def _exchange(
        self,
        request: AnsweredRequest,
        functions: dict[str, Any] | None = None,
        callbacks: OutputCallbacks | None = None,
    ) -> Answer:
        """Send ``request`` and await its answer; ``functions`` answer the calls the task makes
        meanwhile, ``callbacks`` take its output events. A caller that stops waiting (cancelled,
        its wait_timeout, a callback that raised) has the pool cancel the task, which frees its
        sandbox (a step's cancel ends its session)."""
        if self._process is None:
            raise PoolError("the pool is not started: await pool.start() or use async with")
        if self._closed:
            raise PoolError("the pool is closed")
        if self._failure is not None:
            raise PoolError(f"{self._failure}{self._suffix()}")
        request_id = request.id
        line = self._connection.send(request)
        answer: asyncio.Future[Answer] = asyncio.get_running_loop().create_future()
        self._pending[request_id] = answer
        if functions:
            self._functions[request_id] = functions
        if callbacks is not None:
            self._outputs[request_id] = asyncio.Queue()
        try:
            try:
                await self._write(line)
            except (ConnectionError, RuntimeError) as exc:
                self._connection.forget(request_id)
                raise PoolError(f"readie pool stopped reading requests: {exc}{self._suffix()}") from None
            if callbacks is None:
                return await answer
            return await delivering(answer, self._outputs[request_id], callbacks)
        except ReadieError:
            raise
        except BaseException:
            if not isinstance(request, CancelJob):  # a cancel sent for nobody is not cancelled in turn
                self._send_and_forget(cancel_request(self._next_id(), request_id))
            raise
        finally:
            # Answered, failed or cancelled: nothing more is delivered to this caller.
            self._pending.pop(request_id, None)
            self._functions.pop(request_id, None)
            self._outputs.pop(request_id, None)

    def _send_and_forget(self, request: AnsweredRequest) -> None:
        """Send ``request`` for no caller (a cancel, a session's close); it is answered in the background."""

        async def stop() -> None:
            try:
                await self._exchange(request)
            except ReadieError as exc:  # the pool is gone (or refused): so is the task
                log.warning("%r failed: %s", request, exc)

        self._spawn(stop())

    # ------------------------------------------------------------------ reading

    async def _read_stdout(self) -> None:
        assert self._process is not None and self._process.stdout is not None and self._ready is not None
        stdout = self._process.stdout
        try:
            while (event := self._connection.next_event()) is not ENDED:
                if event is NEED_DATA:
                    self._connection.receive_data(await stdout.read(READ_BYTES))
                elif isinstance(event, ReadyEvent):
                    self._ready.set_result(event)
                elif isinstance(event, CallEvent):
                    if event.id in self._calls_waiting:
                        # A task waits on its one call: a second before the reply is a pool gone wrong,
                        # and answering it would let a pool grow this process without end.
                        raise PoolError(f"readie pool broke the protocol: a second call of request {event.id!r} "
                                        "before its first was answered")
                    self._calls_waiting.add(event.id)
                    self._spawn(self._answer_call(event))
                elif isinstance(event, OutputEvent):
                    if (outputs := self._outputs.get(event.id)) is not None:
                        outputs.put_nowait(event)
                elif isinstance(event, Stray):
                    log.warning("readie pool answered a request nobody waits for: %r", event)  # Stray: cut at 200 bytes
                else:
                    waiter = self._pending.get(event.id)
                    if waiter is not None and not waiter.done():
                        waiter.set_result(event)
            self._end(await self._ended_why())
        except ReadieError as exc:  # broken protocol, another version
            if not self._ready.done():
                self._ready.set_exception(exc)
            self._end(str(exc), failure=str(exc))
            # Nothing it writes is read any more: stop it rather than leave it blocked on a full pipe.
            await self._stop()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("readie pool reader failed")
            self._end(f"the client's reader failed: {exc}", failure=f"the client's reader failed: {exc}")

    async def _ended_why(self) -> str:
        """Once stdout ended: the exit status and the rest of stderr, each within :data:`EXIT_WAIT_S`."""
        assert self._process is not None
        try:
            status: int | None = await asyncio.wait_for(self._process.wait(), EXIT_WAIT_S)
        except TimeoutError:
            status = None
        await asyncio.wait({self._stderr}, timeout=EXIT_WAIT_S)
        state = "is still running" if status is None else f"exited with status {status}"
        return f"readie pool's output ended and it {state}"

    def _end(self, why: str, failure: str | None = None) -> None:
        self._failure = self._failure or failure or why
        if self._ready is not None and not self._ready.done():
            self._ready.set_exception(PoolError(f"{why} before it was ready{self._suffix()}"))
        for waiter in self._pending.values():
            if not waiter.done():
                waiter.set_exception(PoolError(f"{self._failure}{self._suffix()}"))

    async def _answer_call(self, event: CallEvent) -> None:
        function = self._functions.get(event.id, {}).get(event.function)
        if function is None:
            reply = missing_reply(event.call_id, event.function)
        else:
            try:
                if inspect.iscoroutinefunction(function):
                    value = await function(*event.args, **event.kwargs)
                else:
                    value = await asyncio.to_thread(function, *event.args, **event.kwargs)
            except Exception as exc:
                reply = failed_reply(event.call_id, exc)
            else:
                reply = value_reply(event.call_id, event.function, value)
        # Before the reply goes out: the task's next call may come the moment the pool has it.
        self._calls_waiting.discard(event.id)
        try:
            await self._write(reply)
        except (ConnectionError, RuntimeError):
            pass  # the pool is gone; its callers hear of it from the reader

    async def _write(self, line: bytes) -> None:
        assert self._process is not None and self._process.stdin is not None
        async with self._write_lock:
            self._process.stdin.write(line)
            await self._process.stdin.drain()

    async def _keep_stderr(self) -> None:
        assert self._process is not None and self._process.stderr is not None
        while chunk := await self._process.stderr.read(READ_BYTES):
            self._tail.feed(chunk)
        self._tail.end()

    # ------------------------------------------------------------------ process

    def _spawn(self, work: Any) -> asyncio.Task[Any]:
        task = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _stop(self) -> None:
        """SIGTERM, then SIGKILL after :data:`CLOSE_KILL_GRACE_S`."""
        process = self._process
        if process is None or process.returncode is not None:
            return
        process.terminate()
        try:
            await asyncio.wait_for(process.wait(), CLOSE_KILL_GRACE_S)
        except TimeoutError:
            process.kill()
            await process.wait()

    def _suffix(self) -> str:
        return self._tail.suffix()
