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
"""

from __future__ import annotations

import dataclasses
import secrets
import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass

import structlog

from ._states import SandboxState, SessionState, check_transition
from readie_executor.jobs import EXIT_NOT_STARTED

from .cancel import NEVER, Cancellation
from .errors import ErrorType, RequestError
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, Step, run_in_sandbox
from .sandbox import Sandbox

__all__ = ["EXIT_NOT_STARTED", "SandboxSession", "StepOutcome"]

log = structlog.get_logger("readie.worker")

# Session ids appear in logs next to sandbox ids; the same width.
SESSION_ID_BYTES = 6


@dataclass(frozen=True, slots=True)
class StepOutcome:
    """One step's outcome, its number in the session (1 opens it), and whether it ended the session."""

    outcome: JobOutcome
    step: int
    session_ended: bool


class SandboxSession:
    """A worker session: see the module docstring. Made by ``Worker.open_session``."""

    def __init__(
        self,
        job: CodeJob,
        sandbox: Sandbox | None,
        links: tuple[Mapping[str, object], ...],
        *,
        slot: Callable[[Cancellation], AbstractContextManager[None]],
        forget: Callable[[SandboxSession], None] = lambda session: None,
        observe: Callable[[str, JobOutcome], None] = lambda checkpoint, outcome: None,
    ) -> None:
        self.id = "ws-" + secrets.token_hex(SESSION_ID_BYTES)
        self.job = job  # the setup; its code was the first step's
        self._sandbox = sandbox
        self._links = links
        self._slot = slot
        self._forget = forget
        self._observe = observe  # every step's outcome (the worker's metrics)
        self._lock = threading.Lock()  # state, steps and the sandbox's state move together
        self.state = SessionState.OPENING if sandbox is not None else SessionState.ENDED
        self.steps = 0
        if sandbox is not None and sandbox.state is SandboxState.READY:
            sandbox.move(SandboxState.BUSY)  # a restored sandbox; a warm one comes BUSY from its pool

    @property
    def ended(self) -> bool:
        return self.state is SessionState.ENDED

    @property
    def sandbox_id(self) -> str | None:
        return None if self._sandbox is None else self._sandbox.id

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
        job = dataclasses.replace(
            self.job,
            code=step.code,
            name=step.name,
            args=step.args,
            timeout_ms=self.job.timeout_ms if step.timeout_ms is None else step.timeout_ms,
            max_output=self.job.max_output if step.max_output is None else step.max_output,
            report_files=step.report_files,
        )
        with self._lock:
            if self.state is SessionState.ENDED:
                raise RequestError(f"session {self.id} has ended", field="session")
            if self.state is not SessionState.IDLE:
                raise RequestError(f"a step of session {self.id} is running; steps run one at a time", field="session")
            self._move(SessionState.RUNNING)
            assert self._sandbox is not None
            self._sandbox.move(SandboxState.BUSY)
        started = time.monotonic()
        try:
            with self._slot(cancel):
                return self.run_in_slot(
                    job, job_id=job_id, queue_us=_since(started), host=host, cancel=cancel, output=output
                )
        except BaseException:
            # The slot was refused (a draining worker) or a bug: nothing is known
            # about the sandbox's state, so it is not trusted with another step.
            self.close()
            raise

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

    def close(self) -> None:
        """End the session and destroy its sandbox; a step still running ends with a worker error.
        Calling it again does nothing."""
        with self._lock:
            if self.state is SessionState.ENDED:
                return
            self._move(SessionState.ENDED)
            sandbox = self._sandbox
        try:
            if sandbox is not None:
                sandbox.destroy()
        finally:
            self._forget(self)

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
