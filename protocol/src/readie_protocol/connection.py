"""One end of a ``readie pool`` conversation, without I/O (h11's ``Connection`` is the model).

Both ends drive the same object. The pool is ``PoolConnection(Role.POOL)``:
request lines in, events out. A client is ``PoolConnection(Role.CLIENT)``:
request lines out, events in. Bytes read go to :meth:`receive_data`
(``b""`` once the other side's output ended); :meth:`next_event` then
returns what they held, one event at a time, until :data:`NEED_DATA` (or
:data:`ENDED`); :meth:`send` returns the bytes of one outgoing line for the
caller to write.

What it keeps beyond single lines is what the two sides must agree on:

* the ready event comes first, and names the protocol version (a client
  refuses another version with :class:`~readie_protocol.errors.VersionMismatch`);
* lines are bounded: a request line by :data:`~readie_protocol.lines.MAX_LINE_BYTES`
  (the pool refuses a longer one, naming its id when it can; a client
  refuses to send one, naming the field that made it long), an event line by
  the client's own bound (a pool writing past it, even without ever ending
  the line, is broken at once);
* an answer is read as what its request asked for (a result, the stats
  event, the closed or cancelled event, a session's uploaded, file_chunk or
  listing event), matched by id among the requests in flight; a refusal of
  any of them is a result.

The pool side never raises on input: a bad line is a
:class:`~readie_protocol.requests.Refused`. The client side raises
:class:`~readie_protocol.errors.PoolError` when the pool breaks the
protocol, and keeps raising it: nothing after a broken line can be trusted
to match a caller.
"""

from __future__ import annotations

import enum
import json
from collections import deque
from typing import Any, Final

from readie_executor import hostwire

from .errors import PoolError, ReadieError
from .events import (
    AttachedEvent,
    CallEvent,
    CancelledEvent,
    ClosedEvent,
    ForkedEvent,
    HibernatedEvent,
    OutputEvent,
    ReadyEvent,
    Result,
    StatsEvent,
    parse_attached,
    parse_call,
    parse_cancelled,
    parse_closed,
    parse_forked,
    parse_hibernated,
    parse_output,
    parse_ready,
    parse_result,
    parse_stats,
)
from .lines import MAX_LINE_BYTES, Line, LineEvent, LineSplitter, OversizeLine
from .request_lines import reply_line, request_json
from .transfers import (
    ChunkEvent,
    DownloadChunk,
    ListFiles,
    ListingEvent,
    UploadChunk,
    UploadedEvent,
    parse_chunk,
    parse_listing,
    parse_uploaded,
)
from .requests import (
    AttachSession,
    CancelJob,
    CloseSession,
    ForkSession,
    HibernateSession,
    JobRequest,
    Refused,
    ReplyRequest,
    Request,
    StatsRequest,
    encode_request,
    parse_event,
)
from .wire import RequestId, encode_line

__all__ = [
    "ENDED",
    "NEED_DATA",
    "ClientEvent",
    "PoolEvent",
    "PoolConnection",
    "Role",
    "Stray",
]


class Role(enum.Enum):
    CLIENT = "client"  # writes requests, reads the pool's events
    POOL = "pool"  # reads requests, writes events


class _Marker:
    def __init__(self, name: str) -> None:
        self._name = name

    def __repr__(self) -> str:
        return self._name


#: :meth:`PoolConnection.next_event`: no whole line yet, feed more bytes.
NEED_DATA: Final = _Marker("NEED_DATA")
#: :meth:`PoolConnection.next_event`: the other side's output ended, and every line of it was read.
ENDED: Final = _Marker("ENDED")


class Stray:
    """A line answering no request in flight: a caller that gave up on it, or a pool bug."""

    __slots__ = ("line",)

    def __init__(self, line: bytes) -> None:
        self.line = line

    def __repr__(self) -> str:
        # Clients log strays: a session's first result holds its key, a secret shown to nobody.
        shown = self.line[:200].split(b'"session_key"', 1)[0]
        return f"Stray({shown!r})"


