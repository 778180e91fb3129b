"""The worker's sessions: opened, forked, restored from their images, and counted (``sessions.py``).

A part of :class:`~readie_worker.core.Worker`, split out to keep each
readable; it uses the worker's slots, grants, factories and metrics.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from readie_protocol.cancel import NEVER, Cancellation
from .errors import ErrorType, PoolWorkerError, SandboxSetupError, bound_ids
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, _since
from .sandbox import Sandbox, launch
from .sessions import SandboxSession, StepOutcome

if TYPE_CHECKING:
    from .core import Worker

__all__ = ["SessionKeeping"]

# A restore answers in 0.2-1 s here, a few on a loaded host: the resume's bound on its socket.
RESUME_SOCKET_WAIT_S = 15.0


class SessionKeeping:
    """The session methods of :class:`~readie_worker.core.Worker`."""

    def open_session(
        self: Worker,
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
        with self._slot(cancel), bound_ids(job_id=job_id):
            queued_us = _since(started)
            self._check_job(job)
            self._take_session_place()
            try:
                sandbox, links = self._acquire(job)
            except BaseException as exc:
                self._give_session_place()
                if not isinstance(exc, SandboxSetupError):
                    raise
                failed = JobOutcome.failure(
                    ErrorType.SANDBOX_SETUP, str(exc), _since(started), "gvisor" if self.isolated else "local"
                )
                return SandboxSession(job, None, (), slot=self._slot), StepOutcome(failed, 1, True)
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

    def fork_session(self: Worker, session: SandboxSession, cancel: Cancellation = NEVER) -> tuple[SandboxSession, float]:
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
        self: Worker, job: CodeJob, sandbox: Sandbox | None, links: tuple[Mapping[str, object], ...],
        image: Path | None = None, memory_limit: int | None = None,
    ) -> SandboxSession:
        # A networked session's sandbox is a cold start in the worker's namespace: not restorable here.
        hibernates = self.images is not None and not job.network
        return SandboxSession(
            job, sandbox, links, slot=self._slot, forget=self._forget_session, observe=self.metrics.step_finished,
            images=self.images if hibernates else None, restore=self._restore_session if hibernates else None,
            observe_image=self.metrics.session_image, image=image,
            fork=self.fork_session if hibernates else None, memory_limit=memory_limit,
        )

    def _restore_session(
        self: Worker, job: CodeJob, image: Path, memory_limit: int | None
    ) -> tuple[Sandbox, tuple[Mapping[str, object], ...]]:
        """A hibernated session's sandbox, restored from ``image`` with its grants opened again
        under the rules of a new job (a grant that is gone or moved refuses the resume).

        The memory limit the session had is in the restore's own spec, so the restored
        sandbox is never without it, not even before its first step.
        """
        factory = self.factories[job.checkpoint]
        limit = factory.primary.memory_limit_bytes if memory_limit is None else memory_limit
        restore = dataclasses.replace(factory.primary, image_path=image, memory_limit_bytes=limit)
        with self._hold_grants(job) as grants:
            # A job's thread can take the hand-over meant for its executor; then no socket comes,
            # and this wait, not the restore's usual minute, is what the session costs its slot.
            sandbox = launch(restore, factory.run_dir, factory.env, grants, RESUME_SOCKET_WAIT_S)
        sandbox.memory_limit_bytes = memory_limit
        return sandbox, grants.links

    def _take_session_place(self: Worker) -> None:
        with self._lock:
            if self._session_places >= self.config.max_sessions:
                # Not the request's fault: another worker (or this one, later) may take it.
                raise SandboxSetupError(f"this worker keeps at most {self.config.max_sessions} sessions, and all are open")
            self._session_places += 1

    def _give_session_place(self: Worker) -> None:
        with self._lock:
            self._session_places -= 1

    def _forget_session(self: Worker, session: SandboxSession) -> None:
        with self._lock:
            if session in self._sessions:
                self._sessions.remove(session)
                self._session_places -= 1
