"""Blocking-socket adapter over the sans-IO framing in :mod:`readie_executor.framing`."""

from __future__ import annotations

import socket

from .framing import DEFAULT_CHUNK_SIZE, END_OF_STREAM, Message, MessageReader, iter_frames

# One recv() per this many bytes: big enough for few syscalls on a 100 MB
# payload, small enough that an idle reader does not pin much memory.
RECV_SIZE = 256 * 1024
#: The executor's socket in its EXECUTOR_DIR (the executor spec's name).
SOCKET_NAME = "executor.sock"
#: sun_path is 108 bytes on Linux, and the path needs its terminating NUL:
#: every host path of a socket, the sandbox's seen from the worker included.
MAX_SOCKET_PATH = 107


def send_message(sock: socket.socket, payload: bytes | bytearray, chunk_size: int = DEFAULT_CHUNK_SIZE) -> None:
    """Send one message with one vectored write per frame (header and chunk together).

    Every write is a syscall and a wake-up of the reader, which gVisor makes
    dear: a small answer goes out in one ``sendmsg``, terminator included,
    instead of three ``sendall`` calls; nothing is copied to join them.
    """
    pieces = list(iter_frames(payload, chunk_size))
    # Header and chunk pairs, the terminator riding with the last one.
    batches = [pieces[i : i + 2] for i in range(0, len(pieces) - 3, 2)] + [pieces[-3:] if len(pieces) >= 3 else pieces]
    for batch in batches:
        _send_all_of(sock, batch)


def _send_all_of(sock: socket.socket, pieces: list[bytes | memoryview]) -> None:
    sent = sock.sendmsg(pieces)
    for piece in pieces:
        size = len(piece)
        if sent >= size:
            sent -= size
            continue
        sock.sendall(memoryview(piece)[sent:])  # a short write: the rest the slow way
        sent = 0


def receive_message(sock: socket.socket, reader: MessageReader) -> bytes | None:
    """The next message's payload, or None when the peer closed between messages.

    A stream that ends inside a message raises :class:`~readie_executor.framing.TruncatedMessage`.
    """
    while True:
        event = reader.next_event()
        if isinstance(event, Message):
            return event.payload
        if event is END_OF_STREAM:
            return None
        reader.feed(sock.recv(RECV_SIZE))
