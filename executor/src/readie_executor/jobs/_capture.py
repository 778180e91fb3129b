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

The drain thread is started once and kept, the pipes are kept for the next
job when nothing of this one can write on, and the main thread reads what a
job leaves in them itself (:mod:`._drain`): a thread started per job, pipes
made per job and waiting for the thread at the job's end cost a clone, a
dozen system calls and thread hand-offs under gVisor on every job and
session step. The first capture starts the thread, which in a warm sandbox
is the warm-up, after the checkpoint (a template has no thread but its main
one).
"""

from __future__ import annotations

import _thread
import codecs
import contextlib
import ctypes
import io
import mmap
import os
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ..hostwire import MAX_OUTPUT_CHUNK_BYTES, OUTPUT_INTERVAL_S, OUTPUT_STREAMS, encode_output
from ._drain import (
    DRAIN_GRACE_SECONDS,
    READ_SIZE,
    STDERR_FD,
    STDIN_FD,
    STDOUT_FD,
    CapturePipes,
    keep_pipes,
    stdin_from_devnull,
    take_pipes,
)

# Bytes kept beyond max_output: enough to finish a multi-byte character cut at
# the boundary and to know that more followed.
EXTRA_BYTES_KEPT = 8
# A capture's two buffers are kept for the next capture of the same size (a session's next
# step; a warm sandbox's job after its warm-up): mapping and unmapping them cost more under
# gVisor than the rest of a capture. Only up to this size (the default max_output fits): a
# sandbox keeps at most two such mappings, and of them only the pages output reached.
MAX_KEPT_BUFFER_BYTES = 2 * 1024 * 1024
# The buffer of the job's sys.stdout and sys.stderr: what python3 gives a pipe.
JOB_STREAM_BUFFER_BYTES = io.DEFAULT_BUFFER_SIZE
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

    The buffer is an anonymous mapping, not a bytearray: its address space is
    taken before the job (so the memory limit, measured after, counts it as
    the baseline's), but a page is touched only when output reaches it. A
    bytearray of the default 1 MiB is zero-filled at once, and under gVisor
    first-touching its 256 pages twice per job cost more than all the rest of
    the runner's set-up; the mapping itself is kept for the next capture
    (:data:`MAX_KEPT_BUFFER_BYTES`, decision 33).
    """

    def __init__(self, keep: int) -> None:
        self._buffer = _kept_buffers.take(keep)
        self._keep = keep
        self._length = 0
        self._total = 0

    def take(self, chunk: memoryview) -> memoryview:
        """Keep what fits of ``chunk``; return the part kept."""
        piece = chunk[: self._keep - self._length]
        self._buffer[self._length : self._length + len(piece)] = piece
        self._length += len(piece)
        self._total += len(chunk)
        return piece

    def result(self) -> CapturedBytes:
        """What was kept, as bytes; the buffer goes back for the next capture, and nothing may
        be taken after."""
        kept = CapturedBytes(self._buffer[: self._length], self._total)
        _kept_buffers.give_back(self._buffer)
        return kept


class _KeptBuffers:
    """The buffers of the last capture, for the next one (on the main thread only: a capture's
    sinks are made before its drain and read after it)."""

    def __init__(self) -> None:
        self._spare: list[mmap.mmap] = []

    def take(self, keep: int) -> mmap.mmap:
        size = max(keep, 1)  # a mapping cannot be empty
        for index, buffer in enumerate(self._spare):
            if len(buffer) == size:
                return self._spare.pop(index)
        for buffer in self._spare:  # another size: the next captures will not want these either
            buffer.close()
        self._spare.clear()
        return mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)

    def give_back(self, buffer: mmap.mmap) -> None:
        if len(buffer) <= MAX_KEPT_BUFFER_BYTES and len(self._spare) < len(STREAM_NAMES):
            self._spare.append(buffer)
        else:
            buffer.close()


