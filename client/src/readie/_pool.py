"""``Pool``: a ``readie pool`` process driven over its JSONL pipes, safe to share between threads.

Both directions go through one :class:`~readie_protocol.connection.PoolConnection`
(the client's end of the protocol, without I/O), which writes the protocol's
typed requests (a host function's reply, answered by nothing, is written by
the same protocol code on the thread that ran the call). One thread reads the pool's
stdout into it and hands each answer to the caller waiting on its id (results come in completion order, not request order); another
keeps the last lines of its stderr for error messages. Callers write their
request lines under a lock and wait on their own queue, which brings their
job's output events (for its callbacks, run on the caller's thread) and then
its answer, so any number of threads can have jobs in flight; the pool's own queue (twice its workers)
pushes back on writers when it is full, and nothing on this side buffers
without bound.

A result whose error is ``RequestError`` (the pool refused the request, so
nothing ran) is raised from :meth:`Pool.run` as :class:`~readie.RequestError`:
a refusal is a bug in the caller and should be loud. Every other outcome,
the job's exception, a timeout, a worker failure, is returned as the
:class:`~readie.Result`; :meth:`Result.raise_for_error` raises it on request.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
import time
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

from readie_executor.jobs import bounds
from readie_protocol import MAX_LINE_BYTES
from readie_protocol.connection import ENDED, NEED_DATA, PoolConnection, Role, Stray
from readie_protocol.events import CallEvent, OutputEvent, ReadyEvent, Result, StatsEvent

from ._errors import PoolError, ReadieError, WaitTimeout
from ._host import HostCallRunner, HostFunctions, check_functions
from ._process import EXIT_WAIT_S, StartedPool, pool_argv
from ._output import OutputCallback, OutputCallbacks, Waiter
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
from ._session import Session, attach_session
from ._session_images import Answer, new_session_name, raise_if_refused

__all__ = ["MAX_EVENT_LINE_BYTES", "READ_BYTES", "START_TIMEOUT_S", "Pool"]

log = logging.getLogger("readie")

#: Start-up is a manifest check, a sweep and the first warm restores (about a
#: second here); a minute leaves room for a loaded machine and cold caches.
START_TIMEOUT_S = 60.0
#: The longest line the pool can write: a result carries stdout and stderr of
#: up to the sandbox's capture ceiling each, and JSON may spell one captured
#: byte as six (``\\udcXX``, an undecodable byte); the rest of a result, and a
#: call event's arguments, fit in one request line's worth. A longer line is
#: not the pool's: the reader stops there instead of buffering it.
MAX_EVENT_LINE_BYTES = 2 * 6 * bounds.MAX_OUTPUT_LIMIT + MAX_LINE_BYTES
#: What one read of stdout asks for; a line longer than this comes in several.
READ_BYTES = 64 * 1024
#: Threads that run host functions: one per pool worker (a task waits on one
#: call at a time), but no more than this whatever a pool's ready event claims.
MAX_HOST_THREADS = 64


class Pool:
    """A ``readie pool``: jobs in fresh gVisor sandboxes, one per :meth:`run`.

    ``workers``, ``preload``, ``package_dirs`` and ``config`` become the
    pool's flags; left unset (``None`` or empty), the config file's values
    apply, else the pool's defaults (2 workers, no preloads, no package dirs).
    ``router`` (``host:port``) runs the jobs through a ``readie router``
    instead of a worker inside the pool process; ``token_file``, ``tls_ca``,
    ``tls_cert`` and ``tls_key`` say how to reach it (a bearer token in a
    file; TLS against that CA; a client certificate for mTLS). ``cwd`` is the
    pool's working directory: relative grants and scripts resolve against it
    (default: this process's). ``command`` is the ``readie`` command to run
    (default: :func:`default_command`); ``checkpoints`` is passed as
    ``--checkpoints`` (default: the pool finds them as every readie command
    does: ``$READIE_CHECKPOINTS``, else ``build/checkpoints`` under ``cwd``
    if it holds a manifest, else ``~/.cache/readie/checkpoints``, which
    ``make capture`` links; docs/pool.md).
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
        self._lock = threading.Lock()  # _connection, _pending, _ended, _closed, _failure; never held for I/O
        self._write_lock = threading.Lock()  # whole lines on stdin, one at a time
        self._connection = PoolConnection(Role.CLIENT, max_line_bytes=MAX_EVENT_LINE_BYTES)
        self._pending: dict[RequestId, Waiter] = {}
        self._ids = itertools.count(1)
        self._ended = False  # stdout is done: nothing more will be answered
        self._closed = False
        self._failure: str | None = None  # why the pool is unusable, once it is
        # Host-function calls: at most one per running task, so the pool's workers bound them.
        self._host_calls = HostCallRunner(self._send_line, threads=workers or 2)
        self._ready = threading.Event()
        self._start_error: ReadieError | None = None
        self.ready: ReadyEvent
        self._process = StartedPool(self.argv, self.cwd)
        self._stdin: IO[bytes] = self._process.stdin
        self._reader = threading.Thread(
            target=self._read_stdout, args=(self._process.stdout,), name="readie-pool-results", daemon=True
        )
        self._reader.start()
        if not self._ready.wait(start_timeout):
            self._stop()
            raise PoolError(f"readie pool was not ready within {start_timeout} s{self._process.stderr_suffix()}")
        if self._start_error is not None:
            self._stop()
            raise self._start_error
        if not hasattr(self, "ready"):  # the reader failed before the ready event, not on a protocol error
            self._stop()
            raise PoolError(f"{self._failure or 'readie pool did not start'}{self._process.stderr_suffix()}")
        self._host_calls.threads = min(self.ready.workers, MAX_HOST_THREADS)

    # ------------------------------------------------------------------ public

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def stderr_tail(self) -> str:
        """The last lines the pool wrote on stderr (its log)."""
        return self._process.stderr_tail

    def run(
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
        """Run one job and wait for its result. Exactly one of ``code`` and ``script``.

        ``functions`` (name to callable) are host functions: the code imports
        them from ``readie_host`` and each call runs the callable here, in this
        process, on a thread of the client's (see client/README.md).
        ``on_stdout`` and ``on_stderr`` take the job's output as it is written
        (text, in order, on this thread); the result still holds all of it.
        ``wait_timeout`` (seconds) bounds the wait on this side: past it the
        job is cancelled and :class:`~readie.WaitTimeout` raised.
        ``report_files``: ``result.files`` lists what it created or changed in
        ``allow_write`` (host path and size). ``files`` (workspace path to
        bytes: at most 64 files, 768 KiB together) are written into the job's
        workspace, its working directory in the sandbox, before its code runs;
        ``collect`` (paths, or globs: ``*``, ``?``, ``[...]``, ``**``) names
        the files that come back afterwards, whether the code failed or not:
        ``result.collected`` maps each path to its bytes, ``result.left_out``
        says what matched and was left out, and why (size, count, link, ...).
        ``result.network``: what the egress policy refused (None without the network).

        Returns the result whatever the job did; raises :class:`~readie.RequestError`
        when the request is refused (by this client, before it sends anything: a
        value the pool's parser refuses, such as ``timeout="soon"``, or a line over
        1 MiB; or by the pool: a grant outside its limits, an unknown profile, ...) and
        :class:`~readie.PoolError` when the pool process fails.
        """
        declared = check_functions(functions)
        callbacks = OutputCallbacks.of(on_stdout, on_stderr)
        request = job_request(
            self._next_id(), code, script=script, name=name, args=args, allow_read=allow_read,
            allow_write=allow_write, package_dirs=package_dirs, env=env, allow_network=allow_network,
            timeout=timeout, memory=memory, max_output=max_output, max_file_size=max_file_size,
            profile=profile, packages=packages, functions=declared, stream=callbacks is not None,
            report_files=report_files, files=files, collect=collect,
        )
        result = self._exchange(request, declared, callbacks, wait_timeout)
        assert isinstance(result, Result)
        raise_if_refused(result)
        return result

    def session(
        self,
        name: str | None = None,
        *,
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
    ) -> Session:
        """A :class:`~readie.Session`: one sandbox whose variables survive between its ``run`` calls.

        The grants, limits and host ``functions`` are the session's for its
        whole life (the pool fixes them with the first step; every step can
        call the functions); ``timeout`` and ``max_output`` are
        each step's default, which :meth:`Session.run` can override. ``name``
        is the session's name on the wire (default: a random one). Nothing is
        sent until the first ``run``.
        """
        declared = check_functions(functions)
        setup = session_setup(
            allow_read=allow_read, allow_write=allow_write, package_dirs=package_dirs, env=env,
            allow_network=allow_network, timeout=timeout, memory=memory, max_output=max_output,
            max_file_size=max_file_size, profile=profile, packages=packages, functions=declared,
        )
        if name is not None and not isinstance(name, str):
            raise TypeError(f"name: expected a str, got {type(name).__name__}")
        return Session(self, name or new_session_name(), setup, declared)

    def attach(self, name: str, key: str, *, functions: HostFunctions | None = None) -> Session:
        """Continue a stored session (decision 32) as this pool's session ``name``: the
        :attr:`Session.key` of a session whose pool let it go into the session store this
        pool shares (``readie pool --session-store``; a SIGTERM, a broken stream). ``functions``
        answer its host calls. Raises :class:`~readie.RequestError` for a wrong or unknown key (the
        same refusal) and for a name open here already."""
        return attach_session(self, name, key, check_functions(functions))

    def stats(self) -> dict[str, Any]:
        """The pool's counters: the spec's stats event, as the pool wrote it."""
        stats = self._exchange(stats_request(self._next_id()))
        assert isinstance(stats, StatsEvent)
        return stats.to_json()

    def close(self, timeout: float | None = None) -> None:
        """End stdin, let the pool finish every accepted job and wait for it to exit.

        Threads still waiting in :meth:`run` get their results. With a
        ``timeout`` (seconds), a pool still running after that long is
        stopped (SIGTERM, then SIGKILL). Raises :class:`~readie.PoolError` if
        the pool did not exit 0. Calling it again does nothing.
        """
        with self._lock:
            if self._closed:
                return
            self._closed = True
        # A writer blocked on a full stdin holds the lock: a pool that stopped reading must not
        # make close wait past its timeout.
        if self._write_lock.acquire(timeout=-1 if timeout is None else timeout):
            try:
                self._process.close_stdin()
            finally:
                self._write_lock.release()
        else:
            self._stop()
        try:
            status = self._process.status(timeout)
            if status is None:
                self._stop()
                raise PoolError(f"readie pool did not finish within {timeout} s and was stopped{self._process.stderr_suffix()}")
        finally:
            self._reader.join(EXIT_WAIT_S)
            self._process.settle()
            self._host_calls.close()
        if status != 0:
            raise PoolError(f"readie pool exited with status {status}{self._process.stderr_suffix()}")

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
            return
        # An exception is already on its way out; a failing close must not replace it.
        try:
            self.close()
        except PoolError as close_error:
            log.warning("closing the pool after an error failed too: %s", close_error)

    # ------------------------------------------------------------------ requests

    def _next_id(self) -> int:
        with self._lock:
            return next(self._ids)

    def _exchange(
        self,
        request: AnsweredRequest,
        functions: dict[str, Any] | None = None,
        callbacks: OutputCallbacks | None = None,
        wait_timeout: float | None = None,
    ) -> Answer:
        """Send ``request`` and wait for its answer; ``functions`` answer the calls the task makes
        meanwhile, ``callbacks`` take its output events. A wait that ends early (``wait_timeout``,
        a callback's exception, KeyboardInterrupt) cancels the task (a step's cancel ends its
        session). ``wait_timeout`` counts from when the request is written: the pool's queue
        pushes back on writers before that."""
        request_id = request.id
        deadline = None if wait_timeout is None else time.monotonic() + wait_timeout
        waiter = Waiter(callbacks)
        with self._lock:
            if self._closed:
                raise PoolError("the pool is closed")
            if self._failure is not None:
                raise PoolError(self._failure)
            if self._ended:
                raise self._ended_error("no longer answers")
            # Registered before the line is written: the answer can come at once.
            line = self._connection.send(request)
            self._pending[request_id] = waiter
        if functions:
            self._host_calls.register(request_id, functions)
        try:
            try:
                with self._write_lock:
                    self._stdin.write(line)
                    self._stdin.flush()
            except (OSError, ValueError):  # ValueError: close() closed stdin meanwhile
                with self._lock:
                    self._pending.pop(request_id, None)
                    self._connection.forget(request_id)
                if self._closed:
                    raise PoolError("the pool is closed") from None
                self._process.status(EXIT_WAIT_S)
                raise self._ended_error("stopped reading requests") from None
            try:
                answered = waiter.wait(deadline)
            except BaseException:
                self._give_up(request_id)
                raise
            if not answered:
                self._give_up(request_id)
                raise WaitTimeout(f"no answer to request {request_id!r} within {wait_timeout} s; the job was cancelled")
        finally:
            # Every call of the task came before its result: none can come after.
            self._host_calls.unregister(request_id)
        if waiter.error is not None:
            raise waiter.error
        assert waiter.answer is not None
        return waiter.answer

    def _give_up(self, request_id: RequestId) -> None:
        """This caller stops waiting for ``request_id``: its answer will be dropped, and the
        pool asked to stop the task."""
        with self._lock:
            if self._pending.pop(request_id, None) is None:
                return
        self._send_and_forget(cancel_request(self._next_id(), request_id))

    def _send_and_forget(self, request: AnsweredRequest) -> None:
        """Send ``request`` for no caller: its answer is dropped (a cancel, a session's close)."""
        with self._lock:
            if self._ended or self._closed:
                return
            line = self._connection.send(request)
        self._send_line(line)

    # ------------------------------------------------------------------ reader threads

    def _read_stdout(self, stdout: IO[bytes]) -> None:
        try:
            self._read_events(stdout)
        except ReadieError as exc:  # the pool broke the protocol (or speaks another version)
            if self._ready.is_set():
                self._broken(str(exc))
            else:
                self._start_error = exc
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("readie pool reader failed")
            with self._lock:
                self._failure = f"the client's reader failed: {type(exc).__name__}: {exc}"
        finally:
            self._ready.set()
            stdout.close()
            self._end_of_output()

    def _read_events(self, stdout: IO[bytes]) -> None:
        while True:
            with self._lock:
                event = self._connection.next_event()
            if event is NEED_DATA:
                try:
                    data = stdout.read1(READ_BYTES)
                except (OSError, ValueError) as exc:
                    if self._ready.is_set():
                        raise
                    # The pipe failed under us: not ready, say so at once.
                    raise PoolError(f"cannot read readie pool's output: {exc}{self._process.stderr_suffix()}") from None
                with self._lock:
                    self._connection.receive_data(data)
            elif event is ENDED:
                if not self._ready.is_set():
                    status = self._process.settle()
                    raise PoolError(f"readie pool exited with status {status} before it was ready{self._process.stderr_suffix()}")
                return
            elif isinstance(event, ReadyEvent):
                self.ready = event
                self._ready.set()
            elif isinstance(event, CallEvent):
                self._host_calls.handle(event)
            elif isinstance(event, OutputEvent):
                with self._lock:
                    waiter = self._pending.get(event.id)
                if waiter is not None:
                    waiter.output(event)
            elif isinstance(event, Stray):
                # A caller that was interrupted while waiting, or a pool bug: nobody to tell.
                log.warning("readie pool answered a request nobody waits for: %r", event)  # Stray: cut at 200 bytes
            else:
                with self._lock:
                    waiter = self._pending.pop(event.id, None)
                if waiter is not None:
                    waiter.set(event)

    def _send_line(self, line: bytes) -> None:
        """Write one line (a host call's reply) from any thread; a pool that is gone drops it."""
        try:
            with self._write_lock:
                self._stdin.write(line)
                self._stdin.flush()
        except (OSError, ValueError):
            pass

    def _broken(self, why: str) -> None:
        """The pool broke the protocol: nothing it says can be trusted to match a caller any more."""
        log.error("%s", why)
        with self._lock:
            self._failure = why
            waiters = list(self._pending.values())
            self._pending.clear()
        for waiter in waiters:
            waiter.fail(PoolError(self._failure))

    def _end_of_output(self) -> None:
        with self._lock:
            self._ended = True
            waiters = list(self._pending.items())
            self._pending.clear()
        if not waiters:
            return
        self._process.settle()
        for request_id, waiter in waiters:
            waiter.fail(self._ended_error(f"did not answer request {request_id!r}"))

    # ------------------------------------------------------------------ process

    def _stop(self) -> None:
        self._process.stop()  # stdout ends now; the reader reads it to the end and closes it
        self._host_calls.close()

    def _ended_error(self, what: str) -> PoolError:
        status = self._process.poll()
        state = "is still running" if status is None else f"exited with status {status}"
        if self._failure is not None:
            return PoolError(self._failure)
        return PoolError(f"readie pool {what}: its output ended and it {state}{self._process.stderr_suffix()}")

