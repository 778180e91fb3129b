"""Sessions: one sandbox kept for a notebook's whole life, its ``__main__`` surviving between steps.

A session is opened with a :class:`~readie_worker.jobs.CodeJob` that is both
its setup and its first step: grants, package dirs, network, environment and
limits are fixed then, like any job's (mount sources are fixed at restore, so
a session with grants restores its own sandbox; one without takes a warm
one). Each step is ``runner_call(step, links, session=True)``, which the
in-sandbox runner executes in the sandbox's persistent ``__main__``.

What a step's end means for the session:

* the code finished, or raised (a ``NameError`` is a notebook cell's
  failure): the session lives on, ``__main__`` intact, the sandbox READY;
* it timed out, the sandbox crashed or answered garbage (PoolWorkerError,
  MemoryError from the cgroup backstop), the code called ``sys.exit``
  (``system_exit`` in its result), or the runner could not set the step up
  (SandboxSetupError): the session ends and its sandbox is destroyed. The
  :class:`StepOutcome` says so with ``session_ended``.

Slots: a session holds one of the worker's slots only while a step runs
(the first step's slot covers making its sandbox ready). An idle session
holds a sandbox (memory) but no slot, so the number of sessions a worker
keeps is bounded by its own ``max_sessions``, not ``slots``. Idle reaping
is the caller's business (the pool's ``session_idle``); the worker destroys
every session's sandbox when it closes or drains.

Steps run one at a time: a step asked for while another runs is a
RequestError, not a queue (the pool engine queues steps in order).

Hibernation (``hibernation.py``, decision 0022): an idle session may be
checkpointed to an image on disk and its sandbox ended, which frees its
memory; its next step restores it first (the outcome's ``resumed_ms``),
with its grants opened again under the rules of a new job. A fork is a
hibernation whose image a second session shares: both resume from it on
their next steps, and go on independently. Both take a worker slot while
they run, as a step does.
"""

from __future__ import annotations

import dataclasses
import functools
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import ParamSpec, TypeVar

import structlog

from ._states import SandboxState, SessionState, check_transition
from readie_executor.jobs import EXIT_NOT_STARTED

from readie_protocol.cancel import NEVER, Cancellation
from .errors import ErrorType, PoolWorkerError, RequestError, SandboxSetupError, bound_ids, for_client
from .hibernation import SessionImages
from . import _workspace as workspace
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, Step, run_in_sandbox
from readie_policy.jobs import StepOutcome
from readie_protocol.workspace import FileChunk, FileListing
from .runsc import RunscError
from .sandbox import Sandbox

__all__ = ["EXIT_NOT_STARTED", "SandboxSession", "StepOutcome"]

log = structlog.get_logger("readie.worker")

