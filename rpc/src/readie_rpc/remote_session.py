"""The calling side of the ``Interact`` stream: host calls answered here, sessions on another worker.

:class:`InteractStream` is one stream from :class:`~readie_rpc.client.WorkerClient`:
it writes requests, reads events until a result, and answers each ``call``
event with the caller's host function on the caller's own thread.
:class:`RemoteSession` is a session that lives in a sandbox on the worker at
the other end, with the shape of the worker's own
:class:`~readie_worker.sessions.SandboxSession`, so a router serves both alike.

A session is the stream: it cannot move to another worker, and when the
stream breaks (the worker died, drained, or was restarted at the same
address) the session has ended. The step that finds out fails with a
PoolWorkerError saying so; nothing ever starts a fresh session in its place.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any, TypeVar

import grpc

from readie_executor.hostwire import MAX_CALLS_PER_TASK, OUTPUT_STREAMS
from readie_executor.jobs import bounds

from ._client_wire import session_step_message, step_outcome
from ._convert import session_step
from ._files_wire import (
    FILE_EVENTS, chunk_from_answer, download_message, file_refusal, list_message, listing_from_answer, received_from_answer, upload_message,
)
from ._session_wire import milliseconds, refusal
from ._host_wire import call_from_message, output_from_message, reply_message
from ._proto.readie.v1 import worker_pb2 as pb
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from ._status import readie_errors
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import PoolWorkerError, ReadieError, RequestError, SandboxSetupError
from readie_policy.jobs import CodeJob, HostFunction, HostReply, OutputSink, Step, StepOutcome, ask_host, max_output_events
from readie_protocol.workspace import FileChunk, FileListing

__all__ = ["InteractStream", "RemoteSession", "SessionLost", "StreamBroken"]

# Beyond a job's (or step's) own timeout: the worker enforces the timeout; this
# only keeps a worker that stopped answering from holding the caller forever.
DEADLINE_MARGIN_S = 30.0
# How long closing a session waits for the worker to confirm its sandbox is gone.
CLOSE_WAIT_S = 10.0
_END = None
_T = TypeVar("_T")


class StreamBroken(PoolWorkerError):
    """The stream ended without the worker's word: the connection or the worker process went away."""


class SessionLost(StreamBroken):
    """A session's stream broke: its worker died, drained or restarted, and the session with it."""


