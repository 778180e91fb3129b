"""Where the pool's jobs run: the :class:`JobBackend` seam and the in-process worker behind it.

The pool engine (``_engine``) only knows :class:`JobBackend`: hand it a
:class:`~readie_worker.jobs.CodeJob`, await a
:class:`~readie_worker.jobs.JobOutcome`. :class:`ThreadedBackend` adapts any
of readie's blocking runners (``run_job`` and ``close``: the in-process
``Worker``, the gRPC ``WorkerClient``, the router's ``Placement``) by running
each job on a thread; :class:`LocalWorkerBackend` is the one ``readie pool``
uses today, owning a :class:`~readie_worker.core.Worker` in this process. A
remote router (``--router``) is a ``ThreadedBackend`` around a
``WorkerClient``; nothing above the seam changes.

The contract every backend keeps:

* one rule for failures (decision 0027): a job no runner took is *raised*
  as a :class:`~readie_worker.errors.ReadieError` (``RequestError`` for a job
  the worker refuses: too many grants, no egress for the network, a session that
  ended; ``PoolWorkerError`` or ``SandboxSetupError`` when no worker can be
  reached or it is shutting down; ``Cancelled`` while it waited); a job a
  runner took (a worker's slot, the router's placement) *returns* its
  outcome, whatever came of it (timeout, crash, cancel, no sandbox), with
  that runner's clock and backend. The engine turns each into its line in
  one place (``PoolTasks.on_backend``, ``_results``);
* ``close`` ends everything the backend started (no runsc container is left)
  and may be called more than once; a ``run`` after ``close`` raises
  ``PoolWorkerError`` without touching the worker. Jobs still running when
  ``close`` starts end with a worker error: a graceful drain is the pool
  engine's business (it waits for its jobs before closing).
* sessions: ``open_session`` takes the session's setup and first step as
  one job and returns a :class:`BackendSession` and the first step's
  :class:`~readie_worker.sessions.StepOutcome`; it raises like ``run``. The
  session stays where it opened: in this process's worker, or (through a
  router) on one worker, down its own Interact stream. ``hibernate`` and
  ``fork`` work where the worker is this process's (decision 0022). Its
  files move one chunk per call (``upload_chunk``, ``download_chunk``,
  ``list_files``; decision 31), which raise like ``run``: a RequestError for
  a refusal (the session goes on), a PoolWorkerError for a sandbox that
  answered out of bounds.
* host functions: ``run``, ``open_session`` and ``run_step`` take a ``host``
  callback (:data:`~readie_worker.jobs.HostFunction`, called on the job's
  thread for each call the job makes to its declared functions), and an
  ``output`` sink (:data:`~readie_worker.jobs.OutputSink`, called on that
  thread with the job's output as it is written, all before the outcome).
* ``run`` and ``run_step`` may start the job when called, not when awaited (a threaded
  backend has handed it to a job thread when they return: no task need start first);
* ``then``: ``run`` and ``run_step`` call it with the outcome they return,
  before they return it, on the job's thread where there is one (the pool
  writes the result line there: ``PoolTasks.ahead_for``); never when they raise.
  The local worker calls it as soon as the outcome is known, before its own
  bookkeeping after a job or step (``Worker.run_job``'s ``then``); should that
  bookkeeping raise after all, the line ``then`` wrote stays the answer
  (``PoolTasks.finish``).

Choosing the checkpoint from the operator's preload set is here too
(:func:`choose_checkpoint`), since it is the local worker that needs one.
"""

from __future__ import annotations

import asyncio
import contextvars
import functools
from collections.abc import Awaitable, Callable, Iterable
from pathlib import Path
from typing import Protocol, TypeVar

import structlog
from readie_protocol.cancel import NEVER, Cancellation
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import SandboxSetupError
from readie_worker.jobs import CodeJob, HostFunction, JobOutcome, OutputSink, Step
from readie_worker.manifest import MANIFEST_NAME, Checkpoint, Manifest, read_manifest
from readie_worker.metrics import Metrics
from readie_policy.runner import JobRunner, SessionHandle
from readie_protocol.workspace import FileChunk, FileListing

from ._job_threads import JobThreads
from readie_worker.sessions import SandboxSession, StepOutcome

__all__ = [
    "CHECKPOINT_PLAN",
    "TRANSFER_THREADS",
    "WARM_TIMEOUT_S",
    "BackendSession",
    "JobBackend",
    "LocalWorkerBackend",
    "ThreadedBackend",
    "choose_checkpoint",
    "detach_logged",
    "manifest_path",
]

log = structlog.get_logger("readie.pool")

_T = TypeVar("_T")