# How long a hibernation (or fork) waits for a worker slot before it is refused and the
# session goes on: well inside what a caller through a router waits for its answer.
HIBERNATE_SLOT_WAIT_S = 20.0
# Session ids appear in logs next to sandbox ids; the same width.
SESSION_ID_BYTES = 6


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _logged_under_its_id(method: Callable[_P, _R]) -> Callable[_P, _R]:
    """``method`` of a session, run with the session's id (and a step's ``job_id``) in the log
    context: what fails under it is logged next to them, and a client's error names them."""

    @functools.wraps(method)
    def bound(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        session = args[0]
        assert isinstance(session, SandboxSession)
        job_id = kwargs.get("job_id")
        with bound_ids(session=session.id, job_id=job_id if isinstance(job_id, str) else None):
            return method(*args, **kwargs)

    return bound


#: Restores a hibernated session's image under the memory limit it had (None: the backstop):
#: its sandbox, and the links its re-opened grants need.
Restorer = Callable[[CodeJob, Path, "int | None"], "tuple[Sandbox, tuple[Mapping[str, object], ...]]"]


class SandboxSession:
    """A worker session: see the module docstring. Made by ``Worker.open_session``."""

    def __init__(
        self,
        job: CodeJob,
        sandbox: Sandbox | None,
        links: tuple[Mapping[str, object], ...],
        *,
        slot: Callable[..., AbstractContextManager[None]],  # (cancel, wait_s=None): the worker's _slot
        forget: Callable[[SandboxSession], None] = lambda session: None,
        observe: Callable[[str, JobOutcome], None] = lambda checkpoint, outcome: None,
        images: SessionImages | None = None,
        restore: Restorer | None = None,
        observe_image: Callable[[str, float], None] = lambda operation, seconds: None,
        image: Path | None = None,
        fork: Callable[[SandboxSession, Cancellation], tuple[SandboxSession, float]] | None = None,
        memory_limit: int | None = None,
    ) -> None:
        self.id = "ws-" + secrets.token_hex(SESSION_ID_BYTES)
        self.job = job  # the setup; its code was the first step's
        self._sandbox = sandbox
        self._links = links
        self._slot = slot
        self._forget = forget
        self._observe = observe  # every step's outcome (the worker's metrics)
        # Hibernation: None where the worker cannot checkpoint (unisolated, or a networked session).
        self._images = images
        self._restore = restore
        self._observe_image = observe_image  # (hibernate|resume|fork, seconds): the worker's metrics
        self._image = image  # while HIBERNATED
        self._fork = fork  # the worker's fork_session: a fork is a session of the worker's
        # The cgroup limit its job's 'memory' set at open, re-applied as it is at every resume:
        # measured again from a restored sandbox's usage, it would grow by 'memory' each time.
        self.memory_limit = sandbox.memory_limit_bytes if sandbox is not None else memory_limit
        self._lock = threading.Lock()  # state, steps and the sandbox's state move together
        if image is not None:
            self.state = SessionState.HIBERNATED  # a fork: it resumes at its first step
        else:
            self.state = SessionState.OPENING if sandbox is not None else SessionState.ENDED
        self.steps = 0
        if sandbox is not None and sandbox.state is SandboxState.READY:
            sandbox.move(SandboxState.BUSY)  # a restored sandbox; a warm one comes BUSY from its warm set

    @property
    def ended(self) -> bool:
        return self.state is SessionState.ENDED

    @property
    def sandbox_id(self) -> str | None:
        return None if self._sandbox is None else self._sandbox.id

    @property
    def hibernated(self) -> bool:
        return self.state is SessionState.HIBERNATED

    @_logged_under_its_id
    def run_step(
        self,
        step: Step,
        *,
        job_id: str | None = None,
        host: HostFunction | None = None,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> StepOutcome:
        """Run one step in the session's ``__main__``; ``timeout_ms`` and ``max_output`` default to the session's.

        ``host`` answers the step's calls to the functions the session declared
        when it opened. Raises RequestError when the session has ended or a
        step is running; a step that raises rather than returning an outcome
        (declared functions and no ``host``) ends the session.
        """
        job = self.job.step(step)
        with self._lock:
            if self.state is SessionState.ENDED:
                raise RequestError(f"session {self.id} has ended", field="session")
            self._start_running()
        started = time.monotonic()
        try:
            with self._slot(cancel):
                queue_us = _since(started)
                resumed_ms = self._resume() if self._sandbox is None else None
                if isinstance(resumed_ms, JobOutcome):  # it could not: the session has ended
                    return self._ended_by(resumed_ms, job, job_id, queue_us)
                step_outcome = self.run_in_slot(
                    job, job_id=job_id, queue_us=queue_us, host=host, cancel=cancel, output=output
                )
                return dataclasses.replace(step_outcome, resumed_ms=resumed_ms)
        except BaseException:
            # The slot was refused (a draining worker) or a bug: nothing is known
            # about the sandbox's state, so it is not trusted with another step.
            self.close()
            raise

    @_logged_under_its_id
    def run_in_slot(
        self,
        step: CodeJob,
        *,
        job_id: str | None,
        queue_us: int,
        host: HostFunction | None = None,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> StepOutcome:
        """Run ``step`` now; the caller holds a worker slot. ``Worker.open_session`` calls it
        for the first step, :meth:`run_step` for the others."""
        with self._lock:
            if self.state is SessionState.OPENING:
                self._move(SessionState.RUNNING)
            if self.state is not SessionState.RUNNING or self._sandbox is None:
                raise RequestError(f"session {self.id} has ended", field="session")
            sandbox = self._sandbox
        # Raises only for the caller's mistakes (functions declared, no host); the
        # caller ends the session then, as after anything unexpected.
        outcome, ends = call_step(sandbox, step, self._links, host, cancel, output)
        self._observe(step.checkpoint, outcome)
        doomed = None
        with self._lock:
            self.steps += 1
            number = self.steps
            if self.state is SessionState.ENDED:  # closed while the step ran
                ends = True
            elif ends:
                self._move(SessionState.ENDED)
                doomed = sandbox
            else:
                sandbox.move(SandboxState.READY)
                self._move(SessionState.IDLE)
        if doomed is not None:
            doomed.destroy()
            self._forget(self)
        # One line per step, as per job: identifiers, outcome and timing, never output.
        log.info(
            "job",
            job_id=job_id,
            session=self.id,
            step=number,
            session_ended=ends,
            checkpoint=step.checkpoint,
            **outcome.log_fields(),
            queue_us=queue_us,
        )
        return StepOutcome(outcome, number, ends)

    @_logged_under_its_id
    def hibernate(self, cancel: Cancellation = NEVER) -> float:
        """Checkpoint the idle session to disk and end its sandbox; the milliseconds it took (0 if it was).

        Raises RequestError when the session has ended, a step runs, or it
        cannot hibernate (networked, unisolated); SandboxSetupError when the
        worker's image bounds are reached (the session stays as it was);
        PoolWorkerError when its sandbox would not hibernate (which ends it).
        """
        with self._lock:
            if self.state is SessionState.HIBERNATED:
                return 0.0
            self._check_can_hibernate()
            self._start_running()
            sandbox = self._sandbox
            assert sandbox is not None and self._images is not None
        started = time.monotonic()
        image = None
        try:
            # Bounded: a hibernation the pool's idle timer asked for must not wait behind an
            # hour-long job and then be given up by its caller, which would end the session.
            with self._slot(cancel, HIBERNATE_SLOT_WAIT_S):
                image = self._images.reserve(sandbox.launcher.memory_usage(sandbox.dir) or 0)
                size = self._save(sandbox, image)
        except BaseException:
            if image is None:  # refused before the sandbox was touched: the session goes on as it was
                with self._lock:
                    if self.state is SessionState.RUNNING:
                        sandbox.move(SandboxState.READY)
                        self._move(SessionState.IDLE)
            raise
        seconds = time.monotonic() - started
        self._observe_image("hibernate", seconds)
        log.info("session hibernated", session=self.id, image_bytes=size, hibernate_ms=round(seconds * 1000, 1))
        return seconds * 1000

    def fork(self, cancel: Cancellation = NEVER) -> tuple[SandboxSession, float]:
        """A new session of this worker's with this one's state now (``Worker.fork_session``)."""
        if self._fork is None:
            with self._lock:
                self._check_can_hibernate()
        assert self._fork is not None
        return self._fork(self, cancel)

    @_logged_under_its_id
    def fork_image(self, cancel: Cancellation = NEVER) -> tuple[Path, float]:
        """Hibernate (if not already) and give a second image of this session's state, for a fork.

        Raises as :meth:`hibernate`; the caller makes the fork's session with it.
        """
        started = time.monotonic()
        self.hibernate(cancel)
        assert self._images is not None
        with self._lock:
            if self.state is not SessionState.HIBERNATED or self._image is None:
                raise RequestError(f"session {self.id} has ended or runs a step; it cannot fork now", field="session")
            copy = self._images.share(self._image)
        seconds = time.monotonic() - started
        self._observe_image("fork", seconds)
        return copy, seconds * 1000

    # Files in the session's workspace (decision 31): each call holds the session as a step does.

    @_logged_under_its_id
    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel: Cancellation = NEVER) -> int:
        """Write ``data`` at ``offset`` of the ``size``-byte upload of ``path``; the bytes it holds now
        (``_workspace.upload_chunk``: what is refused, and why)."""
        return self._with_workspace(lambda sandbox: workspace.upload_chunk(sandbox, self.job, path, offset, data, size, cancel), cancel)

    @_logged_under_its_id
    def download_chunk(self, path: str, offset: int, length: int, *, cancel: Cancellation = NEVER) -> FileChunk:
        """At most ``length`` bytes of ``path`` from ``offset`` (``_workspace.download_chunk``)."""
        return self._with_workspace(lambda sandbox: workspace.download_chunk(sandbox, self.job, path, offset, length, cancel), cancel)

    @_logged_under_its_id
    def list_files(self, path: str, *, cancel: Cancellation = NEVER) -> FileListing:
        """The entries of directory ``path`` of the workspace (``_workspace.list_files``)."""
        return self._with_workspace(lambda sandbox: workspace.list_files(sandbox, self.job, path, cancel), cancel)

    def _with_workspace(self, operation: Callable[[Sandbox], _R], cancel: Cancellation) -> _R:
        """``operation`` on the session's sandbox, held as a step holds it (refused while a step
        runs; a hibernated session resumed first, in a worker slot). No slot otherwise: moving a
        chunk is not a job, and must not wait behind other sessions' steps.

        A RequestError leaves the session as it was; anything else (the sandbox broke or answered
        out of bounds, a resume failed) ends it: the sandbox is not trusted again.
        """
        with self._lock:
            self._start_running()
        try:
            if self._sandbox is None:
                with self._slot(cancel):
                    resumed = self._resume()
                if isinstance(resumed, JobOutcome):  # it could not, and the session has ended
                    raise SandboxSetupError(resumed.error.message if resumed.error else "the session could not resume")
            assert self._sandbox is not None
            result = operation(self._sandbox)
        except RequestError:
            self._idle_again()
            raise
        except BaseException:
            self.close()
            raise
        self._idle_again()
        return result

    def _idle_again(self) -> None:
        with self._lock:
            if self.state is not SessionState.RUNNING:  # closed meanwhile
                return
            if self._sandbox is None:
                self._move(SessionState.HIBERNATED)
            else:
                self._sandbox.move(SandboxState.READY)
                self._move(SessionState.IDLE)

    def close(self) -> None:
        """End the session and destroy its sandbox (or remove its image); a step still running ends
        with a worker error. Calling it again does nothing."""
        with self._lock:
            if self.state is SessionState.ENDED:
                return
            self._move(SessionState.ENDED)
            sandbox, image, self._image = self._sandbox, self._image, None
        try:
            if sandbox is not None:
                sandbox.destroy()
        finally:
            if image is not None and self._images is not None:
                self._images.remove(image)
            self._forget(self)

    def _save(self, sandbox: Sandbox, image: Path) -> int:
        """Checkpoint ``sandbox`` into ``image`` and end it; the image's bytes. Ends the session on failure."""
        assert self._images is not None
        try:
            sandbox.checkpoint(image)
            size = self._images.written(image)
        except (PoolWorkerError, RunscError, OSError) as exc:
            self._images.remove(image)
            self.close()  # a sandbox asked to hibernate is not trusted with another step
            raise PoolWorkerError(f"session {self.id} could not hibernate and has ended: {for_client(exc)}") from None
        finally:
            sandbox.destroy()
        with self._lock:
            ended = self.state is SessionState.ENDED  # closed while it hibernated
            if not ended:
                self._sandbox, self._links, self._image = None, (), image
                self._move(SessionState.HIBERNATED)
        if ended:
            self._images.remove(image)
            raise PoolWorkerError(f"session {self.id} was closed while it hibernated")
        return size

    def _check_can_hibernate(self) -> None:
        if self.state is SessionState.ENDED:
            raise RequestError(f"session {self.id} has ended", field="session")
        if self.state is not SessionState.IDLE:
            raise RequestError(f"a step of session {self.id} is running; it can hibernate between steps", field="session")
        if self._images is None or self._restore is None:
            raise RequestError(
                "this session cannot hibernate or fork: it has the network (a cold-started sandbox in the "
                "worker's namespace), or the worker runs without gVisor", field="session",
            )

    def _start_running(self) -> None:
        """IDLE or HIBERNATED to RUNNING, for a step or a hibernation; the caller holds the lock."""
        if self.state is SessionState.ENDED:
            raise RequestError(f"session {self.id} has ended", field="session")
        if self.state not in (SessionState.IDLE, SessionState.HIBERNATED):
            raise RequestError(f"a step of session {self.id} is running; steps run one at a time", field="session")
        self._move(SessionState.RUNNING)
        if self._sandbox is not None:
            self._sandbox.move(SandboxState.BUSY)

    def _resume(self) -> float | JobOutcome:
        """Restore the hibernated session (the caller holds a slot): milliseconds, or why not."""
        assert self._image is not None and self._restore is not None and self._images is not None
        started = time.monotonic()
        try:
            sandbox, links = self._restore(self.job, self._image, self.memory_limit)
        except (RequestError, SandboxSetupError) as exc:  # a grant gone, a restore failed
            self.close()
            return JobOutcome.failure(ErrorType.SANDBOX_SETUP, f"the hibernated session could not resume: {exc}", _since(started), "gvisor")
        with self._lock:
            ended = self.state is SessionState.ENDED
            if not ended:
                image, self._image = self._image, None
                self._sandbox, self._links = sandbox, links
                sandbox.move(SandboxState.BUSY)
        if ended:  # closed while it resumed
            sandbox.destroy()
            raise PoolWorkerError(f"session {self.id} was closed while it resumed")
        self._images.remove(image)
        seconds = time.monotonic() - started
        self._observe_image("resume", seconds)
        return seconds * 1000

    def _ended_by(self, failed: JobOutcome, job: CodeJob, job_id: str | None, queue_us: int) -> StepOutcome:
        with self._lock:
            self.steps += 1
            number = self.steps
        self._observe(job.checkpoint, failed)
        log.info("job", job_id=job_id, session=self.id, step=number, session_ended=True,
                 checkpoint=job.checkpoint, **failed.log_fields(), queue_us=queue_us)
        return StepOutcome(failed, number, True)

    def _move(self, target: SessionState) -> None:
        self.state = check_transition(self.state, target)


def call_step(
    sandbox: Sandbox,
    job: CodeJob,
    links: tuple[Mapping[str, object], ...],
    host: HostFunction | None = None,
    cancel: Cancellation = NEVER,
    output: OutputSink | None = None,
) -> tuple[JobOutcome, bool]:
    """Run one session step in ``sandbox``: its outcome, and whether it ends the session.

    A step ends the session when it did not end on its own (timeout, crash,
    an invalid answer: no exit status), when its code raised SystemExit, or
    when the runner could not set it up. The sandbox is destroyed by the
    session's end, not here (``run_in_sandbox`` destroys it at a timeout).
    """
    outcome = run_in_sandbox(sandbox, job, links, host, session=True, cancel=cancel, output=output)
    setup_failed = (
        outcome.exit == EXIT_NOT_STARTED
        and outcome.error is not None
        and outcome.error.type == ErrorType.SANDBOX_SETUP
    )
    return outcome, outcome.exit is None or outcome.system_exit or setup_failed


def _since(started: float) -> int:
    return int((time.monotonic() - started) * 1_000_000)
