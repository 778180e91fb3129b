"""Host-function calls between the worker's job threads and the pool's client.

A job (or session step) that declared ``functions`` runs with a host
callback (:data:`readie_worker.jobs.HostFunction`), which the worker calls on
the job's thread for each call the sandbox made that passed its hostile-frame
checks (decision 8). :func:`host_function` makes that callback: it numbers
the call and writes its ``call`` event itself, on the job's thread, when the
line can go out at once (:meth:`HostCalls.post` is thread-safe; ``write_now``
writes a line that cannot block nor split another), else hands the line to
the event loop's writer; either way it tells the loop a call waits, and
blocks the job's thread on a future until one of:

* the client's reply line arrives (:meth:`HostCalls.deliver`): its result or
  error goes back into the sandbox;
* the task's deadline (``HostCall.deadline``, the monotonic time its timeout
  runs out) passes: the call is forgotten and answered with an error; the
  worker then ends the task with TimeoutError, since waiting for the host
  counts against the task's timeout;
* the pool stops reading stdin (EOF, a drain, stdout failing): no reply can
  come any more, so every waiting call, and every later one, is answered at
  once with an error (:meth:`HostCalls.close`), which the sandbox's code
  sees as ``readie_host.HostError``.

Call ids: the worker numbers each task's calls from 1, so two running jobs
both have a call 1. The client sees one pool-wide counter instead (from 1,
never reused while the pool runs), and a reply finds its call by that id
alone; the event's ``id`` says which request made the call. A reply whose
call id no call waits for (answered already, given up at its deadline, its
task ended, or never made) is answered by the engine with a RequestError.

:meth:`HostCalls.post` returns the event's line; the callback writes it or
hands it to the engine, which puts it on stdout. A task that streams its
output hands every call line to the engine: its output events go through the
engine's queue, and a call must not overtake the output written before it.
Args can nest as deep as the worker's
parser allows (a 1 MB frame can nest 500,000 deep), so the line is encoded
with :func:`readie_executor.hostwire.dumps`, which is iterative.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, InvalidStateError
from dataclasses import dataclass, field

import structlog
from readie_worker.jobs import HostCall, HostFunction, HostReply
from readie_policy.jobs import MAX_EARLY_REPLY_BYTES

from readie_protocol.events import CallEvent
from readie_protocol.requests import ReplyRequest
from readie_protocol.wire import RequestId

__all__ = ["HostCalls", "WaitingCall", "host_function"]

log = structlog.get_logger("readie.pool")

@dataclass(eq=False)
class WaitingCall:
    """One call from a job's thread, waiting for its reply."""

    request_id: RequestId
    call: HostCall
    reply: Future[HostReply] = field(default_factory=Future)
    call_id: int | None = None  # the pool's, once posted


def settle(waiting: WaitingCall, reply: HostReply) -> bool:
    """Answer ``waiting``; False when its thread gave up on it already (or it was answered)."""
    try:
        waiting.reply.set_result(reply)
    except InvalidStateError:
        return False
    return True