class InteractStream:
    """One Interact call: the first request sent at once, then events read in order."""

    def __init__(
        self,
        stub: pb_grpc.WorkerStub,
        first: pb.InteractRequest,
        functions: Collection[str],
        *,
        timeout_s: float | None,
        metadata: Sequence[tuple[str, str]] = (),
    ) -> None:
        self._functions = frozenset(functions)
        self._stub, self._metadata = stub, tuple(metadata)  # for a fork's stream (sibling)
        # This side writes a message only after reading an event, and a task
        # makes at most MAX_CALLS_PER_TASK calls (counted in result()), so
        # the queue holds at most that many replies even if the worker stops reading.
        self._requests: queue.SimpleQueue[pb.InteractRequest | None] = queue.SimpleQueue()
        self._requests.put(first)
        # grpc reads this iterator on a thread of its own until it yields _END.
        self._call = stub.Interact(iter(self._requests.get, _END), timeout=timeout_s, metadata=metadata)
        self._overdue = threading.Event()

    def send(self, request: pb.InteractRequest) -> None:
        self._requests.put(request)

    def result(
        self,
        host: HostFunction | None,
        task_s: float,
        within_s: float | None = None,
        *,
        output: OutputSink | None = None,
        max_output: int = 0,
    ) -> pb.RunJobResponse:
        """Read events until the job's (or step's) result, answering its host calls with ``host``
        and handing its output events to ``output`` (asked for with ``stream_output``).

        ``task_s`` is the task's own timeout: no call waits on the host longer,
        whatever deadline the worker names. ``within_s`` bounds the whole
        wait when the stream has no deadline of its own (a session's). Raises
        the worker's error (``readie_errors``), StreamBroken when the
        stream broke without one, or PoolWorkerError for events no honest
        worker sends (output not asked for, empty, past the task's ``max_output``
        or more events than a worker forwards); in every case the stream is over.
        """
        watchdog = None
        if within_s is not None:
            watchdog = threading.Timer(within_s, self._give_up)
            watchdog.daemon = True
            watchdog.start()
        calls = 0
        # Per stream: what the worker may still send, as a worker bounds it (the text, and the events).
        room = dict.fromkeys(OUTPUT_STREAMS, max_output)
        events_left = dict.fromkeys(OUTPUT_STREAMS, max_output_events(task_s, max_output))
        try:
            while True:
                event = self._next_event(within_s)
                kind = event.WhichOneof("kind")
                if kind == "result":
                    return event.result
                if kind == "output" and output is not None:
                    chunk = output_from_message(event.output)
                    room[chunk.stream] -= bounds.encoded_size(chunk.data)
                    events_left[chunk.stream] -= 1
                    if not chunk.data or room[chunk.stream] < 0 or events_left[chunk.stream] < 0:
                        raise PoolWorkerError(f"the worker sent {chunk.stream} output no worker forwards")
                    output(chunk)
                    continue
                if kind != "call":
                    raise PoolWorkerError("the worker sent an event that is neither a call nor a result")
                calls += 1
                if calls > MAX_CALLS_PER_TASK:
                    raise PoolWorkerError(f"the worker relayed more than {MAX_CALLS_PER_TASK} calls for one task")
                call = call_from_message(event.call, self._functions, task_s)
                reply = ask_host(host, call) if host is not None else HostReply(error=f"{call.function}: no host here")
                self.send(pb.InteractRequest(reply=reply_message(call.call_id, reply)))
        except BaseException:
            self.cancel()
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def answer(self, kind: str, within_s: float) -> Any:
        """The next event, which must be a ``kind`` (``hibernated``, ``forked``, ``attached``): its
        message; PoolWorkerError (and the stream over) for any other, or none within ``within_s``."""
        watchdog = threading.Timer(within_s, self._give_up)
        watchdog.daemon = True
        watchdog.start()
        try:
            event = self._next_event(within_s)
            if event.WhichOneof("kind") != kind:
                raise PoolWorkerError(f"the worker answered with {event.WhichOneof('kind')!r} where {kind!r} was due")
            return getattr(event, kind)
        except BaseException:
            self.cancel()
            raise
        finally:
            watchdog.cancel()

    def sibling(self, first: pb.InteractRequest) -> InteractStream:
        """A new stream to the same server, as this one's caller: a fork's."""
        return InteractStream(self._stub, first, self._functions, timeout_s=None, metadata=self._metadata)

    def _next_event(self, within_s: float | None) -> pb.InteractEvent:
        def unanswered(error: grpc.RpcError) -> PoolWorkerError:
            if self._overdue.is_set():  # the watchdog cancelled the call
                return PoolWorkerError(f"the worker sent no result within {within_s:.0f} s")
            return StreamBroken(f"the stream to the worker broke ({error.code().name}: {error.details()})")  # type: ignore[attr-defined]

        with readie_errors(unanswered):
            try:
                return next(self._call)
            except StopIteration:
                raise PoolWorkerError("the worker ended the stream without a result") from None

    def _give_up(self) -> None:
        self._overdue.set()
        self.cancel()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> None:
        """Close this side and wait (up to ``wait_s``) for the worker to end the stream."""
        self._requests.put(_END)
        timer = threading.Timer(wait_s, self._call.cancel)
        timer.daemon = True
        timer.start()
        try:
            for _ in self._call:  # an honest worker sends nothing more
                pass
        except grpc.RpcError:
            pass  # it ended badly or was cancelled: either way it is over
        finally:
            timer.cancel()

    def cancel(self) -> None:
        self._requests.put(_END)  # else grpc's request thread waits on the queue forever
        self._call.cancel()