#: Where operators add checkpoints; named in the start-up refusal.
CHECKPOINT_PLAN = "pipeline/src/readie_pipeline/checkpoints.toml"
#: How long start-up waits for the warm sandboxes before announcing ready
#: anyway. A restore takes 0.3-0.7 s here and refills run one at a time, so
#: this covers dozens of workers; past it the first jobs restore their own.
WARM_TIMEOUT_S = 60.0
#: Chunks of session files that move at once (decision 31), on threads of their own: on the job
#: threads a chunk would wait behind other sessions' steps, or they behind it. A chunk is a
#: socket's few milliseconds to the sandbox; past this many they queue (each session's are in
#: order anyway, and every line holds one of the pool's permits until answered).
TRANSFER_THREADS = 4

class BackendSession(Protocol):
    """An open session: one sandbox, steps in it one at a time.

    ``job`` is the job that opened it (its grants, limits and host functions, fixed for its life):
    an attached session's comes from its holder, not from a request of this pool's. ``key`` is
    its key (None: it cannot outlive this holder)."""

    @property
    def job(self) -> CodeJob: ...

    @property
    def key(self) -> str | None: ...

    def run_step(
        self, step: Step, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER, then: Callable[[StepOutcome], None] | None = None,
    ) -> Awaitable[StepOutcome]:
        """``cancel`` stops the step (and so ends the session)."""
        ...

    async def close(self) -> None:
        """Destroy the session's sandbox; does nothing once it has ended."""
        ...

    async def detach(self) -> None:
        """Let go of the session without ending it: into the session store for a later
        ``attach_session`` (a session without a key is closed instead); ends this handle."""
        ...

    @property
    def hibernated(self) -> bool: ...

    async def hibernate(self) -> float:
        """Checkpoint the idle session to disk and free its sandbox; milliseconds (0: it was)."""
        ...

    async def fork(self) -> tuple[BackendSession, float]:
        """A new session with this one's state now, its own sandbox; and the milliseconds it took."""
        ...

    async def upload_chunk(self, path: str, offset: int, data: bytes, size: int) -> int:
        """Write ``data`` at ``offset`` of the ``size``-byte workspace file ``path``; the bytes it holds now."""
        ...

    async def download_chunk(self, path: str, offset: int, length: int) -> FileChunk:
        """At most ``length`` bytes of workspace file ``path`` from ``offset``."""
        ...

    async def list_files(self, path: str) -> FileListing:
        """The entries of workspace directory ``path``."""
        ...


