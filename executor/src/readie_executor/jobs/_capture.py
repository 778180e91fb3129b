"""The job's stdout and stderr, captured at the descriptor level and bounded.

File descriptors 1 and 2 point at pipes for the job's duration, so print(),
os.write(1, ...) and output of C extensions all land in the capture; stdin
reads from /dev/null, because the executor's real stdin is the pipe the worker
uses to hand a restored sandbox its settings.

Pipes rather than files: a file under /tmp lives in the sandbox's in-memory
overlay, so a job printing in a loop would grow the sandbox's memory until the
cgroup kills it, and RLIMIT_FSIZE (the job's max_file_size) would make print()
fail with EFBIG. A drain thread keeps the first bytes of each pipe and counts
the rest, so memory stays bounded by max_output however much the job writes.

A job that asked for streamed output (decision 16) also has what it writes
sent to the worker as output frames while it runs: the drain thread gathers
each stream's bytes and sends them at most every OUTPUT_INTERVAL_S, or
sooner once MAX_OUTPUT_CHUNK_BYTES are gathered; only the bytes the result
keeps are sent, so the frames never carry more than the result would.

The drain thread is started once and kept (:class:`_Drainer`): a thread
started per job cost a clone and a join under gVisor on every job and
session step. The first capture starts it, which in a warm sandbox is the
warm-up, after the checkpoint (a template has no thread but its main one).
"""

from __future__ import annotations

import codecs
import contextlib
import ctypes
import io
import os
import select
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..hostwire import MAX_OUTPUT_CHUNK_BYTES, OUTPUT_INTERVAL_S, OUTPUT_STREAMS, encode_output

# A read this size empties a full pipe (64 KiB on Linux) in one call; so does one output frame.
READ_SIZE = MAX_OUTPUT_CHUNK_BYTES
# Bytes kept beyond max_output: enough to finish a multi-byte character cut at
# the boundary and to know that more followed.
EXTRA_BYTES_KEPT = 8
# How often the drain thread looks at its stop flag when nothing arrives.
POLL_INTERVAL_MS = 50
# After the job, wait this long for the pipes to report end of file. Longer
# means a descriptor the job duplicated (or gave a background thread) is still
# open; the output written so far is kept and the rest is dropped.
DRAIN_GRACE_SECONDS = 1.0
STDOUT_FD = 1
STDERR_FD = 2
STDIN_FD = 0
STREAM_NAMES = dict(zip((STDOUT_FD, STDERR_FD), OUTPUT_STREAMS, strict=True))


@dataclass(frozen=True, slots=True)
class CapturedBytes:
    data: bytes  # the first bytes written, at most the kept amount
    total: int  # how many bytes the job wrote in all


class _BoundedSink:
    """The first bytes of one stream, in a buffer allocated before the job runs.

    The drain thread must keep reading while the job has used up its memory
    limit, or a job that prints after a MemoryError would block on a full
    pipe; so each read goes into buffers that already exist, and only small
    objects (a memoryview slice) are made per read.
    """

    def __init__(self, keep: int) -> None:
        self._buffer = bytearray(keep)
        self._length = 0
        self._total = 0

    def take(self, chunk: memoryview) -> memoryview:
        """Keep what fits of ``chunk``; return the part kept."""
        piece = chunk[: len(self._buffer) - self._length]
        self._buffer[self._length : self._length + len(piece)] = piece
        self._length += len(piece)
        self._total += len(chunk)
        return piece

    def result(self) -> CapturedBytes:
        return CapturedBytes(bytes(self._buffer[: self._length]), self._total)


