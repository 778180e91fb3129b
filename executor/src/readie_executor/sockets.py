"""Blocking-socket adapter over the sans-IO framing in :mod:`readie_executor.protocol`."""

from __future__ import annotations

import socket

from .protocol import DEFAULT_CHUNK_SIZE, END_OF_STREAM, Message, MessageReader, iter_frames

# One recv() per this many bytes: big enough for few syscalls on a 100 MB
# payload, small enough that an idle reader does not pin much memory.
RECV_SIZE = 256 * 1024
#: The executor's socket in its EXECUTOR_DIR (the executor spec's name).
SOCKET_NAME = "executor.sock"
#: sun_path is 108 bytes on Linux, and the path needs its terminating NUL:
#: every host path of a socket, the sandbox's seen from the worker included.
MAX_SOCKET_PATH = 107


def send_message(sock: socket.socket, payload: bytes, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
    for piece in iter_frames(payload, chunk_size):
        sock.sendall(piece)


def receive_message(sock: socket.socket, reader: MessageReader) -> bytes | None:
    """The next message's payload, or None when the peer closed between messages.

    A stream that ends inside a message raises :class:`~readie_executor.protocol.TruncatedMessage`.
    """
    while True:
        event = reader.next_event()
        if isinstance(event, Message):
            return event.payload
        if event is END_OF_STREAM:
            return None
        reader.feed(sock.recv(RECV_SIZE))