_kept_buffers = _KeptBuffers()


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
    """Takes what fds 1 and 2 (the pipes') and sys.stdout/stderr get while active; sys.stdin and fd 0
    read /dev/null.

    ``send``: stream the output as frames too (see the module's docstring).
    ``subprocesses``: the job may start processes, which may outlive it and write on.
    """

    def __init__(
        self, max_output: int, send: Callable[[bytes], None] | None = None, *, subprocesses: bool = True
    ) -> None:
        self._subprocesses = subprocesses
        keep = max_output + EXTRA_BYTES_KEPT
        self._sinks = {STDOUT_FD: _BoundedSink(keep), STDERR_FD: _BoundedSink(keep)}
        self._streamers = {
            fd: _Streamer(name, max_output, send) for fd, name in STREAM_NAMES.items()
        } if send is not None else {}
        self.stdout = CapturedBytes(b"", 0)
        self.stderr = CapturedBytes(b"", 0)

    @contextlib.contextmanager
    def active(self) -> Iterator[None]:
        # The process's own streams: what they hold is not the job's (fds 1 and 2 are the pipes
        # already, a dedicated process's: _drain.dedicate_stdio).
        saved_streams = (sys.stdin, sys.stdout, sys.stderr)
        _flush_python_streams(saved_streams)
        pipes = take_pipes()
        pipes.start(self)
        job_streams: tuple[io.TextIOWrapper, ...] = ()
        try:
            stdin_from_devnull()
            job_streams = _kept_streams.take()
            sys.stdin, sys.stdout, sys.stderr = job_streams
            yield
        finally:
            # Nothing the job started may write on after it: then the pipes are kept for the next job.
            # (The drain thread is the one thread of the runner's own: _drain.Drainer.) And fds 1 and
            # 2 must still be them: else what the job's streams hold goes where the job put them.
            keep = not self._subprocesses and _thread._count() == 1 and pipes.sound()
            self._take_last_output(pipes, job_streams, straight=keep)
            sys.stdin, sys.stdout, sys.stderr = saved_streams
            self._finish(pipes, keep=keep)

    def _take_last_output(
        self, pipes: CapturePipes, job_streams: tuple[io.TextIOWrapper, ...], *, straight: bool
    ) -> None:
        """Take what the job's streams still hold, after what its pipes hold, in the order written.

        Most of a small job's output is still in its streams' buffers when it ends. Written
        into the pipes, it would wake the drain thread (a GIL hand-off: hundreds of us under
        gVisor). So when nothing of the job is left running and fds 1 and 2 are still the
        pipes (``straight``), the main thread reads the pipes itself and the capture's own
        streams hand their rest straight to the sinks (:class:`_JobStreamFile`), all under
        the pipes' lock: the thread, still watching, is not woken. A stream the job put in
        their place, one of ours it decorated (its flush would be the job's code, run holding
        the lock), and C's stdio, are flushed as they are, outside the lock (into a pipe, they
        may write more than it holds), and the thread reads with the main thread.
        """
        plain = tuple(stream for stream in job_streams[1:] if straight and _plain(stream))
        others: list[object] = []
        for stream in (sys.stdout, sys.stderr, *job_streams[1:]):
            if not _among(stream, plain) and not _among(stream, others):
                others.append(stream)
        flushed = _flush_python_streams(tuple(others))
        with pipes.lock:
            pipes.read_available()
            with _straight_to(self):
                flushed |= _flush_python_streams(plain)
        _kept_streams.give_back(job_streams, flushed)
        # Every FILE C holds, not only its stdout and stderr (a job's fdopen(1) too); then what
        # they wrote, after what the streams held, as python3's exit would.
        _flush_c_stdio()
        with pipes.lock:
            pipes.read_available()

    def _finish(self, pipes: CapturePipes, keep: bool) -> None:
        if not keep or pipes.broken:
            with pipes.lock:
                pipes.stop_watching()  # retire reads alone
            # A process or thread of the job may still hold a copy of a write end: read until none
            # does, for at most the grace; one still writing after that gets EPIPE.
            pipes.retire(DRAIN_GRACE_SECONDS)
        keep = keep and not pipes.broken
        with pipes.lock:
            pipes.receiver = None
            # After the drain thread's last frame, so every frame goes out ahead of the result.
            for streamer in self._streamers.values():
                streamer.flush(final=True)
            self.stdout = self._sinks[STDOUT_FD].result()
            self.stderr = self._sinks[STDERR_FD].result()
            if keep:
                pipes.rest()
        if keep:
            keep_pipes(pipes)
        else:
            pipes.close()

    def take(self, fd: int, chunk: memoryview) -> None:
        """Keep what fits of ``chunk``, read from the pipe of ``fd`` (with the pipes' lock held)."""
        kept = self._sinks[fd].take(chunk)
        if self._streamers:
            self._streamers[fd].gather(kept, time.monotonic())

    def poll_timeout_ms(self) -> int | None:
        """How long the drain may wait for output before a streamed frame is due; None: no limit."""
        waiting = [s.since for s in self._streamers.values() if s.since is not None]
        if not waiting:
            return None
        left = min(waiting) + OUTPUT_INTERVAL_S - time.monotonic()
        return max(0, int(left * 1000) + 1)

    def send_due(self) -> None:
        if not self._streamers:
            return
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