class HostCalls:
    """The calls waiting for a reply, by the pool's call id: posted on the job threads, answered,
    forgotten and closed on the event loop; one lock keeps the numbering and the table whole."""

    def __init__(self, encode: Callable[[CallEvent], bytes]) -> None:
        # The pool connection's (it reads no state of its own for a call event, so any thread may):
        # hostwire writes the values as the sandbox sent them.
        self._encode = encode
        self._lock = threading.Lock()
        self._waiting: dict[int, WaitingCall] = {}
        self._last_id = 0
        self.closed: str | None = None  # why no reply can come any more, once that is so

    def __len__(self) -> int:
        return len(self._waiting)

    def post(self, waiting: WaitingCall) -> bytes | None:
        """Number ``waiting`` and return its call event line, or None when it is answered at once."""
        call = waiting.call
        with self._lock:
            if waiting.reply.done():  # its thread gave up already
                return None
            if self.closed is not None:
                settle(waiting, HostReply(error=f"{call.function}: {self.closed}"))
                return None
            self._last_id += 1
            call_id = self._last_id
            waiting.call_id = call_id
            self._waiting[call_id] = waiting
        try:
            return self._encode(CallEvent(waiting.request_id, call_id, call.function, list(call.args), dict(call.kwargs)))
        except (TypeError, ValueError) as exc:  # cannot happen for what hostwire parsed; never hang on it
            self.forget(waiting)
            settle(waiting, HostReply(error=f"{call.function}: the call cannot be sent: {exc}"))
            return None

    def deliver(self, reply: ReplyRequest, line_bytes: int) -> bool:
        """Hand ``reply`` (from a line of ``line_bytes``) to the call it names; False when it reached
        no call (none waits for it, or its thread gave up on it and nothing of it was sent).

        Where the worker lets it (``HostCall.reply_now``), a reply from a short line goes into the
        sandbox from here, the event loop, before the job's thread is woken: under the GIL that
        thread runs only once the loop is idle again, and the sandbox need not wait for it.
        """
        with self._lock:
            waiting = self._waiting.pop(reply.call_id, None)
        if waiting is None:
            return False
        answer = HostReply(result=reply.result, error=reply.error)
        reply_now = waiting.call.reply_now if line_bytes <= MAX_EARLY_REPLY_BYTES else None
        sent = False
        try:
            sent = reply_now is not None and reply_now(answer)
        except Exception:  # a bug (or no memory) costs this send, never the call nor the pool's intake
            log.exception("sending a host call's reply from the event loop failed")
        return settle(waiting, answer) or sent

    def forget(self, waiting: WaitingCall) -> None:
        """``waiting``'s thread stopped waiting (its deadline): a reply to it is now a late one."""
        with self._lock:
            if waiting.call_id is not None and self._waiting.get(waiting.call_id) is waiting:
                del self._waiting[waiting.call_id]

    def close(self, why: str) -> None:
        """No reply can come any more: answer every waiting call, and every later one, with ``why``."""
        with self._lock:
            if self.closed is None:
                self.closed = why
            waiting, self._waiting = list(self._waiting.values()), {}
        for call in waiting:
            settle(call, HostReply(error=f"{call.call.function}: {self.closed}"))


def host_function(
    loop: asyncio.AbstractEventLoop,
    calls: HostCalls,
    write_now: Callable[[bytes], bool] | None,
    posted: Callable[[bytes | None], None],
    request_id: RequestId,
) -> HostFunction:
    """The worker's host callback for the request ``request_id``: runs on a job thread.

    Each call is numbered in ``calls`` and its line written by ``write_now``
    (None: never here) if it can go out at once; ``posted`` then runs on
    ``loop`` with None (the loop counts the call and lets intake read ahead
    for its reply), or with the line, which the loop writes instead.
    """

    def host(call: HostCall) -> HostReply:
        if call.deadline is not None and time.monotonic() >= call.deadline:
            # Never posted: the client may still be answering this task's last call, and a second
            # call of one request while it does is one no client takes (the protocol's order).
            return HostReply(error=f"{call.function}: the task's timeout has passed")
        waiting = WaitingCall(request_id, call)
        line = calls.post(waiting)
        if line is not None:
            written = write_now is not None and write_now(line)
            try:
                loop.call_soon_threadsafe(posted, None if written else line)
            except RuntimeError:  # the loop is closed: the pool is gone
                calls.forget(waiting)
                return HostReply(error=f"{call.function}: the pool is shutting down")
        timeout = None if call.deadline is None else max(0.0, call.deadline - time.monotonic())
        try:
            return waiting.reply.result(timeout)
        except TimeoutError:
            if not waiting.reply.cancel():  # a reply came in the meantime
                return waiting.reply.result()
            calls.forget(waiting)
            return HostReply(error=f"{call.function}: no reply from the client within the task's timeout")

    return host
