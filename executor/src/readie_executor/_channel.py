"""The connection of the call that is running, for code inside it that talks back to the worker.

:func:`readie_executor._server.serve_connection` makes its connection current
around each call; host functions (:mod:`readie_executor.jobs._host`) send
their call frames on it and read the worker's replies with the same
:class:`~readie_executor.framing.MessageReader` the server reads requests
with, so bytes it has already buffered are never lost. The output capture's
drain thread sends output frames on it too, while a host call may be
waiting for its reply: sends are serialized here, receives by their caller.
"""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Iterator

from .framing import FramingError, MessageReader
from .sockets import receive_message, send_message


class ChannelBroken(Exception):
    """The connection failed, or a message on it was cut short; it cannot carry another frame."""


class Channel:
    """One connection. Sends from any thread, one whole message at a time; one receiver at a time."""

    def __init__(self, connection: socket.socket, reader: MessageReader, chunk_size: int) -> None:
        self._connection = connection
        self._reader = reader
        self._chunk_size = chunk_size
        self._broken: str | None = None
        self._sending = threading.Lock()

    @property
    def broken(self) -> bool:
        return self._broken is not None

    def send(self, payload: bytes) -> None:
        with self._sending:
            self._check()
            try:
                send_message(self._connection, payload, self._chunk_size)
            except BaseException as exc:
                # Part of a message may have left: nothing sent after it would be framed right.
                self._broken = f"sending failed: {type(exc).__name__}: {exc}"
                raise ChannelBroken(self._broken) from None

    def receive(self) -> bytes:
        self._check()
        try:
            payload = receive_message(self._connection, self._reader)
        except (OSError, FramingError) as exc:
            self._broken = f"receiving failed: {type(exc).__name__}: {exc}"
            raise ChannelBroken(self._broken) from None
        # Anything else (a signal handler's exception: the job's deadline) interrupted
        # a wait between reads; the reader keeps every byte it had, so the channel is
        # as good as before, and the exception is the job's to end with.
        if payload is None:
            self._broken = "the worker closed the connection"
            raise ChannelBroken(self._broken)
        return payload

    def _check(self) -> None:
        if self._broken is not None:
            raise ChannelBroken(f"the connection broke earlier ({self._broken})")


_current: Channel | None = None


def current() -> Channel | None:
    """The channel of the running call, or None outside one (or outside the executor's server)."""
    return _current


@contextlib.contextmanager
def serving(channel: Channel) -> Iterator[Channel]:
    global _current
    _current = channel
    try:
        yield channel
    finally:
        _current = None
