"""The worker's sessions: opened, forked, attached, handed over, and counted (``sessions.py``).

A part :class:`~readie_worker.core.Worker` owns (``worker.sessions``). It
keeps the open sessions and their places (at most ``max_sessions``), and
takes what it needs of the worker through :class:`SessionSandboxes`: a slot
for each step, a sandbox made for a job, a sandbox restored from an image.

Each session that can hibernate gets a key and a leased entry in the session
store when it opens (or forks); :meth:`WorkerSessions.attach_session` takes
one that another holder let go of (decision 32).
"""

from __future__ import annotations

import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path

import structlog

from readie_protocol.cancel import NEVER, Cancellation
from ._idle_pause import IdlePauser
from .errors import ConfigError, ErrorType, PoolWorkerError, RequestError, SandboxSetupError, bound_ids
from ._store_meta import check_storable
from .hibernation import SessionImages
from .paths import remove_tree
from .session_store import StoredSession, new_session_key
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, _since
from .metrics import Metrics
from .sandbox import Sandbox
from .sessions import SandboxSession, StepOutcome

__all__ = ["ATTACH_WAIT_S", "SessionSandboxes", "WorkerSessions"]

log = structlog.get_logger("readie.worker")

#: How long an attach waits for the session's live holder to let go (a draining worker
#: hibernating it, a broken stream's detach): a hibernation of a big session takes seconds,
#: and the caller (a router's step) waits for its answer meanwhile.
ATTACH_WAIT_S = 30.0

#: The links a sandbox's grants need, as the job's spec carries them.
Links = tuple[Mapping[str, object], ...]


