"""Output frames from a sandbox: hostile bytes in, bounded output chunks out.

A job that asked for streamed output (decision 16) sends what it writes as
output frames while it runs (``readie_executor.hostwire``). The job's code
can write any frame on that socket itself, so each is hostile input
(specs/hostile-frames.md), checked like a call frame: size first, then
hostwire's strict parser, then field by field into an :class:`OutputChunk`.
No reply goes back: a refused output frame is counted, and counts towards
the same flood limit as refused call frames.

What reaches the client is bounded whatever the sandbox sends:

* per stream, at most ``max_output`` bytes of text, measured as the result
  measures its output (JSON-escaped UTF-8): never more than the final result
  holds; the rest is dropped, and the result says it was cut;
* at most one chunk per stream every :data:`MIN_FORWARD_INTERVAL_S`, or
  once :data:`FORWARD_BYTES` are held: the honest sandbox sends a frame per
  stream at most every ``OUTPUT_INTERVAL_S`` (longer), so its frames pass at
  once, while a flood of tiny frames becomes a few large chunks. Text held
  back goes out with the next frame, or when the job ends.

Nothing here does I/O: :class:`OutputRelay` takes a frame's bytes and hands
the chunks to a sink (the caller's :data:`OutputSink`).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import structlog

from readie_executor import hostwire
from readie_executor.hostwire import (
    MAX_OUTPUT_CHUNK_BYTES,
    MAX_OUTPUT_FRAME_BYTES,
    OUTPUT_INTERVAL_S,
    OUTPUT_PREFIX,
    OUTPUT_STREAMS,
)

__all__ = [
    "FORWARD_BYTES",
    "MIN_FORWARD_INTERVAL_S",
    "OutputChunk",
    "OutputRefused",
    "OutputRelay",
    "OutputSink",
    "encoded_size",
    "is_output_frame",
    "parse_output_frame",
]

_log = structlog.get_logger("readie.worker")

# Well under the sandbox's own interval, so that its honest frames never wait
# here however the two clocks' wake-ups fall.
MIN_FORWARD_INTERVAL_S = OUTPUT_INTERVAL_S / 2.5
# Held text goes out at this size regardless of the interval: a job printing
# fast sends full-sized chunks (the sandbox's size trigger), which pass at once.
FORWARD_BYTES = MAX_OUTPUT_CHUNK_BYTES // 2
_OUTPUT_FIELDS = frozenset({"stream", "data"})


@dataclass(frozen=True, slots=True)
class OutputChunk:
    """Text a running job wrote on one stream, validated and bounded."""

    stream: Literal["stdout", "stderr"]
    data: str


#: Takes each chunk as the job writes; called on the thread that runs the job.
#: It must not block for long: the job's exchange waits for it.
OutputSink = Callable[[OutputChunk], None]


class OutputRefused(ValueError):
    """An output frame that is not one: dropped, and counted as junk."""


def is_output_frame(payload: bytes) -> bool:
    return payload[: len(OUTPUT_PREFIX)] == OUTPUT_PREFIX


def parse_output_frame(payload: bytes) -> OutputChunk:
    """Check and rebuild one output frame; raise :class:`OutputRefused` for anything else."""
    if len(payload) > MAX_OUTPUT_FRAME_BYTES:  # before any parsing
        raise OutputRefused(f"frame of {len(payload)} bytes; at most {MAX_OUTPUT_FRAME_BYTES}")
    try:
        document = hostwire.loads(payload)
    except hostwire.WireError as exc:
        raise OutputRefused(f"not valid JSON: {exc}") from None
    body = document.get("output") if isinstance(document, dict) and len(document) == 1 else None
    if not isinstance(body, dict) or body.keys() != _OUTPUT_FIELDS:
        raise OutputRefused('an output frame is {"output": {"stream": ..., "data": ...}}')
    stream, data = body["stream"], body["data"]
    if stream not in OUTPUT_STREAMS or not isinstance(data, str):
        raise OutputRefused("stream must be stdout or stderr, and data a string")
    # A lone surrogate (JSON allows one escaped) is not text any UTF-8 line can carry.
    return OutputChunk(stream, data.encode("utf-8", "replace").decode("utf-8"))


class _Held:
    """One stream's text on its way to the sink."""

    __slots__ = ("budget", "pieces", "size", "forwarded_at")

    def __init__(self, budget: int) -> None:
        self.budget = budget  # what the stream may still forward, measured as encoded_size
        self.pieces: list[str] = []
        self.size = 0  # encoded_size of what is held
        self.forwarded_at = float("-inf")


class OutputRelay:
    """One task's output frames: checked, bounded, coalesced and handed to ``sink``."""

    def __init__(self, sink: OutputSink, max_output: int, *, clock: Callable[[], float] = time.monotonic) -> None:
        self._sink: OutputSink | None = sink
        self._clock = clock
        self._held = {stream: _Held(max_output) for stream in OUTPUT_STREAMS}
        self.forwarded = 0  # chunks handed to the sink

    def receive(self, payload: bytes) -> None:
        """One output frame from the sandbox; :class:`OutputRefused` if it is not one."""
        chunk = parse_output_frame(payload)
        held = self._held[chunk.stream]
        data, size = _within(chunk.data, held.budget)
        # Once a piece is cut, nothing later may go out: the text must stay a prefix of the result's.
        held.budget = 0 if len(data) < len(chunk.data) else held.budget - size
        if not data:
            return
        held.pieces.append(data)
        held.size += size
        now = self._clock()
        if held.size >= FORWARD_BYTES or now - held.forwarded_at >= MIN_FORWARD_INTERVAL_S:
            self._forward(chunk.stream, held, now)

    def finish(self) -> None:
        """The task ended: what is held goes out now, ahead of its result."""
        for stream, held in self._held.items():
            if held.pieces:
                self._forward(stream, held, self._clock())

    def _forward(self, stream: Literal["stdout", "stderr"], held: _Held, now: float) -> None:
        data = "".join(held.pieces)
        held.pieces, held.size, held.forwarded_at = [], 0, now
        self.forwarded += 1
        sink = self._sink
        if sink is None:
            return
        try:
            sink(OutputChunk(stream, data))
        except Exception:  # noqa: BLE001 - the caller's bug must not end the job; its result still tells
            _log.exception("output_sink_failed")
            self._sink = None


def encoded_size(text: str) -> int:
    """What ``text`` takes in a result: JSON-escaped UTF-8, as the sandbox measures max_output."""
    return len(json.dumps(text, ensure_ascii=False).encode("utf-8")) - 2


def _within(data: str, budget: int) -> tuple[str, int]:
    """The longest prefix of ``data`` that takes at most ``budget`` in a result, and its size."""
    size = encoded_size(data)
    if size <= budget:
        return data, size
    low, high = 0, min(len(data), max(budget, 0))  # every character takes at least one byte
    while low < high:  # the longest prefix that fits: sizes grow with the prefix
        middle = (low + high + 1) // 2
        if encoded_size(data[:middle]) <= budget:
            low = middle
        else:
            high = middle - 1
    return data[:low], encoded_size(data[:low])
