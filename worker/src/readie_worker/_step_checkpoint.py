"""Per-step checkpoints (``session_checkpoint = "step"``, decision 32).

After each step of a session, its sandbox is saved while it keeps serving
(:func:`snapshot`: ``runsc checkpoint --leave-running``) into the session
store as the session's newest generation, tagged with the step it holds
the state of, on a thread of its own, after the step's outcome was
returned. When the worker dies, the session's next step resumes from it on
another worker (``Worker.attach_session`` with ``take_over``).

The session is busy while its checkpoint runs (:class:`StepCheckpoints`:
its next step, a hibernation, a detach or a close waits for it, bounded by
:data:`CHECKPOINT_WAIT_S`; a close that outwaits it leaves the sandbox and
the store entry to the checkpoint's thread, which ends them after it). A checkpoint that fails is logged and counted,
and the session goes on with its previous generation in the store: a
healthy session is never ended for a copy it could not make. If the
sandbox did not survive the attempt, the next step finds out as it would
have anyway. A worker whose lease on the entry was taken writes nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path

import structlog

from .errors import PoolWorkerError, SandboxSetupError, bound_ids
from .hibernation import SessionImages
from .jobs import CodeJob
from ._socket_wait import SOCKET_POLL_S
from .sandbox import Sandbox, hand_over

__all__ = ["CHECKPOINT_WAIT_S", "StepCheckpoints", "snapshot"]

log = structlog.get_logger("readie.worker")

# How long a step (or hibernation, detach, close) waits for the session's checkpoint: its
# parts are bounded by the executor's answer (5 s), a runsc command (30 s), its wake-up (15 s)
# and warm-up (10 s); the rest covers the store's copy (~50 MB for pandas, well under a second).
CHECKPOINT_WAIT_S = 90.0
# After a --leave-running checkpoint: each ping on a fresh connection waits this long (a
# lost one is not served until the next connection arrives; a served one answers in
# ~1 ms), and the executor has this long in all to serve again (a restore's bound).
WAKE_PING_S = 0.1
WAKE_WAIT_S = 15.0


def snapshot(sandbox: Sandbox, image_dir: Path) -> None:
    """Save ``sandbox`` to ``image_dir`` and keep it serving (``runsc checkpoint --leave-running``).

    The executor hibernates as for ``Sandbox.checkpoint``, and is then handed
    its line on the same container's stdin and binds again. It is ready only
    once a ping answers on a fresh connection: in a resumed sentry the first
    connection made right after the rebind is not served until another one
    arrives (decision 32), so the wait retries on new connections. After a
    failed runsc command the executor is still woken; PoolWorkerError says
    it did not serve again.

    The save unmaps the files the process had mapped (the interpreter's and
    its libraries' code), so the next call faults them in again: the first
    step after a save took 11-21 ms where the others take 3-4 (pandas). A
    do-nothing job now (the warm-up a restored sandbox gets, which touches
    nothing a session keeps) pays part of that here instead (7-10 ms left).
    """
    sandbox.quiesce()
    try:
        sandbox.launcher.checkpoint(sandbox.dir, image_dir, leave_running=True)
    finally:
        _wake(sandbox)
    failed = sandbox.warm_up()
    if failed is not None:  # the image is written and the executor serves: only the head start is lost
        log.debug("warm-up after a checkpoint failed", sandbox=sandbox.id, why=failed)


def _wake(sandbox: Sandbox) -> None:
    try:
        hand_over(sandbox.launched.process, {})  # a resume keeps its own environment (decision 22)
    except SandboxSetupError as exc:
        raise PoolWorkerError(f"sandbox {sandbox.id}: cannot wake the executor: {exc}") from None
    deadline = time.monotonic() + WAKE_WAIT_S
    while time.monotonic() < deadline and not sandbox.interrupted:
        if sandbox.alive(WAKE_PING_S):
            return
        time.sleep(SOCKET_POLL_S)  # no socket yet, or a connection the resumed sentry left unserved
    raise PoolWorkerError(f"sandbox {sandbox.id}: the executor did not serve again within {WAKE_WAIT_S:.0f} s of a checkpoint")


class StepCheckpoints:
    """One session's per-step checkpoints: one at a time, each waited for before the session is used."""

    def __init__(self, session_id: str, observe: Callable[[str, float], None]) -> None:
        self._session_id = session_id
        self._observe = observe  # (ok|failed, seconds): the worker's metrics
        self._done = threading.Event()  # cleared while one runs
        self._done.set()
        self._lock = threading.Lock()  # _done and _after move together
        self._after: list[Callable[[], None]] = []  # what runs once the running checkpoint ended

    def start(self, images: SessionImages, key: str, lease: str | None, job: CodeJob, memory_limit: int | None,
              sandbox: Sandbox, step: int, finish: Callable[[], None]) -> None:
        """Save ``sandbox`` as the session's state after ``step`` in the background, published only
        while ``lease`` is still the entry's; ``finish`` (the session idle again) runs after it,
        whatever happened."""
        with self._lock:
            self._done.clear()
        threading.Thread(
            target=self._run, args=(images, key, lease, job, memory_limit, sandbox, step, finish),
            name=f"checkpoint-{self._session_id}", daemon=True,
        ).start()

    def wait(self) -> bool:
        """Until the running checkpoint (if any) is done, at most :data:`CHECKPOINT_WAIT_S`; whether it is."""
        if self._done.wait(CHECKPOINT_WAIT_S):
            return True
        log.error("session checkpoint still running", session=self._session_id, waited_s=CHECKPOINT_WAIT_S)
        return False

    def then(self, action: Callable[[], None]) -> None:
        """Run ``action`` once no checkpoint runs: now, or on the checkpoint's thread when it ends
        (a close that outwaited it: the sandbox is destroyed and the entry let go only after)."""
        with self._lock:
            if not self._done.is_set():
                self._after.append(action)
                return
        action()

    def _run(self, images: SessionImages, key: str, lease: str | None, job: CodeJob, memory_limit: int | None,
             sandbox: Sandbox, step: int, finish: Callable[[], None]) -> None:
        started = time.monotonic()
        result = "failed"
        try:
            with bound_ids(session=self._session_id):
                if not images.store.holds(key):  # another worker took the session: its entry is not ours
                    raise SandboxSetupError("this worker no longer holds the session's store entry")
                images.write(key, sandbox, job=job, memory_limit=memory_limit, step=step, lease=lease, save=snapshot)
                result = "ok"
        except Exception as exc:  # noqa: BLE001 - logged and counted; the session goes on
            log.warning("session checkpoint failed", session=self._session_id, step=step, error=str(exc))
        finally:
            try:
                finish()
            finally:
                with self._lock:
                    after, self._after = self._after, []
                    self._done.set()
                for action in after:
                    try:
                        action()
                    except Exception:  # noqa: BLE001 - a teardown that failed is logged; the thread ends
                        log.exception("ending a session after its checkpoint failed", session=self._session_id)
        seconds = time.monotonic() - started
        self._observe(result, seconds)
        log.debug("session checkpointed", session=self._session_id, step=step, result=result,
                  checkpoint_ms=round(seconds * 1000, 1))
