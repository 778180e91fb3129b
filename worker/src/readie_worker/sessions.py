"""Sessions: one sandbox kept for a notebook's whole life, its ``__main__`` surviving between steps.

A session is opened with a :class:`~readie_worker.jobs.CodeJob` that is both its setup and its
first step: grants, package dirs, network, environment and limits are fixed then, like any job's
(a session takes a warm sandbox, its grants mounted once it is taken, unless it needs packages or
the network: ``Worker._acquire``). Each step is ``runner_call(step, links, session=True)``, which
the in-sandbox runner executes in the sandbox's persistent ``__main__``.

What a step's end means for the session:

* the code finished, or raised (a ``NameError`` is a notebook cell's failure): the session lives
  on, ``__main__`` intact, the sandbox READY;
* it timed out, the sandbox crashed or answered garbage (PoolWorkerError, MemoryError from the
  cgroup backstop), the code called ``sys.exit`` (``system_exit`` in its result), or the runner
  could not set the step up (SandboxSetupError): the session ends and its sandbox is destroyed.
  The :class:`StepOutcome` says so with ``session_ended``.

Slots: a session holds one of the worker's slots only while a step runs (the first step's slot
covers making its sandbox ready). An idle session holds a sandbox (memory) but no slot, so the
number of sessions a worker keeps is bounded by its own ``max_sessions``, not ``slots``. Idle
reaping is the caller's business (the pool's ``session_idle``); the worker destroys every
session's sandbox when it closes or drains, and pauses one idle long and quiet (``_idle_pause``).

Steps run one at a time: a step asked for while another runs is a RequestError, not a queue (the
pool engine queues steps in order).

Hibernation (``hibernation.py``, decision 0022): an idle session is checkpointed to disk and its
sandbox ended, freeing its memory; its next step restores it (``resumed_ms``), its grants opened
again under a new job's rules. A fork is a hibernation whose image a second session shares. Both
take a worker slot, as a step does.

The session store (decision 32): a session that can hibernate has a ``key`` and a store entry,
leased by this worker while it holds it. ``detach`` hibernates it and lets go, for
``Worker.attach_session`` (a failed write keeps what the store held); ``close`` removes the entry;
a holder whose lease another took ends its copy. With ``checkpoint_steps`` each step's state is
written there after its outcome is returned (``_step_checkpoint.py``).
"""

from __future__ import annotations

import secrets
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TypeVar

import structlog
from readie_executor.jobs import EXIT_NOT_STARTED
from readie_policy.jobs import StepOutcome
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import NotStarted

from ._idle_pause import IdleClock
from ._session_files import SessionFiles
from ._states import SandboxState, SessionState, check_transition
from ._step_checkpoint import StepCheckpoints
from .errors import ErrorType, PoolWorkerError, RequestError, SandboxSetupError, for_client, logged_under_its_id
from .hibernation import SessionImages
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, Step, _since, answered, call_step
from .paths import remove_tree
from .runsc import RunscError
from .sandbox import Sandbox

__all__ = ["EXIT_NOT_STARTED", "SandboxSession", "StepOutcome"]

log = structlog.get_logger("readie.worker")

# How long a hibernation (or fork) waits for a worker slot before it is refused and the session
# goes on: well inside what a caller through a router waits for its answer.
HIBERNATE_SLOT_WAIT_S = 20.0
# Session ids appear in logs next to sandbox ids; the same width.
SESSION_ID_BYTES = 6

#: Restores a hibernated session's image under the memory limit it had (None: the backstop):
#: its sandbox, and the links its re-opened grants need.
Restorer = Callable[[CodeJob, Path, "int | None"], "tuple[Sandbox, tuple[Mapping[str, object], ...]]"]

_R = TypeVar("_R")