# What python3 gives a script whose output is not a terminal: stdout block-buffered and strict,
# stderr line-buffered with backslashreplace. The text goes straight to the buffer
# (write_through): what the job's end still flushes is the buffer's. Per fd: errors,
# line_buffering, write_through.
_STREAM_SETTINGS = {
    STDIN_FD: ("strict", False, False),
    STDOUT_FD: ("strict", False, True),
    STDERR_FD: ("backslashreplace", True, True),
}


class _KeptStreams:
    """The job's sys.stdin, sys.stdout and sys.stderr, kept for the next job while they are as made.

    Making them costs three system calls each (fstat, ioctl, lseek), and closing them takes
    each buffer's lock several times: in CPython 3.11 every lock acquire reads the clock, which
    in a sandbox's first second after a restore is a system call too (decision 33). So a job's
    streams go on to the next job (a session's next step; a warm sandbox's job after its
    warm-up: the same user's, never another's) unless the job closed, detached, reconfigured
    or decorated them, or their last flush failed: then they are closed (closefd=False leaves the
    descriptors alone; a buffer that would not flush is dropped, not written to the executor's
    own stdout when collected later) and the next job gets new ones. Two settings cannot be seen
    and go on with the streams, both the session's own doing: a newline translation set with
    ``reconfigure(newline=...)``, and what is left unread in ``sys.stdin``'s buffer by a step
    that put another file on fd 0 and read part of it (fd 0 is /dev/null again for every job).
    """

    def __init__(self) -> None:
        self._streams: tuple[io.TextIOWrapper, ...] | None = None
        self._layers: tuple[tuple[object, object], ...] = ()  # each stream's buffer and raw file

    def take(self) -> tuple[io.TextIOWrapper, ...]:
        streams, self._streams = self._streams, None
        if streams is not None:
            return streams
        made = tuple(_new_stream(fd) for fd in _STREAM_SETTINGS)
        self._layers = tuple((stream.buffer, stream.buffer.raw) for stream in made)
        return made

    def give_back(self, streams: tuple[io.TextIOWrapper, ...], flushed: set[int]) -> None:
        """After the job: keep ``streams`` if intact and empty (``flushed``: ids of the ones flushed)."""
        if len(streams) == len(_STREAM_SETTINGS) and all(
            self._as_made(stream, fd, flushed) for stream, fd in zip(streams, _STREAM_SETTINGS, strict=True)
        ):
            self._streams = streams
            return
        for stream in streams:
            with contextlib.suppress(Exception):
                stream.close()

    def _as_made(self, stream: io.TextIOWrapper, fd: int, flushed: set[int]) -> bool:
        errors, line_buffering, write_through = _STREAM_SETTINGS[fd]
        try:
            buffer, raw = self._layers[fd]
            intact = (
                type(stream) is io.TextIOWrapper
                # Attributes set on any layer (a replaced write, say) would go on working.
                and not vars(stream) and not vars(buffer) and vars(raw) == {"name": fd}  # open() names it
                and not stream.closed
                and stream.buffer is buffer
                and buffer.raw is raw  # type: ignore[attr-defined]
                and stream.encoding == "utf-8"
                and stream.errors == errors
                and stream.line_buffering is line_buffering
                and stream.write_through is write_through
            )
            if intact and fd != STDIN_FD and id(stream) not in flushed:
                stream.flush()  # the job's sys.stdout was another: this one may hold its output
            return intact
        except Exception:  # noqa: BLE001 - detached, closed, a flush that failed: not kept
            return False