class JobBackend(Protocol):
    """Runs code jobs for the pool engine; see the module docstring for the contract."""

    def run(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, cancel: Cancellation = NEVER,
        output: OutputSink | None = None, then: Callable[[JobOutcome], None] | None = None,
    ) -> Awaitable[JobOutcome]:
        """``cancel`` (the client's cancel request): the job stops and its sandbox is freed."""
        ...

    async def open_session(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> tuple[BackendSession, StepOutcome]: ...

    async def attach_session(self, key: str) -> tuple[BackendSession, int]:
        """The session stored under ``key``, held here now, and the number of its last step."""
        ...

    async def close(self) -> None: ...


class ThreadedBackend:
    """A :class:`JobRunner` as a :class:`JobBackend`: each job on one of ``slots`` threads.

    ``slots`` should match the pool's workers, so a job the engine lets run
    never waits for a thread. A session's file chunks have threads of their own
    (:data:`TRANSFER_THREADS`).
    """

    def __init__(self, runner: JobRunner, slots: int) -> None:
        self.runner = runner
        self._threads = JobThreads(slots, "readie-job")
        self._transfer_threads = JobThreads(TRANSFER_THREADS, "readie-files")

    def run(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, cancel: Cancellation = NEVER,
        output: OutputSink | None = None, then: Callable[[JobOutcome], None] | None = None,
    ) -> asyncio.Future[JobOutcome]:
        return self._threads.submit(self._job_call(job, job_id, host, cancel, output, then))

    def _job_call(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None, cancel: Cancellation,
        output: OutputSink | None, then: Callable[[JobOutcome], None] | None,
    ) -> Callable[[], JobOutcome]:
        """What a job thread calls for a job: the runner's ``run_job``, then ``then``."""
        run = functools.partial(self.runner.run_job, job, job_id, host, cancel=cancel, output=output)
        return _and_then(run, then)

    def _step_call(
        self, session: SessionHandle, step: Step, job_id: str | None, host: HostFunction | None,
        cancel: Cancellation, output: OutputSink | None, then: Callable[[StepOutcome], None] | None,
    ) -> Callable[[], StepOutcome]:
        """What a job thread calls for a session's step: its ``run_step``, then ``then``."""
        run = functools.partial(session.run_step, step, job_id=job_id, host=host, output=output, cancel=cancel)
        return _and_then(run, then)

    async def open_session(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER,
    ) -> tuple[BackendSession, StepOutcome]:
        opening = functools.partial(self.runner.open_session, job, job_id, host, cancel=cancel, output=output)
        session, first = await self._on_thread(opening)
        return _ThreadedSession(self, session), first

    async def attach_session(self, key: str) -> tuple[BackendSession, int]:
        # On a job thread (the caller holds a slot): the runner may wait, bounded, for the
        # session's last holder to let go of it.
        session, step = await self._on_thread(functools.partial(self.runner.attach_session, key))
        return _ThreadedSession(self, session), step

    async def _on_thread(self, call: Callable[[], _T], *, transfer: bool = False) -> _T:
        return await (self._transfer_threads if transfer else self._threads).submit(call)

    async def close(self) -> None:
        # Threads first marked closed (a queued job does not run), then the runner's close ends
        # the running ones, then the threads are joined.
        self._threads.closed = self._transfer_threads.closed = True
        try:
            await asyncio.to_thread(self.runner.close)
        finally:  # joined even if the runner's close failed: no job thread outlives the backend
            for threads in (self._threads, self._transfer_threads):
                await threads.close()


class _ThreadedSession:
    """A runner's session: steps on the backend's job threads."""

    def __init__(self, backend: ThreadedBackend, session: SessionHandle) -> None:
        self._backend = backend
        self.session = session

    @property
    def job(self) -> CodeJob:
        return self.session.job

    @property
    def key(self) -> str | None:
        return self.session.key

    def __repr__(self) -> str:  # never the key
        return f"<session {self.session.id}>"

    def run_step(
        self, step: Step, job_id: str | None, host: HostFunction | None = None, output: OutputSink | None = None,
        cancel: Cancellation = NEVER, then: Callable[[StepOutcome], None] | None = None,
    ) -> asyncio.Future[StepOutcome]:
        return self._backend._threads.submit(self._backend._step_call(self.session, step, job_id, host, cancel, output, then))

    async def close(self) -> None:
        # Off the job threads: a close must not wait behind running steps.
        await asyncio.to_thread(self.session.close)

    async def detach(self) -> None:
        # Off the job threads too: a drain detaches every session at once, none waits for another.
        await asyncio.to_thread(self.session.detach)

    @property
    def hibernated(self) -> bool:
        return self.session.hibernated

    async def hibernate(self) -> float:
        return await self._backend._on_thread(functools.partial(self.session.hibernate))

    async def fork(self) -> tuple[BackendSession, float]:
        forked, fork_ms = await self._backend._on_thread(functools.partial(self.session.fork))
        return _ThreadedSession(self._backend, forked), fork_ms

    # Off the job threads: a chunk never waits behind another session's step, nor a step behind it.

    async def upload_chunk(self, path: str, offset: int, data: bytes, size: int) -> int:
        upload = functools.partial(self.session.upload_chunk, path, offset, data, size)
        return await self._backend._on_thread(upload, transfer=True)

    async def download_chunk(self, path: str, offset: int, length: int) -> FileChunk:
        download = functools.partial(self.session.download_chunk, path, offset, length)
        return await self._backend._on_thread(download, transfer=True)

    async def list_files(self, path: str) -> FileListing:
        return await self._backend._on_thread(functools.partial(self.session.list_files, path), transfer=True)


class LocalWorkerBackend(ThreadedBackend):
    """A :class:`Worker` in this process, owned by the pool."""

    runner: Worker

    @classmethod
    def start(
        cls, config: WorkerConfig, checkpoint: str, *, warm_timeout_s: float = WARM_TIMEOUT_S, metrics: Metrics | None = None
    ) -> LocalWorkerBackend:
        """Start a worker, check it can serve ``checkpoint`` and wait for its warm sandboxes.

        Blocking; raises :class:`ReadieError` (after cleaning up) when the
        worker cannot serve.
        """
        worker = Worker(config, metrics=metrics).start()
        try:
            pool = worker.warm.get(checkpoint)
            if pool is None:
                raise SandboxSetupError(_unusable(worker, checkpoint))
            if not pool.wait_until_full(warm_timeout_s):
                log.warning(
                    "warm sandboxes not ready in time; first jobs restore their own",
                    checkpoint=checkpoint,
                    ready=pool.ready_count,
                    target=pool.target,
                )
        except BaseException:
            worker.close()
            raise
        return cls(worker, config.slots)

    @property
    def worker(self) -> Worker:
        return self.runner

    # The worker in this process takes ``then`` itself and calls it as soon as the outcome is known:
    # the result line goes out before the worker's own bookkeeping (its log line and metrics, the
    # sandbox's retirement and the refill, an ended session's teardown), not after it.

    def _job_call(
        self, job: CodeJob, job_id: str | None, host: HostFunction | None, cancel: Cancellation,
        output: OutputSink | None, then: Callable[[JobOutcome], None] | None,
    ) -> Callable[[], JobOutcome]:
        def call() -> JobOutcome:
            return self.runner.run_job(job, job_id, host, cancel=cancel, output=output, then=_out_of_worker(then))

        return call

    def _step_call(
        self, session: SessionHandle, step: Step, job_id: str | None, host: HostFunction | None,
        cancel: Cancellation, output: OutputSink | None, then: Callable[[StepOutcome], None] | None,
    ) -> Callable[[], StepOutcome]:
        assert isinstance(session, SandboxSession)  # this worker's: open_session and attach_session made it

        def call() -> StepOutcome:
            return session.run_step(step, job_id=job_id, host=host, output=output, cancel=cancel, then=_out_of_worker(then))

        return call

    async def close(self) -> None:
        # The worker's close destroys warm sandboxes and sweeps the state dir:
        # a job still running loses its sandbox and ends with a worker error.
        await super().close()
        # A thread that was restoring when the sweep ran may have made a
        # sandbox after it; now that every thread is done, sweep again.
        await asyncio.to_thread(self.runner.close)


async def detach_logged(handle: BackendSession, name: str) -> None:
    """``handle.detach()``; what it raises has ended the session: logged, as nobody waits to be told."""
    try:
        await handle.detach()
    except Exception as exc:
        log.warning("a session could not be detached and has ended", session=name, error=f"{type(exc).__name__}: {exc}")


def _and_then(call: Callable[[], _T], then: Callable[[_T], None] | None) -> Callable[[], _T]:
    """``call``, and ``then`` with what it returned, on the same thread (``then`` must not raise)."""
    if then is None:
        return call

    def call_then() -> _T:
        answer = call()
        then(answer)
        return answer

    return call_then


def _out_of_worker(then: Callable[[_T], None] | None) -> Callable[[_T], None] | None:
    """``then``, run in the context of the thread calling now (the job thread's), not in the one the
    worker has when it calls it back: the pool's result log line must not carry the worker's bound
    log keys (its ``job_id``, a session's id)."""
    if then is None:
        return None
    context = contextvars.copy_context()
    return lambda outcome: context.run(then, outcome)


def _unusable(worker: Worker, checkpoint: str) -> str:
    problems = worker.checkpoints.problems if worker.checkpoints is not None else {}
    reason = problems.get(checkpoint) or problems.get("*") or "the worker did not load it"
    return f"checkpoint {checkpoint!r} cannot be used: {reason}"


# --------------------------------------------------------------------------- checkpoints


def manifest_path(given: str | Path) -> Path:
    """The manifest file for ``--checkpoints``: a manifest, or the directory holding one."""
    path = Path(given)
    return path / MANIFEST_NAME if path.is_dir() else path


def choose_checkpoint(path: Path, preload: Iterable[str]) -> tuple[Manifest, Checkpoint]:
    """The checkpoint whose pre-imports are exactly ``preload``; ReadieError when none is.

    Order does not matter (``pandas,numpy`` and ``numpy,pandas`` are one
    set): a checkpoint's preimport list is the order the capture imported
    them, which a job cannot observe.
    """
    if not path.exists():
        raise SandboxSetupError(
            f"no checkpoint manifest at {path}: build the checkpoints with `make capture`, "
            "or point --checkpoints (or READIE_CHECKPOINTS) at them"
        )
    manifest = read_manifest(path)
    wanted = frozenset(preload)
    for checkpoint in manifest.checkpoints.values():
        if frozenset(checkpoint.preimport) == wanted:
            return manifest, checkpoint
    have = (
        "; ".join(f"{c.name} [{', '.join(c.preimport)}]" for c in manifest.checkpoints.values())
        or "none"
    )
    listed = ", ".join(f'"{name}"' for name in sorted(wanted))
    raise SandboxSetupError(
        f"no checkpoint in {path} preloads exactly [{', '.join(sorted(wanted))}] "
        f"(have: {have}). To capture one, add a table to {CHECKPOINT_PLAN}:\n"
        f"    [checkpoints.NAME]\n    preimport = [{listed}]\n"
        "(packages that are not in the standard library go into [site].requirements too), "
        "then run `make capture`"
    )
