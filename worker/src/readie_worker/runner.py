"""What runs jobs and sessions, whichever process it lives in.

Three things have this shape: the in-process :class:`~readie_worker.core.Worker`,
a :class:`~readie_rpc.client.WorkerClient` of a remote one, and a router's
placement across many. The gRPC service serves any of them, and the pool
engine runs on any of them, without knowing which. :class:`Capacity` is what
each of them answers when asked how much it can take now.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from .cancel import Cancellation
from .jobs import CodeJob, HostFunction, JobOutcome, OutputSink, Step
from .sessions import StepOutcome

__all__ = ["Capacity", "JobRunner", "SessionHandle"]


@dataclass
class Capacity:
    slots: int
    busy: int
    draining: bool
    warm: dict[str, dict[str, int]]  # by checkpoint: its warm sandboxes ready and kept
    isolated: bool
    sessions: int = 0
    max_sessions: int = 0
    hibernated: int = 0  # sessions whose image is on disk (they count in sessions too)
    hibernated_bytes: int = 0
    # Why nothing can be served, when nothing can: health says NOT_SERVING then.
    problem: str | None = None


class SessionHandle(Protocol):
    """An open session: ``sessions.SandboxSession`` here, ``RemoteSession`` on another worker.

    ``timeout_ms`` and ``max_output`` of None mean the session's own; a
    step asked for while another runs, or after the session ended, is a
    RequestError.
    """

    id: str

    @property
    def ended(self) -> bool: ...

    def run_step(
        self,
        step: Step,
        *,
        job_id: str | None = ...,
        host: HostFunction | None = ...,
        cancel: Cancellation = ...,
        output: OutputSink | None = ...,
    ) -> StepOutcome: ...

    def close(self) -> None: ...

    @property
    def hibernated(self) -> bool: ...

    def hibernate(self, cancel: Cancellation = ...) -> float:
        """Checkpoint the idle session to disk, freeing its sandbox; milliseconds (0: it was)."""
        ...

    def fork(self, cancel: Cancellation = ...) -> tuple[SessionHandle, float]:
        """A new session with this one's state now, its own sandbox; and the milliseconds it took."""
        ...


class JobRunner(Protocol):
    """``cancel`` (``cancel.py``): when it is set, the work stops and its sandbox is freed.
    ``output`` (``jobs.OutputSink``): the job's output as it is written, before its outcome."""

    def run_job(
        self,
        job: CodeJob,
        job_id: str | None = None,
        host: HostFunction | None = None,
        *,
        cancel: Cancellation = ...,
        output: OutputSink | None = ...,
    ) -> JobOutcome: ...

    def open_session(
        self,
        job: CodeJob,
        job_id: str | None = None,
        host: HostFunction | None = None,
        *,
        cancel: Cancellation = ...,
        output: OutputSink | None = ...,
    ) -> tuple[SessionHandle, StepOutcome]: ...

    def close(self) -> None: ...