PoolEvent = (
    ReadyEvent | Result | StatsEvent | ClosedEvent | HibernatedEvent | ForkedEvent | AttachedEvent | CancelledEvent
    | CallEvent | OutputEvent | UploadedEvent | ChunkEvent | ListingEvent
)
ClientEvent = PoolEvent | Stray


class _Answer(enum.Enum):
    """What a request in flight is answered with."""

    RESULT = "result"
    STATS = "stats"
    CLOSE = "close"  # the closed event, or a result when the close is refused
    HIBERNATE = "hibernate"  # the hibernated event, or a result when it is refused
    FORK = "fork"  # the forked event, or a result when it is refused
    ATTACH = "attach"  # the attached event, or a result when it is refused
    CANCEL = "cancel"  # the cancelled event, or a result when the cancel is refused
    UPLOAD = "upload"  # the uploaded event, or a result when the chunk is refused
    DOWNLOAD = "download"  # the file_chunk event, or a result when it is refused
    LIST = "list"  # the listing event, or a result when it is refused


class PoolConnection:
    """The protocol state of one side of a pool's stdin/stdout pair.

    ``max_line_bytes`` bounds incoming lines: the request limit on the pool's
    side (the default), the client's own bound for event lines on a client's.
    Not thread-safe: a client that sends from several threads holds one lock
    around every call.
    """

    def __init__(self, our_role: Role, *, max_line_bytes: int = MAX_LINE_BYTES) -> None:
        self.our_role = our_role
        self._splitter = LineSplitter(max_line_bytes)
        self._max_line_bytes = max_line_bytes
        self._lines: deque[LineEvent] = deque()
        self._ready_seen = False  # the ready event was sent (pool) or read (client)
        self._in_flight: dict[RequestId, _Answer] = {}
        self._broken: PoolError | None = None
        #: The size of the line the last event of :meth:`next_event` came from
        #: (0 for an oversize line, which is never held): what a pool counts
        #: against the bytes it keeps parked.
        self.last_line_bytes = 0

    # ------------------------------------------------------------------ incoming

    def receive_data(self, data: bytes) -> None:
        """Bytes the other side wrote; ``b""`` when its output ended."""
        self._lines.extend(self._splitter.feed(data))
        if self.our_role is Role.CLIENT and (size := self._splitter.oversize_so_far) is not None:
            # A pool writing without end must not keep callers waiting for its newline.
            self._lines.append(OversizeLine(size=size, id=None))

    def next_event(self) -> Request | Refused | ClientEvent | _Marker:
        """The next event the bytes so far hold, or :data:`NEED_DATA` / :data:`ENDED`.

        The pool's side gets requests and refusals; a client's gets the
        ready event first, then results, stats, closed, call and output events, and
        :class:`Stray` lines.
        """
        if self._broken is not None:
            raise self._broken
        if not self._lines:
            return ENDED if self._splitter.ended else NEED_DATA
        line = self._lines.popleft()
        self.last_line_bytes = len(line.data) if isinstance(line, Line) else 0
        if self.our_role is Role.POOL:
            return parse_event(line)
        try:
            return self._client_event(line)
        except PoolError as exc:
            self._broken = exc
            raise
        except ReadieError:  # VersionMismatch: nothing after it is read either
            self._broken = PoolError("the pool speaks another protocol version")
            raise

    # ------------------------------------------------------------------ outgoing

    def send(self, event: Request | PoolEvent) -> bytes:
        """The line for one outgoing request (a client's, typed as the pool parses it back) or event
        (the pool's).

        A client's request line over the limit raises
        :class:`~readie_protocol.errors.RequestError` naming the field that made
        it long; a request with an id expects its answer by that id. A client
        sends typed values only: a line that is not one (a hostile-input
        test's) is written as bytes, past the connection.
        """
        if self.our_role is Role.CLIENT:
            if isinstance(event, ReplyRequest):
                return reply_line(event)  # answered by nothing: not in flight
            line = encode_request(request_json(event))  # type: ignore[arg-type]  # a client sends requests, never events
            self._in_flight[event.id] = _ANSWERS[type(event)]  # type: ignore[union-attr]
            return line
        if isinstance(event, ReadyEvent) != (not self._ready_seen):
            raise RuntimeError("the ready event is the pool's first line, and only that")
        self._ready_seen = True
        if isinstance(event, CallEvent):
            # Arguments may hold integers of any size and any depth: hostwire writes both.
            return hostwire.dumps(event.to_json()) + b"\n"
        return encode_line(event.to_json())

    def forget(self, request_id: RequestId) -> None:
        """A request whose line could not be written: no answer will come for it."""
        self._in_flight.pop(request_id, None)

    # ------------------------------------------------------------------ the client's reading

    def _client_event(self, line: LineEvent) -> ClientEvent:
        if not self._ready_seen:
            self._ready_seen = True
            return parse_ready(_first_line(line))
        if isinstance(line, OversizeLine):
            _broken(f"the pool wrote a line of at least {line.size} bytes, over {self._max_line_bytes}")
        obj = _loads(line.data)
        if obj.get("event") == "call":
            return parse_call(obj)
        request_id = obj.get("id")
        # true == 1 in Python: a bool must not take the entry of request 1 on its way to the strays.
        if isinstance(request_id, bool) or not isinstance(request_id, str | int):
            return Stray(line.data)
        if obj.get("event") == "output":  # on the way to the result: the request stays in flight
            if self._in_flight.get(request_id) is not _Answer.RESULT:
                return Stray(line.data)
            return parse_output(obj)
        answer = self._in_flight.pop(request_id, None)
        if answer is None:
            return Stray(line.data)
        if answer is _Answer.STATS:
            return parse_stats(obj)
        if answer is _Answer.CLOSE and obj.get("closed") is not None:
            return parse_closed(obj)
        if answer is _Answer.CANCEL and obj.get("event") == "cancelled":
            return parse_cancelled(obj)
        if answer is _Answer.HIBERNATE and obj.get("hibernated") is not None:
            return parse_hibernated(obj)
        if answer is _Answer.FORK and obj.get("forked") is not None:
            return parse_forked(obj)
        if answer is _Answer.ATTACH and obj.get("attached") is not None:
            return parse_attached(obj)
        if (parse := _TRANSFER_EVENTS.get((answer, obj.get("event")))) is not None:
            return parse(obj)
        return parse_result(obj)