class _Streamer:
    """One stream's bytes on their way to the worker as output frames (on the drain thread).

    ``send`` writes a frame on the executor's connection. Bytes are decoded
    as they go, a character cut between two reads waiting for its end, so
    the frames' text joined is the result's text. Nothing here may stop the
    drain: a send that fails (the connection broke, the job holds all its
    memory) ends the streaming, and the result still carries the output.
    """

    def __init__(self, name: str, budget: int, send: Callable[[bytes], None]) -> None:
        self._name = name
        self._budget = budget  # the bytes the result keeps: max_output
        self._send: Callable[[bytes], None] | None = send
        self._decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self._pending = bytearray()
        self.since: float | None = None  # when the oldest pending byte arrived

    def gather(self, piece: memoryview, now: float) -> None:
        piece = piece[: self._budget]
        self._budget -= len(piece)
        if piece and self._send is not None:
            self._pending += piece
            if self.since is None:
                self.since = now

    def due(self, now: float) -> bool:
        return self.since is not None and (
            now - self.since >= OUTPUT_INTERVAL_S or len(self._pending) >= MAX_OUTPUT_CHUNK_BYTES
        )

    def flush(self, final: bool = False) -> None:
        pending, self._pending, self.since = bytes(self._pending), bytearray(), None
        if self._send is None:
            return
        try:
            # A character cut by the budget is left out: the result, which keeps a few bytes
            # more, may show it whole, and the streamed text must stay a prefix of the result's.
            data = self._decoder.decode(pending, final and self._budget > 0)
            if data:
                self._send(encode_output(self._name, data))
        except Exception:  # noqa: BLE001 - ChannelBroken, MemoryError: the result still has it all
            self._send = None


