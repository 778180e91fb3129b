"""Used sandboxes are destroyed after the answer, not before it.

A job's result does not depend on its sandbox's teardown (``runsc kill`` and
``delete``: 57-130 ms measured by ``make bench``), so the worker answers
first and a background thread destroys. The queue is bounded: past
``MAX_PENDING`` the caller destroys inline and pays for it, so a burst can
never leave many used sandboxes alive at once.
"""

from __future__ import annotations

import queue
import threading

import structlog

from .sandbox import Sandbox

log = structlog.get_logger("readie.retire")

# A used sandbox holds ~60-150 MB until destroyed; a handful waiting is
# harmless, and one destroy takes well under the time a job does.
MAX_PENDING = 8


class Retirer:
    def __init__(self) -> None:
        self._pending: queue.Queue[Sandbox | None] = queue.Queue(MAX_PENDING)
        self._thread = threading.Thread(target=self._run, name="retire", daemon=True)
        self._thread.start()
        self._closed = False

    def retire(self, sandbox: Sandbox) -> None:
        if sandbox.destroyed:
            return
        if self._closed:
            sandbox.destroy()
            return
        try:
            self._pending.put_nowait(sandbox)
        except queue.Full:
            sandbox.destroy()

    def backed_up(self) -> bool:
        """Whether :meth:`retire` would destroy inline now (the queue is full)."""
        return self._pending.full()

    def after_answer(self, sandbox: Sandbox) -> None:
        """:meth:`retire` a sandbox whose job has been answered: a destroy that fails is logged (the
        worker's sweep removes what is left), never raised to a caller with nothing left to answer."""
        try:
            self.retire(sandbox)
        except Exception:
            log.exception("destroying a used sandbox failed", sandbox=sandbox.id)

    def close(self) -> None:
        """Destroy everything still waiting; returns once it is gone."""
        if self._closed:
            return
        self._closed = True
        self._pending.put(None)
        self._thread.join()

    def _run(self) -> None:
        while (sandbox := self._pending.get()) is not None:
            try:
                sandbox.destroy()
            except Exception:  # one failed destroy must not stop the others; close() sweeps
                log.exception("destroying a used sandbox failed", sandbox=sandbox.id)
