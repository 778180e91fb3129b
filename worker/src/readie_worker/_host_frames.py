"""Host-function frames from a sandbox: hostile bytes in, a rebuilt call or a typed refusal out.

While a code job runs, the sandbox may send call frames on the executor's
connection (decision 8; the format is :mod:`readie_executor.hostwire`). Job
code runs in the same process as the honest sender and can write anything on
that socket, so every frame is hostile input (specs/hostile-frames.md):

* its size is checked before anything parses it;
* it is parsed by :func:`readie_executor.hostwire.loads`, iterative and
  lossless (no depth limit but the size; integers exact; NaN, Infinity,
  duplicate keys, invalid UTF-8 refused);
* it is validated and rebuilt field by field into a frozen :class:`HostCall`,
  so forged extras never ride along, and only a declared function with the
  next call id in sequence ever reaches the host.

Nothing here does I/O: :class:`HostConversation` takes a frame's bytes and
gives back a :class:`HostCall` for the host or a :class:`RefusedFrame` whose reply
goes back to the sandbox, and encodes the host's :class:`HostReply`. The
socket loop is ``Sandbox.exchange``; the glue is ``jobs.run_in_sandbox``.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass
from typing import Literal

from readie_executor import hostwire
from readie_executor.hostwire import (
    CALL_PREFIX,
    MAX_CALL_FRAME_BYTES,
    MAX_CALL_ID,
    MAX_CALLS_PER_TASK,
    MAX_RESULT_BYTES,
    REPLY_PREFIX,
)

from readie_policy.jobs import HostCall, HostReply, HostStats, check_functions

from .errors import PoolWorkerError

__all__ = [
    "MAX_REFUSED_FRAMES",
    "FrameRefused",
    "HostCall",
    "HostConversation",
    "HostReply",
    "HostStats",
    "RefusedFrame",
    "TooManyRefusedFrames",
    "check_functions",
    "encode_reply",
    "is_call_frame",
    "parse_call_frame",
]

# Refused frames (junk or forged) a task may send and still get an answer to;
# the next one ends the job with a PoolWorkerError. An honest job sends none:
# its frames come from readie_host, which only writes well-formed calls to
# declared names. The number is small enough that all its refusal replies (a
# few hundred bytes each, one socket write each) fit in a Unix socket's
# default send buffer even if the job never reads them: 212,992 bytes held
# 167-278 such writes, measured. So a flood never blocks the worker's thread;
# it ends the job at once, whatever the job reads.
MAX_REFUSED_FRAMES = 64
# How much of a forged name or a parser message a refusal quotes.
QUOTE_CHARS = 80
# A host's error text is cut to this many characters, so that its reply stays
# within MAX_RESULT_BYTES even if every character takes a 12-byte escape (an
# astral character written as a surrogate pair).
MAX_ERROR_CHARS = MAX_RESULT_BYTES // 12 - 100
_CALL_FIELDS = frozenset({"call_id", "function", "args", "kwargs"})

#: The JSON parser frames go through; a module attribute so tests can watch it.
parse_json = hostwire.loads


class FrameRefused(Exception):
    """A frame that does not reach the host. ``kind`` is ``"junk"`` (not a well-formed call)
    or ``"forged"`` (a well-formed call the task may not make); ``call_id`` is the frame's
    own id when it had a valid one, so the refusal can answer it."""

    def __init__(
        self, kind: Literal["junk", "forged"], reason: str, call_id: int | None = None
    ) -> None:
        super().__init__(reason)
        self.kind = kind
        self.reason = reason
        self.call_id = call_id


class TooManyRefusedFrames(PoolWorkerError):
    """The sandbox sent more than MAX_REFUSED_FRAMES refused frames; the job is ended."""


@dataclass(frozen=True, slots=True)
class RefusedFrame:
    """A refused frame and the error reply that answers it."""

    kind: Literal["junk", "forged"]
    reason: str
    reply: bytes


def is_call_frame(payload: bytes) -> bool:
    """Whether a message from the sandbox is a call frame rather than the job's final answer."""
    return payload[: len(CALL_PREFIX)] == CALL_PREFIX