_kept_streams = _KeptStreams()


class _JobStreamFile(io.FileIO):
    """fd 1 or 2 under the job's sys.stdout or sys.stderr: a FileIO whose writes go, while its
    capture takes the job's last output, straight to that capture instead of into the pipe."""

    __slots__ = ()

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        capture = _taking_last_output
        if capture is None:
            return super().write(data)
        whole = memoryview(data).cast("B")
        # A read's worth at a time, as from the pipe: a streamed frame holds at most one.
        for start in range(0, len(whole), READ_SIZE):
            capture.take(self.fileno(), whole[start : start + READ_SIZE])
            capture.send_due()
        return len(whole)


# The capture taking its job's last output (with its pipes' lock held, on the main thread).
_taking_last_output: OutputCapture | None = None


@contextlib.contextmanager
def _straight_to(capture: OutputCapture) -> Iterator[None]:
    global _taking_last_output
    _taking_last_output = capture
    try:
        yield
    finally:
        _taking_last_output = None


def _plain(stream: io.TextIOWrapper) -> bool:
    """Is this one of the capture's streams as made, no attribute set on a layer (its flush ours alone)?"""
    try:
        buffer = stream.buffer
        raw = buffer.raw  # type: ignore[attr-defined]
        return (
            type(stream) is io.TextIOWrapper and not vars(stream)
            and type(buffer) is io.BufferedWriter and not vars(buffer)
            and type(raw) is _JobStreamFile and vars(raw) == {"name": raw.fileno()}
        )
    except Exception:  # noqa: BLE001 - detached, closed: not ours to flush under the lock
        return False


def _among(stream: object, streams: tuple[object, ...] | list[object]) -> bool:
    return any(stream is other for other in streams)


def _new_stream(fd: int) -> io.TextIOWrapper:
    errors, line_buffering, write_through = _STREAM_SETTINGS[fd]
    if fd == STDIN_FD:
        layer: io.BufferedIOBase = open(fd, "rb", closefd=False)  # noqa: SIM115
    else:
        # What open(fd, "wb", buffering=..., closefd=False) makes, on our FileIO.
        layer = io.BufferedWriter(_JobStreamFile(fd, "wb", closefd=False), JOB_STREAM_BUFFER_BYTES)
    return io.TextIOWrapper(
        layer, encoding="utf-8", errors=errors, line_buffering=line_buffering, write_through=write_through
    )


def _flush_python_streams(streams: tuple[object, ...]) -> set[int]:
    """Flush each; the ids of those whose flush went through."""
    flushed = set()
    for stream in streams:
        # The job may have closed or replaced these with anything.
        with contextlib.suppress(Exception):
            stream.flush()  # type: ignore[attr-defined]
            flushed.add(id(stream))
    return flushed


_libc: ctypes.CDLL | None = None


def _load_libc() -> ctypes.CDLL:
    global _libc
    if _libc is None:  # loaded once: a CDLL per job was a dlopen and a dozen objects each time
        _libc = ctypes.CDLL(None)
    return _libc


def _flush_c_stdio() -> None:
    """Flush C-level stdio buffers, so a C extension's printf is captured too."""
    with contextlib.suppress(Exception):
        _load_libc().fflush(None)
