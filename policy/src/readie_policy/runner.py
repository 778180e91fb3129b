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

    def close(self) -> None: ...


class ServedRunner(JobRunner, Protocol):
    """What ``readie_rpc``'s gRPC service serves: a runner that also runs pickled calls, says
    what it can take and drains (the worker's ``Worker``, a router's ``Placement``)."""

    def execute_call(
        self, checkpoint: str, payload: bytes, timeout_s: float, max_response: int | None = None, *,
        cancel: Cancellation = ...,
    ) -> bytes: ...

    def capacity(self) -> Capacity: ...

    def drain(self, grace_s: float) -> None: ...


class CallCounter(Protocol):
    """Counts a server's calls by method and status code (the worker's and the router's metrics)."""

    def rpc_handled(self, method: str, code: str) -> None: ...