class OutputCapture:
    """Redirects fds 0, 1 and 2 (and sys.stdin/stdout/stderr) while active.

    ``send``: stream the output as frames too (see the module's docstring).
    """

    def __init__(self, max_output: int, send: Callable[[bytes], None] | None = None) -> None:
        keep = max_output + EXTRA_BYTES_KEPT
        self._sinks = {STDOUT_FD: _BoundedSink(keep), STDERR_FD: _BoundedSink(keep)}
        self._streamers = {
            fd: _Streamer(name, max_output, send) for fd, name in STREAM_NAMES.items()
        } if send is not None else {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._drained = threading.Event()
        self.stdout = CapturedBytes(b"", 0)
        self.stderr = CapturedBytes(b"", 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        pipes = {fd: os.pipe() for fd in (STDOUT_FD, STDERR_FD)}
        readers = {read_end: fd for fd, (read_end, _) in pipes.items()}
        _drainer().submit(self, readers)
        saved_streams = (sys.stdin, sys.stdout, sys.stderr)
        _flush_python_streams(saved_streams)
        saved_fds = {fd: os.dup(fd) for fd in (STDIN_FD, STDOUT_FD, STDERR_FD)}
        job_streams: tuple[io.TextIOWrapper, ...] = ()
        try:
            devnull = os.open(os.devnull, os.O_RDONLY)
            os.dup2(devnull, STDIN_FD)
            os.close(devnull)
            for fd, (_, write_end) in pipes.items():
                os.dup2(write_end, fd)
            job_streams = _job_streams()
            sys.stdin, sys.stdout, sys.stderr = job_streams
            yield
        finally:
            _flush_python_streams((sys.stdout, sys.stderr))
            # Closed now (closefd=False leaves the descriptors alone) so that a
            # buffer that would not flush is dropped instead of reaching the
            # executor's own stdout when the wrapper is collected later.
            for stream in job_streams:
                with contextlib.suppress(Exception):
                    stream.close()
            _flush_c_stdio()
            sys.stdin, sys.stdout, sys.stderr = saved_streams
            for fd, saved in saved_fds.items():
                os.dup2(saved, fd)
                os.close(saved)
            # With fds 1 and 2 restored, these were the last write ends we hold:
            # the drain thread sees end of file unless the job kept a copy.
            for _, write_end in pipes.values():
                os.close(write_end)
            self._drained.wait(DRAIN_GRACE_SECONDS)
            self._stop.set()
            self._drained.wait()
            for read_end in readers:
                os.close(read_end)
            with self._lock:
                self.stdout = self._sinks[STDOUT_FD].result()
                self.stderr = self._sinks[STDERR_FD].result()

    def drain(self, readers: dict[int, int]) -> None:
        """Read ``readers`` until each ends or the capture stops (on the drain thread)."""
        try:
            self._drain(readers)
        finally:
            # Before the capture ends, so every frame goes out ahead of the result.
            for streamer in self._streamers.values():
                streamer.flush(final=True)
            self._drained.set()

    def _drain(self, readers: dict[int, int]) -> None:
        poller = select.poll()
        for read_end in readers:
            poller.register(read_end, select.POLLIN)
        open_ends = set(readers)
        chunk = bytearray(READ_SIZE)
        view = memoryview(chunk)
        while open_ends and not self._stop.is_set():
            try:
                for read_end, _ in poller.poll(self._poll_timeout_ms()):
                    try:
                        count = os.readv(read_end, [chunk])
                    except OSError:
                        count = 0
                    if count == 0:
                        poller.unregister(read_end)
                        open_ends.discard(read_end)
                        continue
                    fd = readers[read_end]
                    with self._lock:
                        kept = self._sinks[fd].take(view[:count])
                    if self._streamers:
                        self._streamers[fd].gather(kept, time.monotonic())
                self._send_due()
            except MemoryError:
                continue  # the job holds all its memory; the next round may find some freed

    def _poll_timeout_ms(self) -> int:
        waiting = [s.since for s in self._streamers.values() if s.since is not None]
        if not waiting:
            return POLL_INTERVAL_MS
        left = min(waiting) + OUTPUT_INTERVAL_S - time.monotonic()
        return max(0, min(POLL_INTERVAL_MS, int(left * 1000) + 1))

    def _send_due(self) -> None:
        now = time.monotonic()
        due = [s.since for s in self._streamers.values() if s.due(now) and s.since is not None]
        if not due:
            return
        # With a due stream goes any other that waits since before it, older first:
        # across the two streams, frames keep the order the pipes were read in.
        cutoff = max(due)
        waiting = [s for s in self._streamers.values() if s.since is not None and s.since <= cutoff]
        for streamer in sorted(waiting, key=lambda s: s.since or now):
            streamer.flush()


class _Drainer:
    """The process's one drain thread: it drains one capture at a time, then waits for the next."""

    def __init__(self) -> None:
        self._ready = threading.Condition()
        self._next: tuple[OutputCapture, dict[int, int]] | None = None
        self.thread = threading.Thread(target=self._run, name="readie-capture", daemon=True)
        self.thread.start()

    def submit(self, capture: OutputCapture, readers: dict[int, int]) -> None:
        with self._ready:
            self._next = (capture, readers)
            self._ready.notify()

    def _run(self) -> None:
        while True:
            with self._ready:
                while self._next is None:
                    self._ready.wait()
                capture, readers = self._next
                self._next = None
            capture.drain(readers)
            # Not kept while waiting: the capture's buffers (up to 2 x max_output) would stay allocated.
            del capture, readers


_the_drainer: _Drainer | None = None
_drainer_lock = threading.Lock()


def _drainer() -> _Drainer:
    global _the_drainer
    with _drainer_lock:
        if _the_drainer is None or not _the_drainer.thread.is_alive():
            _the_drainer = _Drainer()
        return _the_drainer


def _job_streams() -> tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]:
    # What python3 gives a script whose output is not a terminal: stdout
    # block-buffered and strict, stderr line-buffered with backslashreplace.
    stdin = io.TextIOWrapper(open(STDIN_FD, "rb", closefd=False), encoding="utf-8")  # noqa: SIM115
    stdout = io.TextIOWrapper(open(STDOUT_FD, "wb", closefd=False), encoding="utf-8")  # noqa: SIM115
    stderr = io.TextIOWrapper(
        open(STDERR_FD, "wb", closefd=False),  # noqa: SIM115
        encoding="utf-8",
        errors="backslashreplace",
        line_buffering=True,
    )
    return stdin, stdout, stderr


def _flush_python_streams(streams: tuple[object, ...]) -> None:
    for stream in streams:
        # The job may have closed or replaced these with anything.
        with contextlib.suppress(Exception):
            stream.flush()  # type: ignore[attr-defined]


def _flush_c_stdio() -> None:
    """Flush C-level stdio buffers, so a C extension's printf is captured too."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None).fflush(None)
