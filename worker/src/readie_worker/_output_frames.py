"""Output frames from a sandbox: hostile bytes in, bounded output chunks out.

A job that asked for streamed output (decision 16) sends what it writes as
output frames while it runs (``readie_executor.hostwire``). The job's code
can write any frame on that socket itself, so each is hostile input
(specs/hostile-frames.md). The checks are ordered so that a flood costs the
worker little before it ends the job: size first; then the exact bytes the
honest sandbox begins every frame with, which name the stream; then what the
stream may still send; only then a strict parse (the C ``json`` parser, with
duplicate keys and NaN refused) and the fields. No reply goes back: a refused
frame is counted, towards the same flood limit as refused call frames.

What the stream may send is what the honest sandbox sends, with room to
spare: small frames at most :data:`SMALL_FRAMES_PER_S` (after a burst of
:data:`SMALL_FRAME_BURST`), since it sends one per stream per
``OUTPUT_INTERVAL_S`` and a few flushed early; large frames (a job printing
fast) up to six times ``max_output`` in all, JSON's worst escaping of what
the result keeps. Past the stream's ``max_output`` a frame is dropped
unparsed: the honest sandbox measures raw bytes and may send a little more.

What reaches the client is bounded too:

* per stream, at most ``max_output`` of text, measured as the result measures
  its output: the streamed text is a prefix of the result's;
* at most one chunk per stream every :data:`MIN_FORWARD_INTERVAL_S`, or once
  :data:`FORWARD_BYTES` are held (honest frames, further apart, pass at
  once; text held back goes out with the next frame or at the job's end), so
  a task forwards at most :func:`max_output_events` chunks per stream.

Nothing here does I/O: :class:`OutputRelay` takes a frame's bytes and hands
the chunks to a sink (the caller's :data:`OutputSink`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, Literal

import structlog

from readie_executor import hostwire
from readie_executor.hostwire import (
    MAX_OUTPUT_FRAME_BYTES,
    OUTPUT_INTERVAL_S,
    OUTPUT_PREFIX,
    OUTPUT_STREAMS,
)
from readie_executor.jobs import bounds
from readie_policy.jobs import FORWARD_BYTES, MIN_FORWARD_INTERVAL_S, OutputChunk, OutputSink, max_output_events

__all__ = [
    "FORWARD_BYTES",
    "MIN_FORWARD_INTERVAL_S",
    "SMALL_FRAMES_PER_S",
    "SMALL_FRAME_BURST",
    "OutputChunk",
    "OutputRefused",
    "OutputRelay",
    "OutputSink",
    "is_output_frame",
    "max_output_events",
    "parse_output_frame",
]

_log = structlog.get_logger("readie.worker")

# The honest sandbox sends a stream's small frames once per OUTPUT_INTERVAL_S,
# plus one each time the other stream's flush takes it along, plus its last:
# at most 2 / OUTPUT_INTERVAL_S. Three times that, after a burst, is a flood.
SMALL_FRAMES_PER_S = 3 / OUTPUT_INTERVAL_S
SMALL_FRAME_BURST = 64
# JSON may spell each byte the result keeps as six (\u00XX): what large frames may carry in all.
ESCAPE_FACTOR = 6
# Each frame begins with exactly these bytes (hostwire.encode_output), naming its stream.
_STREAM_PREFIXES = {
    OUTPUT_PREFIX + b'{"stream":' + hostwire.dumps(stream) + b',"data":': stream for stream in OUTPUT_STREAMS
}


class OutputRefused(ValueError):
    """An output frame that is not one, or one too many: dropped, and counted as junk."""


def is_output_frame(payload: bytes) -> bool:
    return payload[: len(OUTPUT_PREFIX)] == OUTPUT_PREFIX


def parse_output_frame(payload: bytes) -> OutputChunk:
    """Check and rebuild one output frame; raise :class:`OutputRefused` for anything else."""
    if len(payload) > MAX_OUTPUT_FRAME_BYTES:  # before any parsing
        raise OutputRefused(f"frame of {len(payload)} bytes; at most {MAX_OUTPUT_FRAME_BYTES}")
    if _stream_of(payload) is None:
        raise OutputRefused("not an output frame as the sandbox writes one")
    try:
        document = json.loads(
            payload.decode("utf-8"), object_pairs_hook=_without_duplicates, parse_constant=_no_constant
        )
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise OutputRefused(f"not valid JSON: {str(exc)[:80]}") from None
    body = document.get("output") if isinstance(document, dict) and len(document) == 1 else None
    if not isinstance(body, dict) or len(body) != 2 or not isinstance(body.get("data"), str):
        raise OutputRefused('an output frame is {"output": {"stream": ..., "data": "..."}}')
    # A lone surrogate (JSON allows one escaped) is not text any UTF-8 line can carry.
    return OutputChunk(body["stream"], bounds.clean_text(body["data"]))


def _stream_of(payload: bytes) -> Literal["stdout", "stderr"] | None:
    for prefix, stream in _STREAM_PREFIXES.items():
        if payload.startswith(prefix):
            return stream  # type: ignore[return-value]
    return None


def _without_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    document = dict(pairs)
    if len(document) != len(pairs):
        raise ValueError("a key is repeated")  # two parsers could pick different values
    return document


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


class _StreamAllowance:
    """One stream's allowances, and its text on the way to the sink."""

    __slots__ = ("budget", "large_bytes", "tokens", "filled_at", "pieces", "size", "forwarded_at")

    def __init__(self, max_output: int, now: float) -> None:
        self.budget = max_output  # what it may still forward, measured as the result measures
        self.large_bytes = ESCAPE_FACTOR * max_output + MAX_OUTPUT_FRAME_BYTES  # what large frames may still carry
        self.tokens = float(SMALL_FRAME_BURST)  # small frames it may send now
        self.filled_at = now
        self.pieces: list[str] = []
        self.size = 0  # encoded size of what is held
        self.forwarded_at = float("-inf")

    def admit(self, payload: bytes, now: float) -> None:
        """Charge one frame to the stream's allowances; OutputRefused past them."""
        if len(payload) >= FORWARD_BYTES:
            self.large_bytes -= len(payload)
            if self.large_bytes < 0:
                raise OutputRefused("more output frames than the stream's max_output needs")
            return
        self.tokens = min(float(SMALL_FRAME_BURST), self.tokens + (now - self.filled_at) * SMALL_FRAMES_PER_S)
        self.filled_at = now
        if self.tokens < 1:
            raise OutputRefused(f"small output frames faster than {SMALL_FRAMES_PER_S:.0f} a second")
        self.tokens -= 1


