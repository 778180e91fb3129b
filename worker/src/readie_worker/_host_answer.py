"""What a running job's frames get from the worker: host calls answered, output relayed.

:class:`HostAnswer` is :meth:`Sandbox.exchange`'s ``answer`` for a job: it runs
on the job's thread, and so does the host callback it asks, which blocks until
the host's reply (decision 8).

A host that receives the reply on another thread (``readie pool``'s event loop
reads it from stdin) would have to wake the job's thread to send it, and under
the GIL that wake waits for the loop to go idle: two thread wake-ups on every
call's path. So each call carries ``reply_now`` (:class:`EarlyReply`): called
on that other thread, it encodes the reply frame there and puts it in the
sandbox's socket if the socket takes it without waiting. The job's thread,
woken after, sends what is left: nothing; the rest of a frame the socket took
only part of; or the whole frame, when the socket was full or the frame too
large to go in one write. Either way the frame goes out whole and in order,
and one thread at a time writes: the other thread only while the job's thread
waits for this call, the job's thread only after it has shut that door.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable

from readie_executor.framing import encode_message

from ._host_frames import HostConversation, HostReply, RefusedFrame, is_call_frame
from ._output_frames import OutputRefused, OutputRelay, is_output_frame
from .sandbox import NO_REPLY, SINGLE_WRITE_BYTES, UnsentRest
from readie_policy.jobs import HostFunction, ask_host

__all__ = ["EarlyReply", "HostAnswer"]


class EarlyReply:
    """One call's reply, sent by the thread that receives it when the socket takes it at once,
    else by the job's thread (:meth:`take_over`)."""

    def __init__(
        self, encode: Callable[[HostReply], bytes], send_now: Callable[[bytes], int], deadline: float
    ) -> None:
        self._encode = encode  # the reply frame, counted in the task's stats: called once
        self._send_now = send_now
        self._deadline = deadline
        self._lock = threading.Lock()
        self._open = True  # until the job's thread takes the reply over
        self._frame: bytes | None = None
        self._unsent: bytes | None = None  # once a send began: what it left (b"": nothing)

    def __call__(self, reply: HostReply) -> bool:
        """Send ``reply`` from this thread if the socket takes it now; whether any of it went."""
        with self._lock:
            # Past the deadline no reply is begun, from here or the job's thread (take_over): the
            # task's code is being stopped. One begun before it is finished, so that the stream
            # stays framed; a task that timed out has its sandbox destroyed in any case.
            if not self._open or self._frame is not None or time.monotonic() >= self._deadline:
                return False
            self._frame = self._encode(reply)
            if len(self._frame) > SINGLE_WRITE_BYTES:  # the job's thread sends it, a frame at a time
                return False
            message = encode_message(self._frame)
            sent = self._send_now(message)
            if sent <= 0:
                return False
            self._unsent = message[sent:]
            return True

    def close(self) -> None:
        """The job's thread stopped waiting for the reply: this thread sends nothing from now on."""
        with self._lock:
            self._open = False

    def take_over(self, reply: HostReply) -> bytes | UnsentRest:
        """On the job's thread, after :meth:`close`, its host having returned ``reply``: what that
        thread sends now."""
        with self._lock:
            if self._unsent is not None:
                return UnsentRest(self._unsent) if self._unsent else NO_REPLY
            frame = self._frame
        if frame is None:  # encoded here, outside the lock: closed, the other thread takes it no more
            frame = self._encode(reply)
        if time.monotonic() >= self._deadline:
            # The task is over: its code is being stopped inside the sandbox, and
            # its answer (a TimeoutError) is what comes next. The call is dropped.
            return NO_REPLY
        return frame


class HostAnswer:
    """Sandbox.exchange's ``answer``: call frames to the host, output frames to the relay,
    anything else is the job's result."""

    def __init__(
        self,
        conversation: HostConversation,
        host: HostFunction,
        deadline: float,
        relay: OutputRelay | None,
        send_now: Callable[[bytes], int],
    ) -> None:
        self._conversation = conversation
        self._host = host
        self._deadline = deadline
        self._relay = relay
        self._send_now = send_now

    def __call__(self, message: bytes) -> bytes | UnsentRest | None:
        if is_output_frame(message):
            self._output(message)
            return NO_REPLY
        if not is_call_frame(message):
            return None
        event = self._conversation.receive(message)  # TooManyRefusedFrames ends the job
        if isinstance(event, RefusedFrame):
            return event.reply
        if time.monotonic() >= self._deadline:
            # The task's time is up, its code being stopped, its answer a TimeoutError: a call that
            # comes now (frames it wrote ahead, read after the deadline) never reaches the host.
            return NO_REPLY
        started = time.monotonic_ns()

        def encode(reply: HostReply) -> bytes:
            return self._conversation.answer(event, reply, time.monotonic_ns() - started)

        early = EarlyReply(encode, self._send_now, self._deadline)
        call = dataclasses.replace(event, deadline=self._deadline, reply_now=early)
        try:
            reply = ask_host(self._host, call)
        finally:  # however the wait ended, the other thread sends nothing after it
            early.close()
        return early.take_over(reply)

    def _output(self, message: bytes) -> None:
        if self._relay is None:  # the job did not ask to stream: a frame written by hand
            self._conversation.count_refused("junk", "output frame from a job that does not stream")
            return
        try:
            self._relay.receive(message)
        except OutputRefused as exc:  # TooManyRefusedFrames from here ends the job
            self._conversation.count_refused("junk", f"output frame refused: {exc}")