@dataclass(frozen=True)
class SessionSandboxes:
    """What the worker lends its sessions: its slots, and sandboxes for a job."""

    slot: Callable[..., AbstractContextManager[None]]  # (cancel, wait_s=None): one of the worker's slots
    # RequestError for a job this worker cannot take (with the memory limit a stored session had)
    check: Callable[[CodeJob, "int | None"], None]
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
        self.checkpoint_steps = False  # session_checkpoint = "step" (_step_checkpoint.py)
        self.backend = "gvisor"
        self._lock = threading.Lock()
        self._sessions: set[SandboxSession] = set()  # open ones; each holds a sandbox or an image
        self._places = 0  # sessions open or being opened, at most max_sessions
        self._closed = False
        self._pause_after_s = 0.0  # WorkerConfig.session_pause_s (pause_idle_after); 0: never
        self._pauser: IdlePauser | None = None  # pauses idle sessions: from the first kept to close()

    @property
    def hibernated(self) -> int:
        """Open sessions whose state is in the store, not in a sandbox."""
        with self._lock:
            return sum(1 for session in self._sessions if session.hibernated)

    @property
    def paused(self) -> int:
        """Open sessions whose sandbox waits paused now (``_idle_pause``)."""
        with self._lock:
            return sum(1 for session in self._sessions if session.idle_clock.paused)

    @property
    def places(self) -> int:
        """Sessions open or being opened (what the worker's capacity counts)."""
        with self._lock:
            return self._places

    def pause_idle_after(self, seconds: float) -> None:
        """Pause a session idle ``seconds`` with its sandbox quiet (``_idle_pause``); 0: never."""
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ConfigError("session_pause", None, f"{seconds!r} is not 0 (never) or a number of seconds")
        self._pause_after_s = seconds

    def close(self) -> None:
        """Close every open session (their sandboxes); none opens after this."""
        with self._lock:
            self._closed = True
            sessions, pauser = list(self._sessions), self._pauser
        if pauser is not None:
            pauser.close()
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
            self._sandboxes.check(job, None)
            if self.images is not None and not job.network:  # one the store cannot keep: refused now, not when it hibernates
                check_storable(job)
            self._take_session_place()
            try:
                sandbox, links = self._sandboxes.acquire(job)
            except BaseException as exc:
                self._give_session_place()
                if not isinstance(exc, SandboxSetupError):
                    raise
                failed = JobOutcome.failure(ErrorType.SANDBOX_SETUP, str(exc), _since(started), self.backend)
                return SandboxSession(job, None, (), slot=slot), StepOutcome(failed, 1, True)
            try:
                session = self._session(job, sandbox, links)
            except BaseException:
                sandbox.destroy()
                self._give_session_place()
                raise
            if self._keep(session):  # close() ran while the sandbox was made ready
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
        if session.key is None:
            session.fork()  # refused as it says why
        self._take_session_place()
        try:
            fork = self._session(session.job, None, (), stored=True, memory_limit=session.memory_limit)
        except BaseException:
            self._give_session_place()
            raise
        try:
            assert fork.key is not None
            fork_ms = session.fork_into(fork.key, cancel)
        except BaseException:
            fork.close()  # its entry; it was never kept, so its place is given back here
            self._give_session_place()
            raise
        return self._kept(fork), fork_ms

    def attach_session(self, key: str, *, take_over: bool = False, cancel: Cancellation = NEVER) -> tuple[SandboxSession, int]:
        """The session stored under ``key``, held here now, and its last step's number (see
        ``readie_policy.runner.JobRunner.attach_session``). Its image is verified and copied
        into the worker's own dir now; its next step restores it (``resumed_ms``).

        The stored job is checked as a new job is (:meth:`_check_stored`); one this worker
        cannot take is a SandboxSetupError (another worker may: a router moves on) and its
        entry is kept, checked before the lease is taken where it can be, so that a live
        holder is not disturbed for nothing."""
        images = self.images
        if images is None:  # an unisolated worker keeps no store
            self._metrics.attach_refused("unknown")
            raise RequestError("no session is stored under this key", field="attach")
        try:
            self._check_stored(images.store.load(key))
        except RequestError:
            pass  # no such key, or nothing stored under it yet: hold answers as for any attach
        except SandboxSetupError:
            self._metrics.attach_refused("invalid")
            raise
        self._take_session_place()
        forward = _LeaseTaken()
        try:
            lease = images.store.hold(key, forward, take_over=take_over, wait_s=ATTACH_WAIT_S, stop=lambda: cancel.cancelled, new=False)
        except BaseException as exc:
            self._give_session_place()
            self._metrics.attach_refused("unknown" if isinstance(exc, RequestError) else "held")
            raise
        try:
            stored, prepared = images.prepare(key, check=self._check_stored)
        except BaseException as exc:
            images.store.let_go(key)
            self._give_session_place()
            self._metrics.attach_refused("unknown" if isinstance(exc, RequestError) else "invalid")
            raise
        try:
            session = self._session(stored.job, None, (), stored=True, memory_limit=stored.memory_limit,
                                    key=key, prepared=prepared, steps=stored.step, lease=lease)
        except BaseException:
            remove_tree(prepared)
            images.store.let_go(key)
            self._give_session_place()
            raise
        if take_over:  # its holder was lost: the state is from the last step written, which the next resume says
            session.resumed_from_step = stored.step
        self._kept(session, keep_entry=True)
        forward.bind(session)  # a lease taken while it was prepared ends it now
        if session.ended:
            self._metrics.attach_refused("held")
            raise SandboxSetupError("another holder took the session while it was attached here")
        self._metrics.session_attached()
        log.info("session attached", session=session.id, step=stored.step, written_by=stored.worker, take_over=take_over)
        return session, stored.step

    def _check_stored(self, stored: StoredSession) -> None:
        """The worker's own checks of a stored session's job, as a new job gets them (its
        checkpoint here, its memory under this worker's ceiling, no network: a networked session
        is never stored); its grants are checked under this worker's rules when it resumes.
        SandboxSetupError: not the request's fault, and another worker may take it."""
        try:
            if stored.job.network:
                raise RequestError("a session with the network is never stored", field="allow_network")
            self._sandboxes.check(stored.job, stored.memory_limit)
        except RequestError as exc:
            raise SandboxSetupError(f"this worker cannot take the stored session: {exc}") from None

    def hand_over(self, at_once: int = 1) -> list[SandboxSession]:
        """Detach every open session into a shared store (a drain, once running steps finished),
        ``at_once`` at a time (the worker's slots: each hibernation takes one); those handed over.
        A session that cannot be (no key, a store of the worker's own) is closed; one whose
        hibernation failed is let go, its entry's last good generation kept."""
        with self._lock:
            sessions = list(self._sessions)
        shared = self.images is not None and self.images.shared
        with ThreadPoolExecutor(max_workers=max(1, at_once), thread_name_prefix="readie-hand-over") as pool:
            handed = [session for session in pool.map(lambda session: self._handed_over(session, shared), sessions) if session]
        return handed

    def _handed_over(self, session: SandboxSession, shared: bool) -> SandboxSession | None:
        if not shared or session.key is None:
            session.close()
            return None
        try:
            session.detach(draining=True)
        except Exception as exc:  # it has ended, what the store held kept; the others are still handed over
            log.warning("session not handed over", session=session.id, error=str(exc))
            return None
        self._metrics.session_handed_over()
        return session

    def _kept(self, session: SandboxSession, *, keep_entry: bool = False) -> SandboxSession:
        """``session`` kept; on a worker closing it ends (``keep_entry``: an attached one's entry is
        left for another worker, a fork's removed)."""
        if self._keep(session):
            if keep_entry:
                session.release()
            else:
                session.close()
            raise PoolWorkerError("the worker is closing; the session was not kept")
        return session

    def _session(
        self, job: CodeJob, sandbox: Sandbox | None, links: Links, *,
        stored: bool = False, memory_limit: int | None = None, key: str | None = None,
        prepared: Path | None = None, steps: int = 0, lease: str | None = None,
    ) -> SandboxSession:
        """A session of this worker's; one that can hibernate holds its store entry's lease from
        here (a new entry, unless ``lease``: an attached one's, which its caller binds)."""
        # A networked session is not stored yet: its image would restore into a namespace wired anew
        # (a new address, its connections gone), which is not built (decision 36, "Left to do").
        images = self.images if self.images is not None and not job.network else None
        session = SandboxSession(
            job, sandbox, links, slot=self._sandboxes.slot, forget=self._forget_session,
            observe=self._metrics.step_finished, images=images,
            restore=self._sandboxes.restore if images is not None else None,
            observe_image=self._metrics.session_image, key=key or new_session_key(), stored=stored, prepared=prepared,
            fork=self.fork_session if images is not None else None, memory_limit=memory_limit, steps=steps,
            checkpoint_steps=self.checkpoint_steps, observe_checkpoint=self._metrics.session_checkpointed,
        )
        if images is not None and lease is not None:
            session.lease = lease
        elif images is not None:
            assert session.key is not None
            forward = _LeaseTaken()
            session.lease = images.store.hold(session.key, forward, new=True)
            forward.bind(session)
        return session

    def _keep(self, session: SandboxSession) -> bool:
        """Keep ``session`` open; whether the worker is closing (the caller ends it then)."""
        with self._lock:
            self._sessions.add(session)
            if self._pauser is None and not self._closed and self._pause_after_s > 0:
                self._pauser = IdlePauser(self._open, self._pause_after_s).start()
            return self._closed

    def _open(self) -> list[SandboxSession]:
        with self._lock:
            return list(self._sessions)

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


class _LeaseTaken:
    """What a store lease's keeper calls when another holder takes it: the session's
    ``lease_taken``, at once or, when the lease went while the session was being made (an
    attach preparing its image), as soon as it is bound: its copy never goes on."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._session: SandboxSession | None = None
        self._lost = False

    def __call__(self) -> None:
        with self._lock:
            self._lost = True
            session = self._session
        if session is not None:
            session.lease_taken()

    def bind(self, session: SandboxSession) -> None:
        with self._lock:
            self._session = session
            lost = self._lost
        if lost:
            session.lease_taken()