class OutputRelay:
    """One task's output frames: checked, bounded, coalesced and handed to ``sink``."""

    def __init__(self, sink: OutputSink, max_output: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._sink: OutputSink | None = sink
        self._clock = clock
        now = clock()
        self._streams = {stream: _StreamAllowance(max_output, now) for stream in OUTPUT_STREAMS}
        self.forwarded = 0  # chunks handed to the sink

    def receive(self, payload: bytes) -> None:
        """One output frame from the sandbox; :class:`OutputRefused` if it is not one, or one too many."""
        if len(payload) > MAX_OUTPUT_FRAME_BYTES:
            raise OutputRefused(f"frame of {len(payload)} bytes; at most {MAX_OUTPUT_FRAME_BYTES}")
        name = _stream_of(payload)
        if name is None:
            raise OutputRefused("not an output frame as the sandbox writes one")
        stream, now = self._streams[name], self._clock()
        stream.admit(payload, now)
        if stream.budget <= 0:
            return  # the result keeps no more of this stream: nothing to parse
        data, cut = bounds.fit_text(parse_output_frame(payload).data, stream.budget)
        size = bounds.encoded_size(data)
        # Once a piece is cut, nothing later may go out: the text must stay a prefix of the result's.
        stream.budget = 0 if cut else stream.budget - size
        if not data:
            return
        stream.pieces.append(data)
        stream.size += size
        if stream.size >= FORWARD_BYTES or now - stream.forwarded_at >= MIN_FORWARD_INTERVAL_S:
            self._forward(name, stream, now)

    def finish(self) -> None:
        """The task ended: what is held goes out now, ahead of its result."""
        for name, stream in self._streams.items():
            if stream.pieces:
                self._forward(name, stream, self._clock())

    def _forward(self, name: Literal["stdout", "stderr"], stream: _StreamAllowance, now: float) -> None:
        data = "".join(stream.pieces)
        stream.pieces, stream.size, stream.forwarded_at = [], 0, now
        self.forwarded += 1
        sink = self._sink
        if sink is None:
            return
        try:
            sink(OutputChunk(name, data))
        except Exception:  # noqa: BLE001 - the caller's bug must not end the job; its result still tells
            _log.exception("output_sink_failed")
            self._sink = None
