"""The worker's sessions: opened, forked, restored from their images, and counted (``sessions.py``).

A part :class:`~readie_worker.core.Worker` owns (``worker.sessions``). It
keeps the open sessions and their places (at most ``max_sessions``), and
takes what it needs of the worker through :class:`SessionSandboxes`: a slot
for each step, a sandbox made for a job, a sandbox restored from an image.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

from readie_protocol.cancel import NEVER, Cancellation
from .errors import ErrorType, PoolWorkerError, SandboxSetupError, bound_ids
from .hibernation import SessionImages
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, _since
from .metrics import Metrics
from .sandbox import Sandbox
from .sessions import SandboxSession, StepOutcome

__all__ = ["SessionSandboxes", "WorkerSessions"]

#: The links a sandbox's grants need, as the job's spec carries them.
Links = tuple[Mapping[str, object], ...]


@dataclass(frozen=True)
class SessionSandboxes:
    """What the worker lends its sessions: its slots, and sandboxes for a job."""

    slot: Callable[..., AbstractContextManager[None]]  # (cancel, wait_s=None): one of the worker's slots
    check: Callable[[CodeJob], None]  # RequestError for a job this worker cannot take
    acquire: Callable[[CodeJob], tuple[Sandbox, Links]]  # ready for the job, its grants opened
    restore: Callable[[CodeJob, Path, int | None], tuple[Sandbox, Links]]  # from a session's image


class WorkerSessions:
    """The worker's open sessions, each holding a sandbox or a hibernated image."""

    def __init__(self, sandboxes: SessionSandboxes, max_sessions: int, metrics: Metrics) -> None:
        self._sandboxes = sandboxes
        self.max_sessions = max_sessions
        self._metrics = metrics
        # Where sessions hibernate, and the backend a failed open names: known once the worker started.
        self.images: SessionImages | None = None
        self.backend = "gvisor"
        self._lock = threading.Lock()
        self._sessions: set[SandboxSession] = set()  # open ones; each holds a sandbox or an image
        self._places = 0  # sessions open or being opened, at most max_sessions
        self._closed = False

    @property
    def places(self) -> int:
        """Sessions open or being opened (what the worker's capacity counts)."""
        with self._lock:
            return self._places

    def close(self) -> None:
        """Close every open session (their sandboxes); none opens after this."""
        with self._lock:
            self._closed = True
            sessions = list(self._sessions)
        for session in sessions:  # a step still running ends with a worker error
            session.close()

    def open_session(
        self,
        job: CodeJob,
        job_id: str | None = None,
        host: HostFunction | None = None,
        *,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> tuple[SandboxSession, StepOutcome]:
        """Open a session whose setup and first step are ``job``; see ``sessions.py``.

        ``job.functions`` are the session's host functions for every step;
        ``host`` answers the first step's calls. Raises RequestError as
        :meth:`run_job` does. A sandbox that cannot be made ready gives an
        ended session and a SandboxSetupError outcome. ``cancel`` stops the
        first step as :meth:`run_job`'s job (and so ends the session).
        """
        started = time.monotonic()
        slot = self._sandboxes.slot
        with slot(cancel), bound_ids(job_id=job_id):
            queued_us = _since(started)
            self._sandboxes.check(job)
            self._take_session_place()
            try:
                sandbox, links = self._sandboxes.acquire(job)
            except BaseException as exc:
                self._give_session_place()
                if not isinstance(exc, SandboxSetupError):
                    raise
                failed = JobOutcome.failure(ErrorType.SANDBOX_SETUP, str(exc), _since(started), self.backend)
                return SandboxSession(job, None, (), slot=slot), StepOutcome(failed, 1, True)
            session = self._session(job, sandbox, links)
            with self._lock:
                self._sessions.add(session)
                closed = self._closed
            if closed:  # close() ran while the sandbox was made ready
                session.close()
                raise PoolWorkerError("the worker is closing; the session did not start")
            try:
                return session, session.run_in_slot(job, job_id=job_id, queue_us=queued_us, host=host, cancel=cancel, output=output)
            except BaseException:
                session.close()
                raise

    def fork_session(self, session: SandboxSession, cancel: Cancellation = NEVER) -> tuple[SandboxSession, float]:
        """A new session with ``session``'s state at this moment, and the milliseconds the fork took.

        Both are left hibernated, sharing the image's bytes; each resumes at
        its next step. Raises as :meth:`SandboxSession.hibernate`, and
        SandboxSetupError when this worker keeps ``max_sessions`` already.
        """
        self._take_session_place()
        try:
            image, fork_ms = session.fork_image(cancel)
        except BaseException:
            self._give_session_place()
            raise
        fork = self._session(session.job, None, (), image=image, memory_limit=session.memory_limit)
        with self._lock:
            self._sessions.add(fork)
            closed = self._closed
        if closed:
            fork.close()
            raise PoolWorkerError("the worker is closing; the fork was not kept")
        return fork, fork_ms

    def _session(
        self, job: CodeJob, sandbox: Sandbox | None, links: Links,
        image: Path | None = None, memory_limit: int | None = None,
    ) -> SandboxSession:
        # A networked session's sandbox is a cold start in the worker's namespace: not restorable here.
        hibernates = self.images is not None and not job.network
        return SandboxSession(
            job, sandbox, links, slot=self._sandboxes.slot, forget=self._forget_session,
            observe=self._metrics.step_finished, images=self.images if hibernates else None,
            restore=self._sandboxes.restore if hibernates else None,
            observe_image=self._metrics.session_image, image=image,
            fork=self.fork_session if hibernates else None, memory_limit=memory_limit,
        )

    def _take_session_place(self) -> None:
        with self._lock:
            if self._places >= self.max_sessions:
                # Not the request's fault: another worker (or this one, later) may take it.
                raise SandboxSetupError(f"this worker keeps at most {self.max_sessions} sessions, and all are open")
            self._places += 1

    def _give_session_place(self) -> None:
        with self._lock:
            self._places -= 1

    def _forget_session(self, session: SandboxSession) -> None:
        with self._lock:
            if session in self._sessions:
                self._sessions.remove(session)
                self._places -= 1
