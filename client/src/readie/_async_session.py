# The source of _session.py: scripts/unasync.py generates it from this file; regenerate after a change.
"""``AsyncSession``: one sandbox whose ``__main__`` survives between :meth:`AsyncSession.run` calls.

The pool creates a session on its first request, which carries the
permissions, limits, environment and host function names given to
:meth:`AsyncPool.session <readie.AsyncPool.session>`; later steps carry only code,
name, args, timeout and max_output, and every step can call the functions
(they run in this process, as for :meth:`AsyncPool.run <readie.AsyncPool.run>`). A step that times out, crashes or exits ends the session (its
result has ``session_ended``); the next :meth:`~AsyncSession.run` then starts a
new process with the same grants, and its result's ``step`` is 1 again.
The pool also closes a session left idle for its ``session_idle``; the
next step then runs in a new process *without* the grants (the client
cannot tell in advance), which ``result.step == 1`` and the grant's
PermissionError make visible.

:meth:`AsyncSession.upload`, :meth:`AsyncSession.download` and
:meth:`AsyncSession.files` move one file of the session's workspace (its
working directory in the sandbox, kept as long as the session, through
hibernation and into forks) a chunk at a time, each chunk one request and
one answer (``_transfers``), so no line holds a whole file; a local file is
read and written a chunk at a time too (on the awaiting task: a chunk is at
most 1 MiB of disk I/O).

:meth:`AsyncSession.hibernate` checkpoints the session to disk and frees its
sandbox; the session stays open, and its next step restores it first (that
result's ``resumed_ms``). :meth:`AsyncSession.fork` makes a second session, open
at once, whose ``__main__`` is a copy of this one's: same grants, same host
functions (answered by this client for the fork's steps too), its own
sandbox; from then on neither sees the other's changes.

A session outlives its pool (decision 32) when the pool keeps a session
store: :attr:`AsyncSession.key` is its key (from its first result, or its
fork's answer), a secret to keep where only you read it; once its pool has
let it go into the store (a SIGTERM, a broken stream), :func:`attach_session`
(``AsyncPool.attach``) continues it from another pool, under a name of that
pool's. A step whose worker was lost comes back with ``result.lost``: it may
have run in part, and the session goes on.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol, Self, overload

from readie_protocol.events import AttachedEvent, ForkedEvent, HibernatedEvent, Result
from readie_protocol.requests import JobRequest
from readie_protocol.transfers import ChunkEvent, ListingEvent, UploadChunk, UploadedEvent
from readie_protocol.workspace import FileChunk

from ._errors import PoolError, ReadieError, RequestError
from ._output import OutputCallback, OutputCallbacks
from ._requests import AnsweredRequest, Duration, Files, PathArg, Size, attach_request, close_request, step_request
from ._transfers import (
    FileList,
    UploadData,
    check_chunk,
    check_listing,
    check_uploaded,
    download_request,
    download_sink,
    list_request,
    upload_chunks,
    upload_path,
)
from ._session_images import (
    Answer,
    answered,
    fork_name,
    fork_request,
    hibernate_request,
    raise_if_refused,
    require_open,
)

__all__ = ["AsyncSession", "AsyncSessionPool", "attach_session"]


class AsyncSessionPool(Protocol):
    """What a session needs of the pool that made it (the pool's own private half).

    ``_exchange`` sends one request and waits for its answer; a wait that
    ends early (cancelled, interrupted, a callback that raised) has the pool
    cancel the request, which ends a step's session. ``_send_and_forget``
    sends a request whose answer nobody waits for.
    """

    def _next_id(self) -> int: ...

    async def _exchange(
        self,
        request: AnsweredRequest,
        functions: dict[str, Any] | None = None,
        callbacks: OutputCallbacks | None = None,
    ) -> Answer: ...

    def _send_and_forget(self, request: AnsweredRequest) -> None: ...


class AsyncSession:
    """A stateful sandbox of a :class:`~readie.AsyncPool`; made by :meth:`AsyncPool.session <readie.AsyncPool.session>`.

    ``run`` calls on one AsyncSession are serialized (the pool runs a session's
    steps one at a time anyway). Use it as a context manager, or call
    :meth:`close`, so the pool frees the sandbox before ``session_idle``.
    """

    def __init__(
        self,
        pool: AsyncSessionPool,
        name: str,
        setup: Mapping[str, Any],
        functions: Mapping[str, Callable[..., Any]] | None = None,
    ) -> None:
        self.pool = pool
        self.name = name
        self.setup = dict(setup)  # the first request's fields: grants, env, limits, function names
        self.functions = dict(functions or {})  # what answers the steps' host calls
        self._lock = asyncio.Lock()
        self._open = False  # the pool has a process for this session
        self._key: str | None = None  # never in the repr, never logged
        self.last_step = 0

    @property
    def open(self) -> bool:
        """Whether the pool holds a process for this session (as far as this client knows)."""
        return self._open

    @property
    def key(self) -> str | None:
        """The session's key (decision 32): with it, :func:`attach_session` continues the session from
        another pool once this one has let it go into its session store. None before the first
        step, after a step that ended the session, and when the pool's sessions cannot outlive it."""
        return self._key

    async def run(
        self,
        code: str,
        name: str | None = None,
        args: Iterable[str] = (),
        timeout: Duration | None = None,
        max_output: Size | None = None,
        *,
        on_stdout: OutputCallback | None = None,
        on_stderr: OutputCallback | None = None,
        report_files: bool = False,
        files: Files | None = None,
        collect: Iterable[str] = (),
    ) -> Result:
        """Run ``code`` as the session's next step and return its result.

        ``on_stdout`` and ``on_stderr`` take the step's output as it is
        written, as in :meth:`AsyncPool.run`; ``files`` and ``collect`` too:
        files written into the workspace before the code runs, and the paths
        or patterns whose files come back in ``result.collected``. In a session
        with the network, ``result.network`` says what the egress policy refused
        this step (not the steps before). Returns
        whatever the code did (its exception, a timeout: see
        ``result.session_ended``); raises :class:`~readie.RequestError` when
        the pool refuses the step and :class:`~readie.PoolError` when the pool
        fails.
        """
        callbacks = OutputCallbacks.of(on_stdout, on_stderr)
        async with self._lock:
            request = step_request(
                self.pool._next_id(), self.name, code, name=name, args=args, timeout=timeout, max_output=max_output,
                setup=None if self._open else self.setup, stream=callbacks is not None, report_files=report_files,
                files=files, collect=collect,
            )
            return await self._step(request, callbacks)

    async def _step(self, request: JobRequest, callbacks: OutputCallbacks | None = None) -> Result:
        """Send one step (the lock held) and keep what its result says of the session."""
        try:
            result = await self.pool._exchange(request, self.functions, callbacks)
        except ReadieError:
            raise
        except BaseException:
            # Cancelled, interrupted, a callback raised: the pool cancelled the step, which ends the
            # session, and the close lets the next run open a new one under the same name.
            self._open = False
            self.pool._send_and_forget(close_request(self.pool._next_id(), self.name))
            raise
        assert isinstance(result, Result)
        raise_if_refused(result)
        self._open = not result.session_ended
        if result.session_key is not None:  # a session's first result: a new session, a new key
            self._key = result.session_key
        if result.session_ended:
            self._key = None
        if not result.lost:  # a lost step has no number: the session's last is still the one before
            self.last_step = result.step or 0
        return result

    # ------------------------------------------------------------------ files

    async def upload(self, path: str, data_or_local_path: UploadData) -> int:
        """Write one file of the session's workspace: ``data_or_local_path`` is its bytes, or the
        path of a local file, read a chunk at a time; return its size.

        ``path`` is relative to the workspace (directories are made; a file
        there is replaced). The file may hold up to 256 MiB (less when the
        operator's ``transfer_bytes`` says so) and counts against the
        session's memory. A session not open yet is opened first, by an
        empty step (its ``step`` 1), with the session's grants. Raises
        :class:`~readie.RequestError` for a bad path or a file too large (the
        session goes on), :class:`~readie.FileChanged` when a local file grows
        or shrinks while it is read (the session's copy is then partial).
        """
        async with self._lock:
            with upload_chunks(data_or_local_path) as source:
                checked = upload_path(self.name, path, source.size)
                if not self._open:
                    opened = await self._step(step_request(self.pool._next_id(), self.name, "", setup=self.setup))
                    opened.raise_for_error()
                offset = 0
                for data in source.chunks:
                    request = UploadChunk(self.pool._next_id(), self.name, checked, offset, source.size, data)
                    answer = await self.pool._exchange(request)
                    check_uploaded(answered(self, answer, UploadedEvent), request)
                    offset += len(data)
            return source.size

    @overload
    async def download(self, path: str, to: None = None) -> bytes: ...

    @overload
    async def download(self, path: str, to: PathArg) -> Path: ...

    async def download(self, path: str, to: PathArg | None = None) -> bytes | Path:
        """One file of the session's workspace: its bytes, or (``to``: a local path) written there a
        chunk at a time as it comes, and that path.

        A local file is written beside ``to`` and renamed over it once whole
        (with mode 0600, as a temporary file is made): a download that fails
        leaves ``to`` as it was. Raises :class:`~readie.FileChanged` when the
        file changed between two chunks (nothing of the two versions is
        kept), :class:`~readie.RequestError` for a bad path, a file that is
        missing, not a regular file or too large, and when the session is not
        open (no step has run: there is nothing to read).
        """
        async with self._lock:
            require_open(self, "download")
            request = download_request(self.pool._next_id(), self.name, path)
            first: FileChunk | None = None
            with download_sink(to) as sink:
                while True:
                    answer = await self.pool._exchange(request)
                    chunk = check_chunk(answered(self, answer, ChunkEvent), request, first)
                    if first is None:
                        first = chunk
                    sink.write(chunk.data)
                    if chunk.last:
                        return sink.finish()
                    request = download_request(self.pool._next_id(), self.name, request.path, chunk.end)

    async def files(self, path: str = ".") -> FileList:
        """The entries of directory ``path`` of the workspace (``"."``: the workspace itself): names,
        sizes and kinds, sorted by name, at most 1000 (the list's ``truncated`` says when there
        were more). Links are listed as links, never followed. Raises
        :class:`~readie.RequestError` as :meth:`download` does."""
        async with self._lock:
            require_open(self, "list")
            request = list_request(self.pool._next_id(), self.name, path)
            answer = await self.pool._exchange(request)
            return check_listing(answered(self, answer, ListingEvent), request)

    async def hibernate(self) -> int:
        """Checkpoint the session to disk and free its sandbox; return how long it took (ms).

        The session stays open, its variables and grants kept: the next
        :meth:`run` restores it first (its result's ``resumed_ms`` says how
        long that took). Returns 0 when it was hibernated already, and when
        it is not open (no step has run, or the last one ended it): then
        nothing is sent, since the pool holds nothing to hibernate, as
        :meth:`close` does nothing. Raises :class:`~readie.RequestError` when
        the pool refuses (the session goes on, unless the pool says it is
        not open: then the next :meth:`run` opens it anew), :class:`~readie.SandboxSetupError` when the image could not be
        made (the session goes on, in its sandbox) and
        :class:`~readie.PoolWorkerError` when the attempt ended the session.
        """
        async with self._lock:
            if not self._open:
                return 0
            answer = await self.pool._exchange(hibernate_request(self.pool._next_id(), self.name))
            return answered(self, answer, HibernatedEvent).hibernate_ms

    async def fork(self, name: str | None = None) -> AsyncSession:
        """A new session whose state is a copy of this one's now; it is open at once.

        The fork has this session's grants and limits and its host
        functions (this client answers its steps' calls too); each goes on
        in its own sandbox, and neither sees the other's changes. Its first
        step is its ``step`` 1, and its result has ``resumed_ms``. ``name``
        is the fork's name on the wire (default: a random one). Raises
        :class:`~readie.RequestError` without asking the pool when this
        session is not open (no step has run: there is no state to copy),
        and when the pool refuses: ``name`` is open already, ``max_sessions``
        are open already. Other errors as for :meth:`hibernate`.
        """
        new_name = fork_name(name)
        async with self._lock:
            require_open(self, "fork")
            request = fork_request(self.pool._next_id(), self.name, new_name)
            try:
                answer = await self.pool._exchange(request)
            except ReadieError:
                raise
            except BaseException:
                # Interrupted: the fork may be made all the same. A name made here is nobody else's,
                # so closing it cannot end another session; a caller's name may be, and is left alone.
                if name is None:
                    self.pool._send_and_forget(close_request(self.pool._next_id(), new_name))
                raise
            forked = answered(self, answer, ForkedEvent)
        fork = AsyncSession(self.pool, new_name, self.setup, self.functions)
        fork._open = True  # the pool holds it: its steps must carry no setup (its next opening will)
        fork._key = forked.session_key
        return fork

    async def close(self) -> None:
        """Ask the pool to end the session and free its sandbox; does nothing when it is not open."""
        async with self._lock:
            if not self._open:
                return
            self._open = False
            answer = await self.pool._exchange(close_request(self.pool._next_id(), self.name))
            if isinstance(answer, Result):  # the pool refused the close
                assert answer.error is not None
                raise RequestError(answer.error.message, result=answer)

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"<readie.AsyncSession {self.name!r} {'open' if self._open else 'not open'}>"


async def attach_session(
    pool: AsyncSessionPool, name: str, key: str, functions: Mapping[str, Callable[..., Any]] | None = None
) -> AsyncSession:
    """The stored session ``key``, held by ``pool`` now as its session ``name``, open: its next
    :meth:`~AsyncSession.run` continues the same ``__main__`` (its result's ``resumed_ms`` says how
    long the resume took). ``functions`` answer its host calls (the functions it declared when it
    opened). Its grants and limits are the stored session's; should a step end it, the next run
    opens a new session without any. Raises :class:`~readie.RequestError` for a wrong or unknown
    key (one refusal for both) and for a name the pool has open already."""
    answer = await pool._exchange(attach_request(pool._next_id(), name, key))
    if isinstance(answer, Result):
        answer.raise_for_error()
    if not isinstance(answer, AttachedEvent):
        raise PoolError(f"readie pool answered an attach with {type(answer).__name__}")
    session = AsyncSession(pool, name, {}, functions)
    session._open, session._key, session.last_step = True, key, answer.step
    return session