_ANSWERS: Final = {
    JobRequest: _Answer.RESULT,
    StatsRequest: _Answer.STATS,
    CloseSession: _Answer.CLOSE,
    CancelJob: _Answer.CANCEL,
    HibernateSession: _Answer.HIBERNATE,
    ForkSession: _Answer.FORK,
    AttachSession: _Answer.ATTACH,
    UploadChunk: _Answer.UPLOAD,
    DownloadChunk: _Answer.DOWNLOAD,
    ListFiles: _Answer.LIST,
}
#: A transfer's answer by what was asked and the event the line names; anything else is a result.
_TRANSFER_EVENTS: Final = {
    (_Answer.UPLOAD, "uploaded"): parse_uploaded,
    (_Answer.DOWNLOAD, "file_chunk"): parse_chunk,
    (_Answer.LIST, "listing"): parse_listing,
}


def _first_line(line: LineEvent) -> Any:
    if isinstance(line, OversizeLine):
        raise PoolError(f"readie pool's first line is over {line.size} bytes, not a ready event")
    try:
        return json.loads(line.data)
    except (ValueError, RecursionError):
        raise PoolError(f"readie pool's first line is not JSON: {line.data[:200]!r}") from None


def _loads(raw: bytes) -> dict[str, Any]:
    """One line of the pool's. A call event's arguments may nest deeper than
    ``json.loads`` recurses; hostwire's parser is iterative (and as strict)."""
    try:
        try:
            obj = json.loads(raw)
        except RecursionError:
            obj = hostwire.loads(raw)
    except ValueError:  # hostwire.WireError is one too
        _broken(f"the pool wrote a line that is not JSON: {raw[:200]!r}")
    if not isinstance(obj, dict):
        _broken(f"the pool wrote a line that is not an object: {raw[:200]!r}")
    return obj


def _broken(why: str) -> Any:
    raise PoolError(f"readie pool broke the protocol: {why}")
