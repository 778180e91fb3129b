"""What runs jobs and sessions, whichever process it lives in.

Three things have this shape: the in-process :class:`~readie_worker.core.Worker`,
a :class:`~readie_rpc.client.WorkerClient` of a remote one, and a router's
placement across many. The gRPC service serves any of them (as a
:class:`ServedRunner`), and the pool engine runs on any of them, without
knowing which; neither imports the worker (decision 27).
"""

from __future__ import annotations

from typing import Protocol

from readie_protocol.cancel import Cancellation

from readie_protocol.workspace import FileChunk, FileListing

from .jobs import Capacity, CodeJob, HostFunction, JobOutcome, OutputSink, Step, StepOutcome

__all__ = ["CallCounter", "JobRunner", "ServedRunner", "SessionHandle"]


class SessionHandle(Protocol):
    """An open session: ``sessions.SandboxSession`` here, ``RemoteSession`` on another worker.

    ``timeout_ms`` and ``max_output`` of None mean the session's own; a
    step asked for while another runs, or after the session ended, is a
    RequestError.
    """

    id: str
    # The job that opened the session: its grants, limits and host functions, fixed for its life.
    # An attached session's comes from the store's entry (the pool reports its policy and answers
    # its host functions from it).
    job: CodeJob
    # The session's key (decision 32): opaque, at least 128 random bits, made by the worker that
    # opened it; with it another connection attaches to the session (``JobRunner.attach_session``).
    # None where the session cannot outlive its holder (networked, unisolated, an older worker).
    key: str | None

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

    def close(self) -> None:
        """End the session for good: its sandbox destroyed, its image removed from the store."""
        ...

    def detach(self, cancel: Cancellation = ...) -> None:
        """Let go of the session without ending it (decision 32): hibernated into the session
        store (if it is not already), its lease given up, this handle ended; a later
        ``attach_session`` with its key continues it, on any worker sharing the store. A session
        without a key is closed instead. Raises as :meth:`hibernate`; what it raises has ended it."""
        ...

    @property
    def hibernated(self) -> bool: ...

    def hibernate(self, cancel: Cancellation = ...) -> float:
        """Checkpoint the idle session to disk, freeing its sandbox; milliseconds (0: it was)."""
        ...

    def fork(self, cancel: Cancellation = ...) -> tuple[SessionHandle, float]:
        """A new session with this one's state now, its own sandbox; and the milliseconds it took."""
        ...

    # Files in the session's workspace (decision 31). Paths are checked workspace paths
    # (readie_protocol.workspace); a hibernated session is resumed first, as for a step.
    # A bad path, a missing file, a size past the session's ``transfer_bytes`` or past the
    # memory its sandbox has left is a RequestError naming the field, and the session goes on;
    # a sandbox that answers out of bounds is a PoolWorkerError.

    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel: Cancellation = ...) -> int:
        """Write ``data`` at ``offset`` of the ``size``-byte file ``path``; the bytes it holds now.

        Offset 0 creates the file (and its directories), replacing one there;
        each later chunk must start where the file ends; ``size`` is the
        whole upload's, checked against the limits before the first byte.
        """
        ...

    def download_chunk(self, path: str, offset: int, length: int, *, cancel: Cancellation = ...) -> FileChunk:
        """At most ``length`` bytes of ``path`` from ``offset``, with the file's size and mtime."""
        ...

    def list_files(self, path: str, *, cancel: Cancellation = ...) -> FileListing:
        """The entries of directory ``path`` (``"."``: the workspace), sorted, bounded."""
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

    def attach_session(self, key: str, *, take_over: bool = False, cancel: Cancellation = ...) -> tuple[SessionHandle, int]:
        """The session stored under ``key`` (decision 32), held here now, and the number of its last
        step; its next step resumes it (``StepOutcome.resumed_ms``). A session another holder
        still has live is waited for until that holder lets go (a bounded wait), or taken from it
        at once with ``take_over`` (its holder was lost: the session goes on from its last
        checkpoint, ``StepOutcome.resumed_from_step``). An unknown key and a wrong one are the
        same RequestError (field ``attach``); an image that fails verification is a
        SandboxSetupError, logged, and nothing of it is restored."""
        ...

    def close(self) -> None: ...


class ServedRunner(JobRunner, Protocol):
    """What ``readie_rpc``'s gRPC service serves: a runner that also runs pickled calls, says
    what it can take and drains (the worker's ``Worker``, a router's ``Placement``)."""

    def execute_call(
        self, checkpoint: str, payload: bytes, timeout_s: float, max_response: int | None = None, *,
        cancel: Cancellation = ...,
    ) -> bytes: ...

    def capacity(self) -> Capacity: ...

    # Whether a drain hands sessions with a key over (decision 32): each is detached into a store
    # another server reaches, and its stream ends with ``handed_over``. A router's always (its
    # workers' stores hold them); a worker's only with a shared store (one of its own goes with it).
    hands_sessions_over: bool

    def drain(self, grace_s: float) -> None: ...


class CallCounter(Protocol):
    """Counts a server's calls by method and status code (the worker's and the router's metrics)."""

    def rpc_handled(self, method: str, code: str) -> None: ...