def parse_call_frame(
    payload: bytes,
    functions: Collection[str],
    expected_id: int,
    max_calls: int = MAX_CALLS_PER_TASK,
) -> HostCall:
    """Check and rebuild one call frame; raise :class:`FrameRefused` for anything else."""
    if len(payload) > MAX_CALL_FRAME_BYTES:  # before any parsing
        raise FrameRefused(
            "junk", f"frame of {len(payload)} bytes; at most {MAX_CALL_FRAME_BYTES} are allowed"
        )
    if not is_call_frame(payload):
        raise FrameRefused("junk", "not a call frame")
    try:
        document = parse_json(payload)
    except hostwire.WireError as exc:
        raise FrameRefused("junk", f"frame is not valid JSON: {_quote(str(exc))}") from None
    if not isinstance(document, dict) or document.keys() != {"call"}:
        raise FrameRefused("junk", 'a call frame is {"call": {...}} and nothing else')
    call = document["call"]
    if not isinstance(call, dict):
        raise FrameRefused("junk", "call must be an object")
    unknown = sorted(key for key in call if key not in _CALL_FIELDS)
    if unknown:
        raise FrameRefused("junk", f"call has unknown fields: {_quote(', '.join(unknown))}")
    missing = sorted(_CALL_FIELDS - call.keys())
    if missing:
        raise FrameRefused("junk", f"call lacks {', '.join(missing)}")
    call_id, function = call["call_id"], call["function"]
    args, kwargs = call["args"], call["kwargs"]
    if type(call_id) is not int or not 1 <= call_id <= MAX_CALL_ID:
        raise FrameRefused("junk", f"call_id must be an integer from 1 to {MAX_CALL_ID}")
    if not isinstance(function, str):
        raise FrameRefused("junk", "function must be a string", call_id)
    if not isinstance(args, list):
        raise FrameRefused("junk", "args must be an array", call_id)
    if not isinstance(kwargs, dict):
        raise FrameRefused("junk", "kwargs must be an object", call_id)
    if function not in functions:
        raise FrameRefused(
            "forged", f"{_quote(function)!r} is not a declared host function", call_id
        )
    if expected_id > max_calls:
        raise FrameRefused(
            "forged", f"this task has made its {max_calls} host calls; no more are allowed", call_id
        )
    if call_id != expected_id:
        raise FrameRefused(
            "forged",
            f"call_id {call_id} is out of sequence: the next call is {expected_id}",
            call_id,
        )
    return HostCall(call_id, function, tuple(args), dict(kwargs))


def encode_reply(call_id: int | None, reply: HostReply) -> bytes:
    """The reply frame for ``reply``; a result that cannot be sent becomes an error reply."""
    return _encode_reply(call_id, reply)[0]


def _encode_reply(call_id: int | None, reply: HostReply) -> tuple[bytes, bool]:
    """The reply frame, and whether it carries an error."""
    head = REPLY_PREFIX + b'{"call_id":' + (b"null" if call_id is None else b"%d" % call_id)
    error = reply.error
    if error is None and reply.encoded is not None and len(reply.encoded) <= MAX_RESULT_BYTES:
        # Parsed and checked where it arrived (a client's reply through an Interact stream).
        return head + b',"result":' + reply.encoded + b"}}", False
    if error is None:
        try:
            body = hostwire.dumps(reply.result, MAX_RESULT_BYTES, what="result")
        except (TypeError, ValueError) as exc:
            error = f"the host's result cannot be sent: {exc}"
        else:
            return head + b',"result":' + body + b"}}", False
    text = error if isinstance(error, str) else repr(error)
    if len(text) > MAX_ERROR_CHARS:
        text = text[:MAX_ERROR_CHARS] + " [cut]"
    return head + b',"error":' + hostwire.dumps(text) + b"}}", True


class HostConversation:
    """One task's host-function exchange: the next call id, the counters, the flood limit."""

    def __init__(
        self,
        functions: Collection[str],
        *,
        max_calls: int = MAX_CALLS_PER_TASK,
        max_refused: int = MAX_REFUSED_FRAMES,
    ) -> None:
        self._functions = frozenset(functions)
        self._max_calls = max_calls
        self._max_refused = max_refused
        self._next_id = 1
        self._counts = {"calls": 0, "replies": 0, "junk": 0, "forged": 0, "host_errors": 0}
        self._wait_ns = 0

    @property
    def stats(self) -> HostStats:
        return HostStats(**self._counts, wait_us=self._wait_ns // 1000)

    def receive(self, payload: bytes) -> HostCall | RefusedFrame:
        """A call for the host, or a refusal to send back; TooManyRefusedFrames ends the job."""
        try:
            call = parse_call_frame(payload, self._functions, self._next_id, self._max_calls)
        except FrameRefused as refusal:
            self.count_refused(refusal.kind, refusal.reason)
            self._counts["replies"] += 1
            error = HostReply(error=f"host call refused: {refusal.reason}")
            return RefusedFrame(refusal.kind, refusal.reason, encode_reply(refusal.call_id, error))
        self._next_id += 1
        self._counts["calls"] += 1
        return call

    def count_refused(self, kind: Literal["junk", "forged"], reason: str) -> None:
        """Count a refused frame (one of these or an output frame); past the limit the job ends."""
        self._counts[kind] += 1
        refused = self._counts["junk"] + self._counts["forged"]
        if refused > self._max_refused:
            raise TooManyRefusedFrames(
                f"the sandbox sent {refused} frames that were refused "
                f"(at most {self._max_refused} are allowed); the last: {reason}"
            ) from None

    def answer(self, call: HostCall, reply: HostReply, waited_ns: int = 0) -> bytes:
        """The reply frame for the host's answer to ``call``."""
        encoded, is_error = _encode_reply(call.call_id, reply)  # first: nothing is counted if it raises
        self._wait_ns += waited_ns
        if is_error:
            self._counts["host_errors"] += 1
        self._counts["replies"] += 1
        return encoded


def _quote(text: str) -> str:
    return text if len(text) <= QUOTE_CHARS else text[:QUOTE_CHARS] + "..."
