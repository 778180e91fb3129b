"""Splitting the pool's stdin into JSONL lines, without I/O.

Bytes go in through :meth:`LineSplitter.feed`; complete lines come out as
:class:`Line` events, and a line over :data:`MAX_LINE_BYTES` comes out as one
:class:`OversizeLine` once its newline (or the end of input) arrives. An
oversize line is drained, never buffered: memory stays bounded by the limit
whatever the client sends, and the tail of a long line is never mistaken for
a fresh request. ``feed(b"")`` means end of input; an unterminated last line
still counts as a line.

Lines that are empty or only whitespace are skipped: JSONL readers commonly
tolerate them, and a person typing into ``readie pool`` gets no error for an
extra Enter.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from .wire import RequestId, id_problem

__all__ = [
    "ID_SCAN_BYTES",
    "MAX_LINE_BYTES",
    "Line",
    "LineEvent",
    "LineSplitter",
    "OversizeLine",
    "recover_id",
]

#: The spec's limit: "A line longer than 1 MiB is discarded". The newline is
#: not counted, so a line of exactly 1 MiB plus its newline is accepted.
MAX_LINE_BYTES = 1024 * 1024

#: How much of an oversize line is kept to recover its id. Requests put the id
#: first (every spec example does); 4 KiB covers any id we would accept.
ID_SCAN_BYTES = 4096

# Only an id that is the object's first key is recovered: a later "id" could
# belong to a nested value (an env entry, a reply result) and would attribute
# the error to the wrong request.
_FIRST_KEY_ID = re.compile(
    rb"""\A[ \t\r]*\{[ \t\r]*"id"[ \t\r]*:[ \t\r]*
    (   "(?:[^"\\\x00-\x1f]|\\.){0,1024}"    # a JSON string, escapes kept for json.loads
      | -?(?:0|[1-9][0-9]{0,18})              # or an integer of at most 19 digits
    )(?=[ \t\r]*[,}])                          # and complete: followed by , or }
    """,
    re.VERBOSE,
)


@dataclass(frozen=True, slots=True)
class Line:
    """One complete line, without its newline."""

    data: bytes


@dataclass(frozen=True, slots=True)
class OversizeLine:
    """A line over the limit, discarded whole.

    ``size`` is its exact length without the newline; ``id`` is the request
    id when the line starts with one (best effort, see :func:`recover_id`).
    """

    size: int
    id: RequestId | None


LineEvent = Line | OversizeLine

# JSON's whitespace; a line of only these is skipped.
_JSON_BLANK = b" \t\r"


def recover_id(head: bytes) -> RequestId | None:
    """The id of a line that will not be parsed in full, if its first key is ``"id"``.

    Used for oversize lines and for lines that are not valid JSON, so their
    error result still reaches the caller waiting on that id.
    """
    match = _FIRST_KEY_ID.match(head)
    if match is None:
        return None
    try:
        value = json.loads(match.group(1))
    except (ValueError, RecursionError):
        return None
    return None if id_problem(value) else value


class LineSplitter:
    """Turns a byte stream into :data:`LineEvent` values. Never raises on any input."""

    def __init__(self, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        if max_line_bytes < 1:
            raise ValueError(f"max_line_bytes must be positive, got {max_line_bytes}")
        self._max = max_line_bytes
        self._buffer = bytearray()
        # While draining an oversize line: its first bytes (for the id) and its length.
        self._draining = False
        self._head = b""
        self._size = 0
        self._ended = False

    @property
    def ended(self) -> bool:
        return self._ended

    @property
    def oversize_so_far(self) -> int | None:
        """The bytes so far of a line already over the limit whose end has not come; else None.

        For a reader that will not wait for the end of a line it will discard
        anyway (a client facing a pool that writes without end).
        """
        return self._size if self._draining else None

    def feed(self, data: bytes) -> list[LineEvent]:
        """Take the next bytes of input; ``b""`` ends it. Returns the events now complete."""
        if self._ended:
            raise RuntimeError("feed() after the end of input")
        if not isinstance(data, bytes):
            data = bytes(data)
        events: list[LineEvent] = []
        if not data:
            self._ended = True
            self._finish_line(events)
            return events
        view = memoryview(data)
        start = 0
        while True:
            newline = data.find(b"\n", start)
            if newline == -1:
                self._take(view[start:])
                return events
            self._take(view[start:newline])
            self._finish_line(events)
            start = newline + 1

    def _take(self, piece: memoryview) -> None:
        if not self._draining:
            if len(self._buffer) + len(piece) <= self._max:
                self._buffer += piece
                return
            # Over the limit: keep only what id recovery needs and start draining.
            self._draining = True
            self._head = bytes(self._buffer[:ID_SCAN_BYTES])
            self._size = len(self._buffer)
            self._buffer = bytearray()
        # The head keeps filling while draining: a small limit can be crossed
        # before the id has arrived.
        missing = ID_SCAN_BYTES - len(self._head)
        if missing > 0:
            self._head += bytes(piece[:missing])
        self._size += len(piece)

    def _finish_line(self, events: list[LineEvent]) -> None:
        if self._draining:
            events.append(OversizeLine(size=self._size, id=recover_id(self._head)))
            self._draining = False
            self._head = b""
            self._size = 0
        elif self._buffer.strip(_JSON_BLANK):
            events.append(Line(bytes(self._buffer)))
        self._buffer = bytearray()
