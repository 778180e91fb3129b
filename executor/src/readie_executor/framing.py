"""Framing v2 of the executor protocol, without I/O.

A message is a series of chunks, each behind an 8-byte big-endian length,
ended by a zero length. Bytes go in through :meth:`MessageReader.feed`;
messages (or "need more data", or "the stream ended cleanly") come out of
:meth:`MessageReader.next_event`. Nothing here touches a socket, so the same
code serves the executor, the worker and the tests (the h11 pattern).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass

__all__ = [
    "BYTES_PER_CHUNK",
    "DEFAULT_CHUNK_SIZE",
    "END_OF_STREAM",
    "MAX_CHUNK_SIZE",
    "MAX_MESSAGE_SIZE",
    "MIN_CHUNKS",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "ChunkTooLarge",
    "FramingError",
    "Message",
    "MessageReader",
    "MessageTooLarge",
    "TooManyChunks",
    "TruncatedMessage",
    "encode_message",
    "iter_frames",
]

#: Written into manifest.json as ``executor_protocol``; version 1 was "EOF ends the message".
PROTOCOL_VERSION = 2

_LENGTH = struct.Struct(">Q")
HEADER_SIZE = _LENGTH.size
TERMINATOR = bytes(HEADER_SIZE)

# A chunk is buffered whole before it is handed on, so its length bounds the
# memory one bogus header can make a reader reserve.
MAX_CHUNK_SIZE = 64 * 1024 * 1024
# Ceiling of the spec; readers that expect smaller messages pass a lower one.
MAX_MESSAGE_SIZE = 4 * 1024 * 1024 * 1024
# Large enough that per-chunk overhead is noise, small enough to stream.
DEFAULT_CHUNK_SIZE = 1024 * 1024
# What a reader allows a message in chunks: one per this many bytes of its size limit, and
# MIN_CHUNKS whatever the limit. Any chunking a sender would choose passes (writers use
# DEFAULT_CHUNK_SIZE); a peer cutting a message into chunks of a byte or two, each a turn of the
# reader's loop holding the receiving process's interpreter, does not.
BYTES_PER_CHUNK = 64
MIN_CHUNKS = 4096


class FramingError(Exception):
    """The byte stream does not follow framing v2."""


class ChunkTooLarge(FramingError):
    def __init__(self, length: int, limit: int) -> None:
        super().__init__(f"chunk length {length} exceeds the limit of {limit} bytes")
        self.length = length
        self.limit = limit


class MessageTooLarge(FramingError):
    def __init__(self, size: int, limit: int) -> None:
        super().__init__(f"message of at least {size} bytes exceeds the limit of {limit} bytes")
        self.size = size
        self.limit = limit


class TooManyChunks(FramingError):
    def __init__(self, limit: int) -> None:
        super().__init__(f"message of more than {limit} chunks (at most one per {BYTES_PER_CHUNK} bytes of its limit)")
        self.limit = limit


class TruncatedMessage(FramingError):
    """The stream ended inside a message: before a header, a chunk or the terminator."""

    def __init__(self, what: str, expected: int, received: int, payload_received: int) -> None:
        super().__init__(
            f"truncated message: stream ended inside {what}: expected {expected} bytes, "
            f"received {received} ({payload_received} payload bytes had arrived)"
        )
        self.what = what
        self.expected = expected
        self.received = received
        self.payload_received = payload_received


@dataclass(frozen=True, slots=True)
class Message:
    payload: bytes


class _Sentinel:
    __slots__ = ("_name",)

    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: More bytes are needed before the next event.
NEED_DATA = _Sentinel("NEED_DATA")
#: The stream ended cleanly between messages.
END_OF_STREAM = _Sentinel("END_OF_STREAM")

Event = Message | _Sentinel


def iter_frames(payload: bytes | bytearray | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE) -> Iterator[bytes | memoryview]:
    """Yield the pieces of one encoded message, without copying the payload."""
    if not 0 < chunk_size <= MAX_CHUNK_SIZE:
        raise ValueError(f"chunk_size must be in 1..{MAX_CHUNK_SIZE}, got {chunk_size}")
    view = memoryview(payload).cast("B")
    if len(view) > MAX_MESSAGE_SIZE:
        raise MessageTooLarge(len(view), MAX_MESSAGE_SIZE)
    # Never an empty chunk before the end: the reader would take it as the terminator.
    for start in range(0, len(view), chunk_size):
        piece = view[start : start + chunk_size]
        yield _LENGTH.pack(len(piece))
        yield piece
    yield TERMINATOR


def encode_message(payload: bytes | memoryview, chunk_size: int = DEFAULT_CHUNK_SIZE) -> bytes:
    return b"".join(iter_frames(payload, chunk_size))


class MessageReader:
    """Turns a byte stream into messages.

    ``feed(b"")`` marks the end of the stream; after that, ``next_event`` drains
    what is buffered and then reports ``END_OF_STREAM`` or raises
    :class:`TruncatedMessage`. Limits are checked on each header, before the
    chunk it announces is buffered.

    ``max_message_size`` bounds a message's payload, and its chunks are
    bounded with it (:data:`BYTES_PER_CHUNK`: :class:`TooManyChunks`); the
    payload goes into one buffer, never an object per chunk.
    """

    def __init__(self, max_message_size: int = MAX_MESSAGE_SIZE) -> None:
        self._max_message_size = min(max_message_size, MAX_MESSAGE_SIZE)
        self._buffer = bytearray()
        self._closed = False
        self._max_chunks = max(MIN_CHUNKS, self._max_message_size // BYTES_PER_CHUNK)
        self._payload = bytearray()
        self._chunks = 0  # of this message so far
        self._chunk_length: int | None = None  # None while waiting for a header

    @property
    def in_message(self) -> bool:
        return self._chunks > 0 or self._chunk_length is not None

    def feed(self, data: bytes | bytearray | memoryview) -> None:
        if self._closed:
            if data:
                raise RuntimeError("feed() after the end of the stream")
            return
        if not data:
            self._closed = True
            return
        self._buffer += data

    def next_event(self) -> Event:
        while True:
            if self._chunk_length is None:
                if len(self._buffer) < HEADER_SIZE:
                    return self._starved("a length prefix", HEADER_SIZE)
                (length,) = _LENGTH.unpack_from(self._buffer)
                del self._buffer[:HEADER_SIZE]
                if length == 0:
                    return self._finish()
                if length > MAX_CHUNK_SIZE:
                    raise ChunkTooLarge(length, MAX_CHUNK_SIZE)
                if len(self._payload) + length > self._max_message_size:
                    raise MessageTooLarge(len(self._payload) + length, self._max_message_size)
                if self._chunks >= self._max_chunks:
                    raise TooManyChunks(self._max_chunks)
                self._chunks += 1
                self._chunk_length = length
            if len(self._buffer) < self._chunk_length:
                return self._starved("a chunk", self._chunk_length)
            with memoryview(self._buffer) as view:
                self._payload += view[: self._chunk_length]
            del self._buffer[: self._chunk_length]
            self._chunk_length = None

    def _starved(self, what: str, expected: int) -> Event:
        if not self._closed:
            return NEED_DATA
        if not self.in_message and not self._buffer:
            return END_OF_STREAM
        if what == "a length prefix" and self._payload:
            what = "a length prefix (no terminator yet)"
        raise TruncatedMessage(what, expected, len(self._buffer), len(self._payload))

    def _finish(self) -> Message:
        payload = bytes(self._payload)
        self._payload = bytearray()
        self._chunks = 0
        return Message(payload)
