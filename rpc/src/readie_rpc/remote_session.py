"""The calling side of the ``Interact`` stream: host calls answered here, sessions on another worker.

:class:`InteractStream` (:mod:`._interact_stream`) is one stream from
:class:`~readie_rpc.client.WorkerClient`. :class:`RemoteSession` is a session that lives in a sandbox on the worker at
the other end, with the shape of the worker's own
:class:`~readie_worker.sessions.SandboxSession`, so a router serves both alike.

A session without a key is the stream: it cannot move to another worker,
and when the stream breaks (the worker died, drained, or was restarted at
the same address) the session has ended. The step that finds out fails with
a PoolWorkerError saying so; nothing ever starts a fresh session in its place.

A session with a key (decision 32) outlives its stream. When the worker
hands it over (a drain: ``handed_over``, in place of an answer to a request
it did not start) or its stream broke between requests, the next request
first re-attaches through the ``reconnect`` its owner gave (the key, and
``take_over`` after a break: its holder was lost), then runs there. When the
stream breaks while a request runs, that request is lost (:class:`StepLost`:
it may have run in part, so it is never sent again) and the session goes on
at its next request.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, TypeVar

import structlog

from ._client_wire import session_step_message, step_outcome
from ._convert import session_step
from ._files_wire import (
    FILE_EVENTS, chunk_from_answer, download_message, file_refusal, list_message, listing_from_answer, received_from_answer, upload_message,
)
from ._interact_stream import (
    CLOSE_WAIT_S, DEADLINE_MARGIN_S, HandedOver, InteractStream, SessionLost, StreamBroken, StreamEnd,
)
from ._session_wire import milliseconds, refusal, session_key
from ._status import Unreachable
from ._proto.readie.v1 import worker_pb2 as pb
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import PoolWorkerError, ReadieError, RequestError, SandboxSetupError, StepLost
from readie_policy.jobs import CodeJob, HostFunction, OutputSink, Step, StepOutcome
from readie_protocol.workspace import FileChunk, FileListing

__all__ = [
    "CLOSE_WAIT_S", "DEADLINE_MARGIN_S", "InteractStream", "Reconnect", "RemoteSession", "SessionLost", "StreamBroken",
]

_T = TypeVar("_T")
log = structlog.get_logger("readie.grpc")

# A session re-attached after a hand-over may meet a worker that drains too (a rolling restart):
# each re-attach moves it on, but this many hand-overs for one request means none keeps it.
MAX_HAND_OVERS_PER_REQUEST = 3


# How long a hibernate's (or fork's) answer may take: a router waits up to a minute for a slot
# on the session's worker (PLACEMENT_WAIT_S), the worker 20 s for its own (sessions.py), the
# checkpoint under a second. Past this the worker is taken for wedged, and the session ends.
SESSION_IMAGE_WAIT_S = 120.0
# How long the answer to a file request may take: a chunk is quick, but a hibernated session is
# resumed first, which may take as long as a hibernation.
FILE_ANSWER_WAIT_S = SESSION_IMAGE_WAIT_S


#: What a session's owner gives it to continue on a new stream (decision 32): ``reconnect(key,
#: take_over)`` attaches to the session stored under ``key`` (wherever its owner chooses) and
#: returns it there, with the number of the step its stored state is from; the session adopts
#: that stream. Raises as ``attach_session`` does.
Reconnect = Callable[[str, bool], "tuple[RemoteSession, int]"]


class RemoteSession:
    """A session in a sandbox on another worker; see the module docstring."""

    def __init__(
        self, stream: InteractStream, job: CodeJob, session_id: str, address: str, *, files: bool = True,
        key: str | None = None, reconnect: Reconnect | None = None, step: int = 0,
    ) -> None:
        self.id = session_id
        self.job = job  # the setup, as opened (or, attached by key, as its worker holds it)
        self.address = address
        self.key = key  # decision 32: with it, the session outlives its stream
        self.reconnect = reconnect  # its owner's: a router replaces it with its own placement
        self._files = files  # its worker takes files (WorkerClient.files)
        self._stream = stream
        self._lock = threading.Lock()  # one step at a time
        self._running = False
        self._take_over: bool | None = None  # set when the stream ended: re-attach first (taking over after a break)
        self.ended = False
        self.hibernated = False  # as the worker answered; its next step resumes it
        # The number of the last step answered (or, attached, the stored one): a re-attach to older
        # state than this, other than a take-over after a crash, is a rollback and is refused.
        self.step = step

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
        StepLost when the stream broke under the step of a session with a key
        (the session goes on, from its last stored state); SessionLost when the
        stream of one without broke under it; PoolWorkerError when the worker
        ended the session otherwise. After either of the last two, the session
        has ended. ``cancel`` ends the stream, which stops the step (and ends a
        session without a key).
        """
        self._check_files(step.files or step.collect)
        message = session_step_message(step)
        message.stream_output = output is not None
        session_step(message)  # the worker's own checks, here, so a refusal does not cost the session
        job = self.job.step(step)
        task_s = job.timeout_ms / 1000
        response = self._exchange(
            pb.InteractRequest(step=message), "step",
            lambda stream: stream.result(host, task_s, task_s + DEADLINE_MARGIN_S, output=output, max_output=job.max_output),
            cancel,
        )
        try:
            outcome = step_outcome(response, job)
        except PoolWorkerError:  # an answer out of bounds: the session is not trusted with more
            self._end()
            raise
        if response.lost and not outcome.session_ended:  # a router lost the worker under the step: it goes on
            error = outcome.outcome.error
            raise StepLost(error.message if error is not None else "the step was lost with its worker")
        self.hibernated = False
        self.step = outcome.step
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
            key = session_key(attached, "key")
        except ReadieError as exc:
            stream.cancel()
            raise PoolWorkerError(f"the fork was made but could not be reached: {exc}") from None
        fork = RemoteSession(
            stream, self.job, attached.session_id, self.address, files=self._files, key=key, reconnect=self.reconnect,
            step=attached.step,  # a fork numbers its steps afresh
        )
        fork.hibernated = True
        return fork, fork_ms

    # Files in the session's workspace (decision 31): between steps, one request and its answer
    # at a time, like hibernate; a refusal leaves the session as it was. A hibernated session is
    # resumed by the worker first.

    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel: Cancellation = NEVER) -> int:
        """Write ``data`` at ``offset`` of the ``size``-byte workspace file ``path``; the bytes it holds now."""
        self._check_files(True)
        answer = self._ask(upload_message(path, offset, data, size), "uploaded", cancel, FILE_ANSWER_WAIT_S)
        self.hibernated = False
        return self._checked(received_from_answer, answer, offset, data)

    def download_chunk(self, path: str, offset: int, length: int, *, cancel: Cancellation = NEVER) -> FileChunk:
        """At most ``length`` bytes of ``path`` from ``offset``, with the file's size and mtime."""
        self._check_files(True)
        answer = self._ask(download_message(path, offset, length), "downloaded", cancel, FILE_ANSWER_WAIT_S)
        self.hibernated = False
        return self._checked(chunk_from_answer, answer, path, offset, length)

    def list_files(self, path: str, *, cancel: Cancellation = NEVER) -> FileListing:
        """The entries of directory ``path`` (``"."``: the workspace), sorted, bounded."""
        self._check_files(True)
        answer = self._ask(list_message(path), "listed", cancel, FILE_ANSWER_WAIT_S)
        self.hibernated = False
        return self._checked(listing_from_answer, answer, path)

    def _check_files(self, asked: object) -> None:
        """An older worker would drop a step's files unread, and end the stream at an upload:
        refused here, before anything is sent, and the session goes on."""
        if asked and not self._files:
            raise SandboxSetupError(f"the session's worker at {self.address} takes no files (an older protocol)")

    def _checked(self, read: Callable[..., _T], *args: Any) -> _T:
        """An answer read by ``read``; one out of bounds ends the session (not trusted with more)."""
        try:
            return read(*args)
        except PoolWorkerError:
            self._end()
            raise

    def _ask(self, request: pb.InteractRequest, kind: str, cancel: Cancellation, within_s: float = SESSION_IMAGE_WAIT_S) -> Any:
        """Send a hibernate, fork or file request between steps and return its answer; a refusal
        raised as the worker's, after which the session goes on; anything else as for a step."""
        answer = self._exchange(request, request.WhichOneof("kind"), lambda stream: stream.answer(kind, within_s), cancel)
        refused = file_refusal(answer) if kind in FILE_EVENTS.values() else refusal(answer)
        if isinstance(refused, RequestError | SandboxSetupError):
            raise refused
        if refused is not None:  # a refusal no worker makes: not trusted with more
            self._end()
            raise refused
        return answer

    def _exchange(self, request: pb.InteractRequest, what: str, read: Callable[[InteractStream], _T], cancel: Cancellation) -> _T:
        """Send ``request`` and ``read`` its answer, one at a time: re-attached first when the
        stream ended since the last (a session with a key), and sent again, once re-attached,
        when the worker hands the session over instead of starting it."""
        with self._lock:
            if self.ended:
                raise RequestError(f"session {self.id} has ended", field="session")
            if self._running:
                raise RequestError(f"a step of session {self.id} is running; it can {what} between steps", field="session")
            self._running = True
        try:
            for _ in range(MAX_HAND_OVERS_PER_REQUEST):
                self._reattach_if_ended(cancel)
                self._stream.send(request)
                try:
                    with cancel.stopping(self._stop):
                        return read(self._stream)
                except HandedOver:
                    self._take_over = False  # its holder let go in good order: nothing to take from it
                except ReadieError as exc:
                    raise self._failed(exc, what) from None
            self._end()
            raise PoolWorkerError(f"the session was handed over {MAX_HAND_OVERS_PER_REQUEST} times before its {what} could start")
        finally:
            with self._lock:
                self._running = False

    def _failed(self, exc: ReadieError, what: str) -> ReadieError:
        """What a request whose stream ended under it raises; the session ends, unless it has a key
        and its stream broke: then the request is lost, and the session goes on elsewhere."""
        stopped = self.ended  # _stop cancelled the stream under the request
        if isinstance(exc, StreamBroken) and self.key is not None and not stopped:
            self._stream.cancel()
            self._take_over = True
            return StepLost(
                f"the {what} was lost with the stream to {self.address} ({exc}); it may have run in part "
                "and is not run again; the session goes on at its next request"
            )
        self._end()
        if stopped:
            return PoolWorkerError(f"the session was closed while its {what} ran")
        if isinstance(exc, StreamBroken):
            return SessionLost(
                f"the session ended: its worker at {self.address} was lost ({exc}); "
                "its state is gone, and only a new session can go on"
            )
        return PoolWorkerError(f"the session ended: {exc}")

    def _reattach_if_ended(self, cancel: Cancellation) -> None:
        """Before a request: if the stream ended since the last (a hand-over, a break), attach to
        the session anew through ``reconnect``. A session without a key, or without a way to
        reconnect, has ended with its stream; a refusal of the key (the session expired or was
        closed) ends it too; anything else leaves it to be tried again at the next request."""
        if self._take_over is None and self._stream.ended():
            self._take_over = not self._stream.handed_over()
        if self._take_over is None:
            return
        if self.key is None or self.reconnect is None:
            self._end()
            raise SessionLost(
                f"the session ended: its worker at {self.address} was lost (its stream ended between requests); "
                "its state is gone, and only a new session can go on"
            ) from None
        self._stream.cancel()
        try:
            with cancel.stopping(self._stream.cancel):
                fresh, stored = self.reconnect(self.key, self._take_over)
        except RequestError as refused:  # not stored (expired, closed, a store of its worker's own)
            self._end()
            raise SessionLost(f"the session ended: it cannot be continued ({refused})") from None
        # Nobody answers where it was (the stream broke, or the connect was refused): a worker
        # of its own is gone with it.
        except (StreamBroken, Unreachable) as exc:
            self._end()
            raise SessionLost(
                f"the session ended: its worker at {self.address} was lost and it could not be attached again ({exc})"
            ) from None
        if stored < self.step and not self._take_over:
            fresh._end()  # its worker keeps the stored entry; nothing runs on it from here
            self._end()
            raise PoolWorkerError(
                f"the session ended: its stored state is from step {stored}, older than its last answered "
                f"step {self.step} (a rollback); it is not run on older state"
            )
        self._stream, self.address, self._files, self.id = fresh._stream, fresh.address, fresh._files, fresh.id
        self._take_over = None
        self.hibernated = True  # the store holds it: its next step resumes it

    def detach(self, cancel: Cancellation = NEVER) -> None:  # noqa: ARG002 - bounded by SESSION_IMAGE_WAIT_S
        """Let go of the session without ending it (decision 32): the stream ends without a
        ``close``, so its worker detaches it into the store. A session without a key is closed."""
        if self.key is None:
            self.close()
            return
        with self._lock:
            if self.ended:
                return
            self.ended = True
        self._stream.close(SESSION_IMAGE_WAIT_S)

    def close(self) -> None:
        """End the session for good (``close``: its sandbox destroyed, its image gone from the
        store) by the time this returns, or the worker is gone. One whose stream ended meanwhile
        is attached again first, where its owner can, so that its stored image goes too; so is
        one a drain handed over, or whose worker went away, before it read the ``close``."""
        for _ in range(MAX_HAND_OVERS_PER_REQUEST):
            if not self._close_once():
                return
        log.info("a session handed over under its close each time; the store's TTL ends it", session=self.id)

    def _close_once(self) -> bool:
        """:meth:`close`, once; True when a drain handed the session over, or its worker went
        away, before the ``close`` reached it (it is stored still: close it where it went)."""
        with self._lock:
            if self.ended:
                return False
            running = self._running
        if running:
            self._stop()
            return False
        if self.key is not None and self._take_over is None and self._stream.ended():
            self._take_over = not self._stream.handed_over()
        if self._take_over is not None and self.key is not None and self.reconnect is not None:
            try:
                self._reattach_if_ended(NEVER)
            except ReadieError as exc:  # nothing to close there, or nobody to ask: the store's TTL ends it
                log.info("a session whose stream ended could not be closed", session=self.id, error=str(exc))
        with self._lock:
            if self.ended:
                return False
            self.ended = True
        if self.key is None:  # its stream was its life: ending it is enough (and older workers know no close)
            self._stream.close()
            return False
        self._stream.send(pb.InteractRequest(close=pb.CloseSession()))
        end = self._stream.close()
        if end is StreamEnd.CLOSED or self.reconnect is None:
            return False
        # Handed over under the close, or its worker gone before it read the close (its image
        # stays stored): attach where it went, taking it over from a worker gone, and close it there.
        with self._lock:
            self.ended = False
        self._take_over = end is StreamEnd.BROKEN
        return True

    def _stop(self) -> None:
        """Cancel the stream under a running request (its caller gave up): the worker stops it and
        ends the session, or, one with a key, detaches it; this handle has ended either way."""
        with self._lock:
            self.ended = True
        self._stream.cancel()

    def _end(self) -> None:
        with self._lock:
            self.ended = True
        self._stream.cancel()
