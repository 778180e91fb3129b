"""One ``Interact`` call from the calling side: requests written, events read in order, host calls answered.

:class:`InteractStream` is what :class:`~readie_rpc.client.WorkerClient` opens
for a job or a session (:mod:`readie_rpc.remote_session`): it writes
requests, reads events until a result (or an answer), and answers each
``call`` event with the caller's host function on the caller's own thread.
A host that receives the reply on another thread (``readie pool``'s event
loop, a router's stream reader) puts it on the stream from there, through
the call's ``reply_now`` (:class:`RelayedReply`): the caller's thread need
not wake first, and each hop of a routed call saves that wake.
"""

from __future__ import annotations

import dataclasses
import enum
import queue
import threading
from collections.abc import Callable, Collection, Sequence
from typing import Any

import grpc

from readie_executor.hostwire import MAX_CALLS_PER_TASK, OUTPUT_STREAMS
from readie_executor.jobs import bounds

from ._alarms import after
from ._host_wire import call_from_message, output_from_message, reply_message
from ._proto.readie.v1 import worker_pb2 as pb
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from ._status import WorkerLost, answered_by_readie, readie_errors
from readie_protocol.errors import PoolWorkerError
from readie_policy.jobs import HostFunction, HostReply, OutputSink, ask_host, max_output_events

__all__ = ["CLOSE_WAIT_S", "DEADLINE_MARGIN_S", "HandedOver", "InteractStream", "SessionLost", "StreamBroken"]

# Beyond a job's (or step's) own timeout: the worker enforces the timeout; this
# only keeps a worker that stopped answering from holding the caller forever.
DEADLINE_MARGIN_S = 30.0
# How long closing a session waits for the worker to confirm its sandbox is gone.
CLOSE_WAIT_S = 10.0
_END = None


class StreamBroken(WorkerLost):
    """The stream ended without the worker's word: the connection or the worker process went away."""


class SessionLost(StreamBroken):
    """A session's stream broke: its worker died, drained or restarted, and the session with it."""


class HandedOver(Exception):
    """The worker drained and handed the session over in place of answering: what was sent did
    not start there (decision 32). Not a ReadieError: the session catches it and re-attaches."""


class StreamEnd(enum.Enum):
    """How a stream we closed ended: what became of the request sent last."""

    CLOSED = "closed"  # the worker ended it, or our wait did: over
    HANDED_OVER = "handed_over"  # a drain took the session before it read the request
    BROKEN = "broken"  # the worker went away first: the request may never have reached it


class RelayedReply:
    """A relayed call's ``reply_now``: its reply put on the stream by whichever thread has it
    first, once; never after the caller's thread has its reply (:meth:`close`)."""

    def __init__(self, send: Callable[[HostReply], None]) -> None:
        self._send = send  # never blocks: a put on the stream's request queue
        self._lock = threading.Lock()
        self._open = True
        self._sent = False

    def __call__(self, reply: HostReply) -> bool:
        with self._lock:  # held over the put: the caller's thread, once closed, sends after it
            if not self._open or self._sent:
                return False
            self._send(reply)
            self._sent = True
            return True

    def close(self) -> bool:
        """On the caller's thread, its host having returned: whether the reply went already."""
        with self._lock:
            self._open = False
            return self._sent


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

    def declare(self, functions: Collection[str]) -> None:
        """The host functions whose calls this stream answers, once known: an attach by key
        learns them from its answer (``SessionAttached.setup``)."""
        self._functions = frozenset(functions)

    def send(self, request: pb.InteractRequest) -> None:
        self._requests.put(request)

    def _reply(self, call_id: int, reply: HostReply) -> None:
        self.send(pb.InteractRequest(reply=reply_message(call_id, reply)))

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
        watchdog = after(within_s, self._give_up) if within_s is not None else None
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
                if kind == "handed_over":
                    raise HandedOver()
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
                if host is None:
                    self._reply(call.call_id, HostReply(error=f"{call.function}: no host here"))
                    continue
                early = RelayedReply(lambda reply, call_id=call.call_id: self._reply(call_id, reply))
                reply = ask_host(host, dataclasses.replace(call, reply_now=early))
                if not early.close():
                    self._reply(call.call_id, reply)
        except BaseException:
            self.cancel()
            raise
        finally:
            if watchdog is not None:
                watchdog.cancel()

    def answer(self, kind: str, within_s: float) -> Any:
        """The next event, which must be a ``kind`` (``hibernated``, ``forked``, ``attached``): its
        message; PoolWorkerError (and the stream over) for any other, or none within ``within_s``."""
        watchdog = after(within_s, self._give_up)
        try:
            event = self._next_event(within_s)
            if event.WhichOneof("kind") == "handed_over" and kind != "attached":
                raise HandedOver()
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

    def ended(self) -> bool:
        """Whether the call is over already, before anything more is sent on it."""
        return self._call.done()

    def handed_over(self) -> bool:
        """Whether a stream that ended (:meth:`ended`) said ``handed_over`` before it did."""
        try:
            return any(event.WhichOneof("kind") == "handed_over" for event in self._call)
        except grpc.RpcError:
            return False

    def _give_up(self) -> None:
        self._overdue.set()
        self.cancel()

    def close(self, wait_s: float = CLOSE_WAIT_S) -> StreamEnd:
        """Close this side and wait (up to ``wait_s``) for the worker to end the stream; how it
        ended (:class:`StreamEnd`)."""
        self._requests.put(_END)
        timer = after(wait_s, self._call.cancel)
        end = StreamEnd.CLOSED
        try:
            for event in self._call:  # an honest worker sends nothing more, or hands over
                if event.WhichOneof("kind") == "handed_over":
                    end = StreamEnd.HANDED_OVER
        except grpc.RpcError as error:
            # Cancelled (our wait ran out) or ended by the worker with an error: over. The
            # connection gone before the worker ended it (a worker killed): it may not have read
            # the last request, and a session it held is still stored.
            if end is StreamEnd.CLOSED and error.code() == grpc.StatusCode.UNAVAILABLE and not answered_by_readie(error):
                end = StreamEnd.BROKEN
        finally:
            timer.cancel()
        return end

    def cancel(self) -> None:
        self._requests.put(_END)  # else grpc's request thread waits on the queue forever
        self._call.cancel()