class SandboxSession(SessionFiles):
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
        key: str | None = None,
        stored: bool = False,
        prepared: Path | None = None,
        fork: Callable[[SandboxSession, Cancellation], tuple[SandboxSession, float]] | None = None,
        memory_limit: int | None = None,
        steps: int = 0,
        checkpoint_steps: bool = False,
        observe_checkpoint: Callable[[str, float], None] = lambda result, seconds: None,
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
        # Its name in the session store (None: it cannot hibernate); while HIBERNATED the store
        # holds its image. ``prepared``: an attached session's image, verified and copied into
        # the worker's own dir at attach, which its first resume restores from.
        self.key = key if images is not None else None
        self._prepared = prepared
        self._fork = fork  # the worker's fork_session: a fork is a session of the worker's
        # The cgroup limit its job's 'memory' set at open, re-applied as it is at every resume:
        # measured again from a restored sandbox's usage, it would grow by 'memory' each time.
        self.memory_limit = sandbox.memory_limit_bytes if sandbox is not None else memory_limit
        self._lock = threading.Lock()  # state, steps and the sandbox's state move together
        self.idle_clock = IdleClock()  # an idle session waits paused (_idle_pause)
        if stored:
            self.state = SessionState.HIBERNATED  # a fork or an attached session: it resumes at its first step
        else:
            self.state = SessionState.OPENING if sandbox is not None else SessionState.ENDED
        self.steps = steps
        self.detached = False  # ended by detach: its state waits in the store (a drain's handed_over)
        self._lease_lost = False  # another holder has the entry now: this copy leaves it alone
        self.lease: str | None = None  # the store lease's token (set by its keeper): what it writes and removes by
        # Set by a take-over attach: the step the stored state is from, which the next resume reports.
        self.resumed_from_step: int | None = None
        self._checkpoints = StepCheckpoints(self.id, observe_checkpoint) if checkpoint_steps and self.key else None
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

    @logged_under_its_id
    def run_step(
        self,
        step: Step,
        *,
        job_id: str | None = None,
        host: HostFunction | None = None,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
        then: Callable[[StepOutcome], None] | None = None,
    ) -> StepOutcome:
        """Run one step in the session's ``__main__``; ``timeout_ms`` and ``max_output`` default to the session's.

        ``host`` answers the step's calls to the functions the session declared when it opened.
        Raises RequestError when the session has ended or a step is running; a step that raises
        rather than returning an outcome (declared functions and no ``host``) ends the session.
        ``then``: as ``Worker.run_job``'s, once the session's state is settled."""
        job = self.job.step(step)
        self.wait_for_checkpoint()
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
                    return answered(then, self._ended_by(resumed_ms, job, job_id, queue_us))
                return self.run_in_slot(job, job_id=job_id, queue_us=queue_us, host=host, cancel=cancel,
                                        output=output, then=then, resumed_ms=resumed_ms)
        except NotStarted:
            # Refused before anything ran (a draining worker): kept as it was, for its stream to hand over.
            self._idle_again()
            raise
        except BaseException:
            # A bug: nothing is known about the sandbox's state, so it is not trusted with another step.
            self.close()
            raise

    @logged_under_its_id
    def run_in_slot(
        self,
        step: CodeJob,
        *,
        job_id: str | None,
        queue_us: int,
        host: HostFunction | None = None,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
        then: Callable[[StepOutcome], None] | None = None,
        resumed_ms: float | None = None,
    ) -> StepOutcome:
        """Run ``step`` now; the caller holds a worker slot. ``Worker.open_session`` calls it for the
        first step, :meth:`run_step` for the others (``resumed_ms``: it resumed the session first)."""
        with self._lock:
            if self.state is SessionState.OPENING:
                self._move(SessionState.RUNNING)
            if self.state is not SessionState.RUNNING or self._sandbox is None:
                raise RequestError(f"session {self.id} has ended", field="session")
            sandbox = self._sandbox
        # Raises only for the caller's mistakes (functions declared, no host); the
        # caller ends the session then, as after anything unexpected.
        outcome, ends = call_step(sandbox, step, self._links, host, cancel, output)
        doomed = None
        with self._lock:
            self.steps += 1
            number = self.steps
            if self.state is SessionState.ENDED:  # closed while the step ran
                ends = True
            elif ends:
                self._move(SessionState.ENDED)
                doomed = sandbox
            elif self._checkpoints is None:
                sandbox.move(SandboxState.READY)
                self._move(SessionState.IDLE)
            else:  # busy (RUNNING, the sandbox BUSY) until its checkpoint is written
                assert self._images is not None and self.key is not None
                self._checkpoints.start(self._images, self.key, self.lease, self.job, self.memory_limit, sandbox,
                                        number, self._idle_again)
            answer, self.resumed_from_step = StepOutcome(outcome, number, ends, resumed_ms, self.resumed_from_step), None
        if doomed is None:  # settled, the session going on: its caller may answer, and send the next step
            answered(then, answer)
        self._observe(step.checkpoint, outcome)
        if doomed is not None:
            try:
                doomed.destroy()
            finally:  # stopped as its caller went away (a router killed): a keyed session keeps its last state
                self._let_go(remove=not (cancel.cancelled and self.key is not None))
        # One line per step, as per job: identifiers, outcome and timing, never output.
        log.info("job", job_id=job_id, session=self.id, step=number, session_ended=ends,
                 checkpoint=step.checkpoint, **outcome.log_fields(), queue_us=queue_us)
        return answer if doomed is None else answered(then, answer)  # an ended one: after its teardown

    def wait_for_checkpoint(self) -> bool:
        """Until the last step's checkpoint is written (bounded; busy till then); whether none runs now."""
        return self._checkpoints is None or self._checkpoints.wait()

    @logged_under_its_id
    def hibernate(self, cancel: Cancellation = NEVER, *, draining: bool = False) -> float:
        """Checkpoint the idle session to disk and end its sandbox; the milliseconds it took (0 if it was).

        Raises RequestError when the session has ended, a step runs, or it
        cannot hibernate (networked, unisolated); SandboxSetupError when the
        worker's image bounds are reached (the session stays as it was);
        PoolWorkerError when its sandbox would not hibernate (which ends it).
        """
        self.wait_for_checkpoint()
        with self._lock:
            if self.state is SessionState.HIBERNATED:
                return 0.0
            self._check_can_hibernate()
            self._start_running()
            sandbox = self._sandbox
            assert sandbox is not None and self._images is not None
        started = time.monotonic()
        touched = False
        try:
            # Bounded: a hibernation the pool's idle timer asked for must not wait behind an
            # hour-long job and then be given up by its caller, which would end the session.
            with self._slot(cancel, HIBERNATE_SLOT_WAIT_S, draining=draining):
                self._images.check_room(sandbox.launcher.memory_usage(sandbox.dir) or 0)
                touched = True
                size = self._save(sandbox)
        except BaseException:
            if not touched:  # refused before the sandbox was touched: the session goes on as it was
                self._idle_again()
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

    @logged_under_its_id
    def fork_into(self, fork_key: str, cancel: Cancellation = NEVER) -> float:
        """Hibernate (if not already) and store this state again under ``fork_key`` (files shared),
        for the fork's session; the milliseconds it took. Raises as :meth:`hibernate`."""
        started = time.monotonic()
        self.hibernate(cancel)
        assert self._images is not None and self.key is not None
        with self._lock:
            if self.state is not SessionState.HIBERNATED:
                raise RequestError(f"session {self.id} has ended or runs a step; it cannot fork now", field="session")
            self._images.fork(self.key, fork_key, 0)  # a fork numbers its own steps from 0
        seconds = time.monotonic() - started
        self._observe_image("fork", seconds)
        return seconds * 1000

    @logged_under_its_id
    def detach(self, cancel: Cancellation = NEVER, *, draining: bool = False) -> None:
        """Hibernate into the store, let go of the lease and end this handle (``detached``), for
        ``Worker.attach_session`` (decision 32); a session without a key is closed. Raises as
        :meth:`hibernate`, and what it raises has ended this handle (the entry kept as it was,
        :meth:`release`). ``draining``: a drain's."""
        if self.key is None:
            self.close()
            return
        try:
            self.hibernate(cancel, draining=draining)
        except BaseException:
            # A failed write never costs what the store holds (a per-step checkpoint): an attach continues it.
            self.release()
            raise
        self.detached = True
        self._end(remove=False)

    def release(self) -> None:
        """End this handle and let go of the lease, the store entry's last good generation kept."""
        self._end(remove=False)

    def lease_taken(self) -> None:
        """Another holder took this session's lease: end this copy without touching the store."""
        self._lease_lost = True
        self._end(remove=False)

    def pause_if_idle(self, after_s: float) -> bool:
        """Pause its sandbox if it has idled ``after_s`` and quiet (``_idle_pause``); whether it did."""
        return self.idle_clock.pause_if_quiet(
            self._lock, lambda: self._sandbox if self.state is SessionState.IDLE else None, after_s)

    def _with_workspace(self, operation: Callable[[Sandbox], _R], cancel: Cancellation) -> _R:
        """``operation`` on the session's sandbox, held as a step holds it (refused while a step
        runs; a hibernated session resumed first, in a worker slot). No slot otherwise: moving a
        chunk is not a job, and must not wait behind other sessions' steps.

        A RequestError leaves the session as it was; anything else (the sandbox broke or answered
        out of bounds, a resume failed) ends it: the sandbox is not trusted again.
        """
        self.wait_for_checkpoint()
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
        """End the session for good: its sandbox destroyed, its store entry removed; a step still
        running ends with a worker error. Calling it again does nothing."""
        self._end(remove=True)

    def _end(self, *, remove: bool) -> None:
        """End this handle; ``remove``: the session too, else its entry waits for another holder. A
        per-step checkpoint that outlives the wait tears the session down when it ends: its runsc
        commands and this destroy never race, nor a removal its publish."""
        self.wait_for_checkpoint()
        with self._lock:
            if self.state is SessionState.ENDED:
                return
            self._move(SessionState.ENDED)
            sandbox, prepared, self._prepared = self._sandbox, self._prepared, None

        def tear_down() -> None:
            try:
                if sandbox is not None:
                    sandbox.destroy()
            finally:
                if prepared is not None:
                    remove_tree(prepared)
                self._let_go(remove=remove)

        if self._checkpoints is None:
            tear_down()
        else:
            self._checkpoints.then(tear_down)

    def _let_go(self, *, remove: bool) -> None:
        """Remove the store entry (a close) or keep it (``SessionImages.let_go``); give up the place, whatever."""
        try:
            if self._images is not None and self.key is not None and not self._lease_lost:
                self._images.let_go(self.key, self.lease, keep=not remove)
        finally:
            self._forget(self)

    def _save(self, sandbox: Sandbox) -> int:
        """Checkpoint ``sandbox`` into the store and end it; the image's bytes. Ends the session on failure."""
        assert self._images is not None and self.key is not None
        try:
            size = self._images.write(self.key, sandbox, job=self.job, memory_limit=self.memory_limit, step=self.steps, lease=self.lease)
        except (PoolWorkerError, RunscError, SandboxSetupError, OSError) as exc:
            # Not trusted with another step; what the store held before (a per-step checkpoint) is kept.
            self.release()
            raise PoolWorkerError(f"session {self.id} could not hibernate and has ended: {for_client(exc)}") from None
        finally:
            sandbox.destroy()
        with self._lock:
            ended = self.state is SessionState.ENDED  # closed while it hibernated
            if not ended:
                self._sandbox, self._links = None, ()
                self._move(SessionState.HIBERNATED)
        if ended:  # closed while it hibernated: the write published before close removed the entry, or not at all
            raise PoolWorkerError(f"session {self.id} was closed while it hibernated")
        return size

    def _check_can_hibernate(self) -> None:
        if self.state is SessionState.ENDED:
            raise RequestError(f"session {self.id} has ended", field="session")
        if self.state is not SessionState.IDLE:
            raise RequestError(f"a step of session {self.id} is running; it can hibernate between steps", field="session")
        if self._images is None or self._restore is None:
            raise RequestError(
                "this session cannot hibernate or fork: it has the network (not stored yet), "
                "or the worker runs without gVisor", field="session",
            )

    def _start_running(self) -> None:
        """IDLE or HIBERNATED to RUNNING, for a step or a hibernation; the caller holds the lock."""
        if self.state is SessionState.ENDED:
            raise RequestError(f"session {self.id} has ended", field="session")
        if self.state not in (SessionState.IDLE, SessionState.HIBERNATED):
            raise RequestError(f"a step of session {self.id} is running; steps run one at a time", field="session")
        self._move(SessionState.RUNNING)
        self.idle_clock.held(self._sandbox)
        if self._sandbox is not None:
            self._sandbox.move(SandboxState.BUSY)

    def _resume(self) -> float | JobOutcome:
        """Restore the hibernated session (the caller holds a slot): milliseconds, or why not."""
        assert self.key is not None and self._restore is not None and self._images is not None
        started = time.monotonic()
        try:
            prepared, self._prepared = self._prepared, None  # the image an attach copied here, else read now
            sandbox, links = self._images.restore(self.key, prepared, lambda image: self._restore(self.job, image, self.memory_limit))
        except (RequestError, SandboxSetupError) as exc:  # a grant gone, a restore failed, the image refused
            self.close()
            return JobOutcome.failure(ErrorType.SANDBOX_SETUP, f"the hibernated session could not resume: {exc}", _since(started), "gvisor")
        with self._lock:
            ended = self.state is SessionState.ENDED
            if not ended:
                self._sandbox, self._links = sandbox, links
                sandbox.move(SandboxState.BUSY)
        if ended:  # closed while it resumed
            sandbox.destroy()
            raise PoolWorkerError(f"session {self.id} was closed while it resumed")
        # Live again: the stored state is older than the next step's, and is not kept as if it were;
        # unless each step is checkpointed: then it is what a crash in this step falls back to.
        if self._checkpoints is None:
            self._images.store.drop_image(self.key, lease=self.lease)
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
        if target is SessionState.IDLE:
            self.idle_clock.idle()
