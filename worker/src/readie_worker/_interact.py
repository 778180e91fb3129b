"""The serving side of the ``Interact`` stream: a job or a session, its host calls relayed to the client.

One stream, three threads, each blocking on one thing:

* the *reader* pulls the client's messages off the request stream into a
  bounded inbox (grpc's own flow control pushes back when it is full);
* the *driver* runs the job, or opens the session and runs its steps, on the
  runner (the in-process :class:`~readie_worker.core.Worker`, or a router's
  placement). Its host callback puts a ``call`` event in the outbox and waits
  in the inbox for the matching ``reply``, up to the task's deadline;
* grpc's handler thread yields the outbox's events onto the response stream.

The stream is the session's life: when the client closes its side, cancels,
or goes away, the mailboxes close, a waiting call is answered with an error,
and the driver closes the session (its sandbox is destroyed). A client that
breaks the protocol (a first message that is neither ``job`` nor
``open_session``, or none within :data:`FIRST_MESSAGE_S`; anything but a
reply while a host call waits; a reply that is not JSON) gets
INVALID_ARGUMENT naming the field, and its session ends. Steps sent before
the previous one's result are not a break: they wait in the inbox and run
in order.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, TypeVar

import grpc
import structlog

from ._convert import code_job, run_job_response, session_step
from ._host_wire import call_message, reply_from_message
from ._proto.readie.v1 import worker_pb2 as pb
from .errors import PoolWorkerError, RequestError
from .jobs import HostCall, HostReply
from .runner import JobRunner, SessionHandle
from .sessions import StepOutcome

__all__ = ["Interaction", "Mailbox"]

log = structlog.get_logger("readie.grpc")

# A client that keeps to the protocol has one message in flight (a step, or
# the reply to the one waiting call); a few more absorb a late reply racing
# the next step. Beyond that the reader stops reading and grpc pushes back.
INBOX_MESSAGES = 4
# Events waiting for grpc to send them. The driver blocks past this, and the
# job with it: a client that stops reading stops its own job's calls.
OUTBOX_EVENTS = 4
# Replies to no waiting call that one stream may send: a reply can honestly
# lose a race with the task's deadline, but not thousands of times.
MAX_STALE_REPLIES = 64
# A stream holds a server thread from its start: one that does not say what
# it wants within this long is refused, and its thread freed.
FIRST_MESSAGE_S = 30.0

_T = TypeVar("_T")


class _Closed:
    """What a closed, empty mailbox gives instead of an item."""


CLOSED = _Closed()


class Mailbox(Generic[_T]):
    """A bounded queue one side can close: puts then fail, gets drain what is left, then CLOSED."""

    def __init__(self, bound: int) -> None:
        self._items: deque[_T] = deque()
        self._bound = bound
        self._closed = False
        self._changed = threading.Condition()

    def put(self, item: _T) -> bool:
        """Wait for room; False (and the item dropped) once the mailbox is closed."""
        with self._changed:
            self._changed.wait_for(lambda: self._closed or len(self._items) < self._bound)
            if self._closed:
                return False
            self._items.append(item)
            self._changed.notify_all()
            return True

    def get(self, timeout: float | None = None) -> _T | _Closed | None:
        """The next item; CLOSED once closed and drained; None when ``timeout`` passes first."""
        with self._changed:
            if not self._changed.wait_for(lambda: self._closed or self._items, timeout):
                return None
            if not self._items:
                return CLOSED
            item = self._items.popleft()
            self._changed.notify_all()
            return item

    def close(self) -> None:
        with self._changed:
            self._closed = True
            self._changed.notify_all()


class Interaction:
    """One Interact stream; :meth:`events` is the handler's response iterator."""

    def __init__(
        self,
        runner: JobRunner,
        requests: Iterator[pb.InteractRequest],
        context: grpc.ServicerContext,
        job_id: str,
        bind: Callable[..., None] = lambda **fields: None,
    ) -> None:
        self._runner = runner
        self._requests = requests
        self._time_remaining = context.time_remaining
        self._job_id = job_id
        self._bind = bind  # the call's log line
        self._inbox: Mailbox[pb.InteractRequest] = Mailbox(INBOX_MESSAGES)
        self._outbox: Mailbox[pb.InteractEvent] = Mailbox(OUTBOX_EVENTS)
        self._error: BaseException | None = None
        self._broken: RequestError | None = None  # the client broke the protocol during a call
        self._stale_replies = 0
        # Called when the RPC ends for any reason, cancellation included: a
        # handler blocked on the outbox, or a driver blocked on the inbox, wakes.
        context.add_callback(self._hang_up)

    def events(self) -> Iterator[pb.InteractEvent]:
        """Events for the client, in order; raises what ended the stream badly (mapped by the caller)."""
        threading.Thread(target=self._read, name="interact-read", daemon=True).start()
        # Not joined: after a hang-up the driver finishes its job (the worker's
        # slot and deadline bound it) and closes the session on its own.
        threading.Thread(target=self._drive, name="interact-drive", daemon=True).start()
        while not isinstance(event := self._outbox.get(), _Closed):
            assert event is not None  # no timeout given
            yield event
        if self._error is not None:
            raise self._error

    def _hang_up(self) -> None:
        self._inbox.close()
        self._outbox.close()

    def _read(self) -> None:
        try:
            for request in self._requests:
                if not self._inbox.put(request):
                    return
        except Exception:  # noqa: BLE001 - the stream broke: the same as the client's side closing
            pass
        finally:
            self._inbox.close()

    # -- the driver ---------------------------------------------------------

    def _drive(self) -> None:
        session: SessionHandle | None = None
        try:
            first = self._inbox.get(FIRST_MESSAGE_S)
            if first is None:
                raise RequestError(f"no job or open_session within {FIRST_MESSAGE_S:.0f} s", field="kind")
            if isinstance(first, _Closed):
                return  # the client left before asking anything
            kind = first.WhichOneof("kind")
            if kind == "job":
                job = code_job(first.job, self._time_remaining())
                self._bind(kind="job", checkpoint=job.checkpoint, functions=len(job.functions))
                outcome = self._runner.run_job(job, self._job_id, host=self._relay)
                self._check_protocol()
                self._send(pb.InteractEvent(result=run_job_response(outcome)))
            elif kind == "open_session":
                job = code_job(first.open_session, self._time_remaining())
                self._bind(kind="session", checkpoint=job.checkpoint, functions=len(job.functions))
                session, step = self._runner.open_session(job, self._job_id, host=self._relay)
                self._bind(session=session.id)
                self._serve_session(session, step)
            else:
                raise RequestError("the first message must be a job or open_session", field=kind or "kind")
        except BaseException as exc:  # noqa: BLE001 - reported to the client by events()
            self._error = exc
        finally:
            try:
                if session is not None:
                    session.close()
            finally:
                self._outbox.close()

    def _serve_session(self, session: SessionHandle, step: StepOutcome) -> None:
        while True:
            self._check_protocol()
            self._send(pb.InteractEvent(result=run_job_response(step.outcome, step, session.id)))
            self._bind(steps=step.step)
            if step.session_ended:
                return
            request = self._next_request()
            if request is None:  # the client closed its side: the session ends with the stream
                return
            if request.WhichOneof("kind") != "step":
                raise RequestError("an open session takes steps only", field=request.WhichOneof("kind") or "kind")
            asked = session_step(request.step)
            if session.ended:  # the worker closed it between steps (a drain): not the client's doing
                raise PoolWorkerError(f"session {session.id} was closed by the worker")
            step = session.run_step(
                asked.code,
                asked.name,
                asked.args,
                asked.timeout_ms,
                asked.max_output,
                job_id=self._job_id,
                host=self._relay,
            )

    def _next_request(self) -> pb.InteractRequest | None:
        """The client's next step (or first message), skipping stale replies; None once its side closed."""
        while True:
            message = self._inbox.get()
            if isinstance(message, _Closed) or message is None:
                return None
            if message.WhichOneof("kind") != "reply":
                return message
            self._stale_reply()

    def _send(self, event: pb.InteractEvent) -> bool:
        return self._outbox.put(event)

    # -- host calls, on the driver's thread inside the job -------------------

    def _relay(self, call: HostCall) -> HostReply:
        """The runner's host callback: the call to the client, its reply back."""
        if self._broken is not None or not self._send(pb.InteractEvent(call=call_message(call))):
            return HostReply(error=f"{call.function}: the client is gone")
        while True:
            remaining = None if call.deadline is None else max(0.0, call.deadline - time.monotonic())
            message = self._inbox.get(remaining)
            if message is None:
                return HostReply(error=f"{call.function}: no reply from the client before the task's deadline")
            if isinstance(message, _Closed):
                return HostReply(error=f"{call.function}: the client closed the stream")
            try:
                call_id, reply = self._reply_of(message)
                if call_id == call.call_id:
                    return reply
                self._stale_reply()
            except RequestError as exc:
                self._broken = exc  # raised once the job has ended; the job sees a failed call
                self._inbox.close()
                return HostReply(error=f"{call.function}: the client broke the protocol")

    def _reply_of(self, message: pb.InteractRequest) -> tuple[int, HostReply]:
        kind = message.WhichOneof("kind")
        if kind != "reply":
            raise RequestError("only a reply may come while a host call waits", field=kind or "kind")
        return reply_from_message(message.reply)

    def _stale_reply(self) -> None:
        self._stale_replies += 1
        if self._stale_replies > MAX_STALE_REPLIES:
            raise RequestError(f"more than {MAX_STALE_REPLIES} replies to no waiting call", field="reply.call_id")

    def _check_protocol(self) -> None:
        if self._broken is not None:
            raise self._broken