# How long a hibernate's (or fork's) answer may take: a router waits up to a minute for a slot
# on the session's worker (PLACEMENT_WAIT_S), the worker 20 s for its own (sessions.py), the
# checkpoint under a second. Past this the worker is taken for wedged, and the session ends.
SESSION_IMAGE_WAIT_S = 120.0
# How long the answer to a file request may take: a chunk is quick, but a hibernated session is
# resumed first, which may take as long as a hibernation.
FILE_ANSWER_WAIT_S = SESSION_IMAGE_WAIT_S


class RemoteSession:
    """A session in a sandbox on another worker; see the module docstring."""

    def __init__(self, stream: InteractStream, job: CodeJob, session_id: str, address: str) -> None:
        self.id = session_id
        self.job = job  # the setup, as opened
        self.address = address
        self._stream = stream
        self._lock = threading.Lock()  # one step at a time
        self._running = False
        self.ended = False
        self.hibernated = False  # as the worker answered; its next step resumes it

    def run_step(
        self,
        step: Step,
        *,
        job_id: str | None = None,  # noqa: ARG002 - the worker logs steps under the stream's request id
        host: HostFunction | None = None,
        cancel: Cancellation = NEVER,
        output: OutputSink | None = None,
    ) -> StepOutcome:
        """Run one step on the session's worker.

        RequestError for a step the worker would refuse (the session goes on);
        SessionLost when the stream broke under it; PoolWorkerError when the
        worker ended the session otherwise. After either, the session has ended.
        ``cancel`` ends the stream, which stops the step and ends the session.
        """
        message = session_step_message(step)
        message.stream_output = output is not None
        session_step(message)  # the worker's own checks, here, so a refusal does not cost the session
        with self._lock:
            if self.ended:
                raise RequestError(f"session {self.id} has ended", field="session")
            if self._running:
                raise RequestError(f"a step of session {self.id} is running; steps run one at a time", field="session")
            self._running = True
        job = self.job.step(step)
        task_s = job.timeout_ms / 1000
        try:
            self._stream.send(pb.InteractRequest(step=message))
            with cancel.stopping(self.close):
                response = self._stream.result(
                    host, task_s, task_s + DEADLINE_MARGIN_S,
                    output=output, max_output=job.max_output,
                )
        except ReadieError as exc:  # the stream is over, whatever ended it, and the session with it
            closed = self.ended  # close() cancelled the stream under the step
            self._end()
            if closed:
                raise PoolWorkerError("the session was closed while its step ran") from None
            if isinstance(exc, StreamBroken):
                raise SessionLost(
                    f"the session ended: its worker at {self.address} was lost ({exc}); "
                    "its state is gone, and only a new session can go on"
                ) from None
            raise PoolWorkerError(f"the session ended: {exc}") from None
        finally:
            with self._lock:
                self._running = False
        try:
            outcome = step_outcome(response, job)
        except PoolWorkerError:  # an answer out of bounds: the session is not trusted with more
            self._end()
            raise
        self.hibernated = False
        if outcome.session_ended:
            self._end()
        return outcome

    def hibernate(self, cancel: Cancellation = NEVER) -> float:
        """Ask the worker to hibernate the session between steps; milliseconds (0: it was).

        A refusal (RequestError, SandboxSetupError) leaves the session as it
        was; any other failure has ended it, as a step's would.
        """
        answer = self._ask(pb.InteractRequest(hibernate=pb.HibernateSession()), "hibernated", cancel)
        self.hibernated = True
        return milliseconds(answer.hibernate_ms, "hibernate_ms")

    def fork(self, cancel: Cancellation = NEVER) -> tuple[RemoteSession, float]:
        """A new session on the same worker with this one's state now, on a stream of its own
        that attaches to it by the token the answer carries; and the milliseconds it took.

        Refusals as for :meth:`hibernate`. A fork the worker made but this side could not
        reach is a PoolWorkerError; the worker closes it when nobody attaches.
        """
        answer = self._ask(pb.InteractRequest(fork=pb.ForkSession()), "forked", cancel)
        fork_ms = milliseconds(answer.fork_ms, "fork_ms")
        self.hibernated = True  # a fork hibernates the session it copies
        stream = self._stream.sibling(pb.InteractRequest(attach=pb.AttachSession(token=answer.token)))
        try:
            attached = stream.answer("attached", SESSION_IMAGE_WAIT_S)
        except ReadieError as exc:
            raise PoolWorkerError(f"the fork was made but could not be reached: {exc}") from None
        fork = RemoteSession(stream, self.job, attached.session_id, self.address)
        fork.hibernated = True
        return fork, fork_ms

    # Files in the session's workspace (decision 31): between steps, one request and its answer
    # at a time, like hibernate; a refusal leaves the session as it was. A hibernated session is
    # resumed by the worker first.

    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel: Cancellation = NEVER) -> int:
        """Write ``data`` at ``offset`` of the ``size``-byte workspace file ``path``; the bytes it holds now."""
        answer = self._ask(upload_message(path, offset, data, size), "uploaded", cancel, FILE_ANSWER_WAIT_S)
        self.hibernated = False
        return self._checked(received_from_answer, answer, offset, data)

    def download_chunk(self, path: str, offset: int, length: int, *, cancel: Cancellation = NEVER) -> FileChunk:
        """At most ``length`` bytes of ``path`` from ``offset``, with the file's size and mtime."""
        answer = self._ask(download_message(path, offset, length), "downloaded", cancel, FILE_ANSWER_WAIT_S)
        self.hibernated = False
        return self._checked(chunk_from_answer, answer, path, offset, length)

    def list_files(self, path: str, *, cancel: Cancellation = NEVER) -> FileListing:
        """The entries of directory ``path`` (``"."``: the workspace), sorted, bounded."""
        answer = self._ask(list_message(path), "listed", cancel, FILE_ANSWER_WAIT_S)
        self.hibernated = False
        return self._checked(listing_from_answer, answer, path)

    def _checked(self, read: Callable[..., _T], *args: Any) -> _T:
        """An answer read by ``read``; one out of bounds ends the session (not trusted with more)."""
        try:
            return read(*args)
        except PoolWorkerError:
            self._end()
            raise

    def _ask(self, request: pb.InteractRequest, kind: str, cancel: Cancellation, within_s: float = SESSION_IMAGE_WAIT_S) -> Any:
        """Send a hibernate, fork or file request between steps and return its answer; a refusal
        raised as the worker's, after which the session goes on; anything else ends the session
        (SessionLost when the stream broke)."""
        with self._lock:
            if self.ended:
                raise RequestError(f"session {self.id} has ended", field="session")
            if self._running:
                raise RequestError(f"a step of session {self.id} is running; it can {request.WhichOneof('kind')} "
                                   "between steps", field="session")
            self._running = True
        try:
            self._stream.send(request)
            with cancel.stopping(self.close):
                answer = self._stream.answer(kind, within_s)
        except ReadieError as exc:
            self._end()
            if isinstance(exc, StreamBroken):
                raise SessionLost(f"the session ended: its worker at {self.address} was lost ({exc})") from None
            raise PoolWorkerError(f"the session ended: {exc}") from None
        finally:
            with self._lock:
                self._running = False
        refused = file_refusal(answer) if kind in FILE_EVENTS.values() else refusal(answer)
        if isinstance(refused, RequestError | SandboxSetupError):
            raise refused
        if refused is not None:  # a refusal no worker makes: not trusted with more
            self._end()
            raise refused
        return answer

    def close(self) -> None:
        """End the session; its sandbox is destroyed by the time this returns (or the worker is gone)."""
        with self._lock:
            if self.ended:
                return
            self.ended = True
            running = self._running
        if running:
            self._stream.cancel()  # the step's own read ends with it; the worker destroys the sandbox
        else:
            self._stream.close()

    def _end(self) -> None:
        with self._lock:
            self.ended = True
        self._stream.cancel()
