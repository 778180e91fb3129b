"""The pipes a capture hands the job as fds 1 and 2, and the one thread that reads them.

A job that writes more than a pipe holds blocks until someone reads, so a
thread reads while the job runs (:class:`Drainer`). Under gVisor a system
call costs tens of microseconds and a hand-off of the GIL between two
threads and back hundreds, so a capture makes as few of either as it can
(decision 33):

* **Descriptors dedicated.** Once the executor hands them over
  (:func:`dedicate_stdio`, before it serves), fds 1 and 2 *are* the pipes'
  write ends, and fd 0 is /dev/null, between jobs too: a capture checks them
  when it starts and fds 1 and 2 again when it ends (one ``os.fstat`` each: a
  job may close or replace any descriptor, and a stream it leaves behind may
  close one when it is collected) instead of saving, pointing and restoring
  all three, twelve system calls a job. What reaches the pipes between two
  captures the drain thread reads and drops; the executor's own log has a
  descriptor of its own (what is written to fd 2 itself between jobs, such as
  a fatal error's message, is lost).
* **Pipes kept.** The pipes outlive the capture: the next job gets the same
  ones when its fds 1 and 2 are still them. They are retired instead (fds 1
  and 2 pointed at /dev/null, the rest read until end of file or
  DRAIN_GRACE_SECONDS, the read ends closed, so that a writer still holding
  them gets EPIPE) when a job could have left a writer behind: it was allowed
  to start processes, or a thread it started is still alive. Otherwise
  nothing of the job runs between two captures.
* **The main thread reads last.** The drain thread watches the read ends
  (an epoll set, kept from job to job) and reads under the pipes' lock. When
  a job ends the main thread takes that lock, reads what the pipes hold
  itself (non-blocking) and has the job's streams hand what they still
  buffer straight to the capture (``_capture._JobStreamFile``), not through
  the pipes: it never waits for the thread, and the thread, asleep in
  epoll_wait, is woken only by output while the job runs.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import select
import stat
import threading
import time
from typing import Protocol

from ..hostwire import MAX_OUTPUT_CHUNK_BYTES

# A read this size empties a full pipe (64 KiB on Linux) in one call; so does one output frame.
READ_SIZE = MAX_OUTPUT_CHUNK_BYTES
# After a job whose pipes are retired, wait this long for them to report end of file. Longer
# means a descriptor the job duplicated (or gave a background process) is still open; the
# output written so far is kept and the rest is dropped.
DRAIN_GRACE_SECONDS = 1.0
STDIN_FD = 0
STDOUT_FD = 1
STDERR_FD = 2
CAPTURED_FDS = (STDOUT_FD, STDERR_FD)


class Receiver(Protocol):
    """What a capture gives its pipes: called with the pipes' lock held."""

    def take(self, fd: int, chunk: memoryview) -> None: ...

    def send_due(self) -> None: ...

    def poll_timeout_ms(self) -> int | None: ...


class CapturePipes:
    """Two pipes whose write ends are fds 1 and 2; the read ends both threads read (under ``lock``)."""

    def __init__(self, drainer: Drainer) -> None:
        self.lock = threading.Lock()
        self.receiver: Receiver | None = None  # the running capture; None between captures
        self.broken = False  # a read end failed or ended under us: retire these pipes
        self.readers: dict[int, int] = {}  # read end -> fd it stands in for
        self._inodes: dict[int, int] = {}  # fd 1 and 2 -> the inode of the pipe it is to be
        self._drainer = drainer
        self._chunk = bytearray(READ_SIZE)  # made now: the drain may read while the job holds all memory
        try:
            for fd in CAPTURED_FDS:
                read_end, write_end = os.pipe()
                self.readers[read_end] = fd
                try:
                    os.set_blocking(read_end, False)  # both threads read; neither may block holding the lock
                    self._inodes[fd] = os.fstat(write_end).st_ino
                    os.dup2(write_end, fd)  # the only write end this process holds
                finally:
                    os.close(write_end)
        except BaseException:
            self.close()
            raise
        self._open = set(self.readers)  # read ends not at their end yet

    def sound(self) -> bool:
        """Are fds 1 and 2 still these pipes, and their reader alive? (A job may close or replace any descriptor.)"""
        if self.broken or not self._drainer.running:
            return False
        return all(_is_pipe(fd, inode) for fd, inode in self._inodes.items())

    def start(self, receiver: Receiver) -> None:
        """Hand the pipes to a capture (watched already, unless they are new)."""
        with self.lock:
            self.receiver = receiver
            self._drainer.watch(self)

    def rest(self) -> None:
        """Between captures (the lock held): the drain thread watches them still, and drops what arrives."""
        self.receiver = None
        self._drainer.watch(self)

    def stop_watching(self) -> None:
        """From now on only the main thread reads (the lock held): the drain thread is not woken again."""
        self._drainer.unwatch(self)

    def read_available(self) -> None:
        """Read what the pipes hold now, without blocking (the lock held); a pipe at its end is broken."""
        self._read(list(self.readers), at_end_is_broken=True)

    def drain(self, read_end: int) -> None:
        """Read what ``read_end`` holds (on the drain thread)."""
        with self.lock:
            if read_end in self.readers and self._read([read_end], at_end_is_broken=True):
                self._drainer.unwatch(self)  # at its end: epoll would report it again and again

    def poll_timeout_ms(self) -> int | None:
        receiver = self.receiver
        return None if receiver is None else receiver.poll_timeout_ms()

    def send_due(self) -> None:
        with self.lock:
            if self.receiver is not None:
                self.receiver.send_due()

    def retire(self, grace_s: float) -> None:
        """Let go of our write ends and read to end of file, for at most ``grace_s`` (the main thread,
        not watched)."""
        self.release()
        deadline = time.monotonic() + grace_s
        open_ends = list(self.readers)
        while open_ends:
            with self.lock:
                if self._read(open_ends, at_end_is_broken=False):
                    return
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0:
                return
            poller = select.poll()  # only the ends still open: one at its end would answer at once
            for read_end in open_ends:
                poller.register(read_end, select.POLLIN)
            poller.poll(left_ms)
            open_ends = [end for end in open_ends if end in self._open]

    def release(self) -> None:
        """Point fds 1 and 2 at /dev/null (never closed: the next file opened would get their numbers)."""
        for fd in CAPTURED_FDS:
            with contextlib.suppress(OSError):
                os.dup2(devnull(), fd)
        self._inodes.clear()

    def close(self) -> None:
        """Close the read ends (after :meth:`release`, or with fds 1 and 2 another pipes' by then)."""
        for end in self.readers:
            with contextlib.suppress(OSError):
                os.close(end)
        self.readers.clear()

    def _read(self, read_ends: list[int], *, at_end_is_broken: bool) -> bool:
        """Read ``read_ends`` until each would block; True if every one of them is at its end."""
        view = memoryview(self._chunk)
        ended = 0
        for read_end in read_ends:
            while True:
                try:
                    count = os.readv(read_end, [self._chunk])
                except BlockingIOError:
                    self._open.add(read_end)
                    break
                except OSError:  # closed under us (EBADF): as good as its end
                    count = 0
                if count == 0:
                    ended += 1
                    self._open.discard(read_end)
                    self.broken = self.broken or at_end_is_broken
                    break
                if self.receiver is not None:
                    self.receiver.take(self.readers[read_end], view[:count])
                    self.receiver.send_due()  # before the next read: a frame holds at most one read
        return ended == len(read_ends)


def _is_pipe(fd: int, inode: int) -> bool:
    try:
        found = os.fstat(fd)
    except OSError:
        return False
    return stat.S_ISFIFO(found.st_mode) and found.st_ino == inode


class Drainer:
    """The process's one drain thread, on one epoll set: the read ends of the running capture.

    An epoll set, not poll: the main thread adds the read ends when a job
    starts and removes them when it ends, and epoll_ctl does not disturb
    the thread waiting in epoll_wait: it wakes only for output (and a
    streamed frame coming due).
    """

    def __init__(self) -> None:
        self._epoll = select.epoll()
        self._watched: dict[int, CapturePipes] = {}  # read end -> its pipes
        # Until _run returns (a Python thread ends no other way). Not Thread.is_alive(): that takes
        # a lock, and in CPython 3.11 a lock reads the clock, a system call in a sandbox's first
        # second after restore (decision 33).
        self.running = True
        self.thread = threading.Thread(target=self._run, name="readie-capture", daemon=True)
        try:
            self.thread.start()
        except BaseException:
            self.running = False
            raise

    def watch(self, pipes: CapturePipes) -> None:
        for read_end in pipes.readers:
            if self._watched.get(read_end) is not pipes:
                if read_end in self._watched:  # an end closed while watched, its number reused since
                    with contextlib.suppress(OSError):
                        self._epoll.unregister(read_end)
                self._watched[read_end] = pipes
                self._epoll.register(read_end, select.EPOLLIN)

    def unwatch(self, pipes: CapturePipes) -> None:
        for read_end in pipes.readers:
            if self._watched.get(read_end) is pipes:
                del self._watched[read_end]
                with contextlib.suppress(OSError):
                    self._epoll.unregister(read_end)

    def _run(self) -> None:
        try:
            self._serve()
        finally:
            self.running = False

    def _serve(self) -> None:
        while True:
            try:
                live = set(self._watched.values())
                timeouts = [t for p in live if (t := p.poll_timeout_ms()) is not None]
                events = self._epoll.poll(min(timeouts) / 1000 if timeouts else -1)
                for read_end, _ in events:
                    # An end unwatched since the wait began is the main thread's to read.
                    pipes = self._watched.get(read_end)
                    if pipes is not None:
                        pipes.drain(read_end)
                for pipes in set(self._watched.values()):
                    pipes.send_due()
            except MemoryError:
                continue  # the job holds all its memory; the next round may find some freed
            except (OSError, ValueError):
                return  # the epoll descriptor was closed under us: the next capture starts another thread


_the_drainer: Drainer | None = None
_kept: CapturePipes | None = None  # the last capture's pipes, for the next


def _forget_the_drainer() -> None:
    # A forked child has no drain thread (only the forking thread survives a fork): its next
    # capture, if it runs one, starts its own.
    if _the_drainer is not None:
        _the_drainer.running = False


os.register_at_fork(after_in_child=_forget_the_drainer)


def take_pipes() -> CapturePipes:
    """The pipes for a capture starting now, on fds 1 and 2: the last capture's if sound, else new ones."""
    global _the_drainer, _kept
    if not _dedicated:
        raise StdioNotDedicated("the job runner needs fds 0, 1 and 2 for itself: call dedicate_stdio() first")
    pipes, _kept = _kept, None
    if pipes is not None and pipes.sound():
        return pipes
    if pipes is not None:
        with pipes.lock:
            pipes.stop_watching()
        pipes.close()  # fds 1 and 2 are not both these pipes any more; the new ones go over them
    fill_stdio()
    if _the_drainer is None or not _the_drainer.running:
        _the_drainer = Drainer()
    return CapturePipes(_the_drainer)


def fill_stdio() -> None:
    """Put /dev/null on whichever of fds 0, 1 and 2 a job closed, lowest first, so that no pipe end
    or descriptor of ours is given one of their numbers (open() takes the lowest free one)."""
    for fd in (STDIN_FD, *CAPTURED_FDS):
        try:
            os.fstat(fd)
        except OSError:
            filler = os.open(os.devnull, os.O_RDWR)
            if filler == fd:
                os.set_inheritable(fd, True)  # as stdio is: os.open made it close-on-exec
            else:  # a number below was free after all (only if one closed under us)
                os.dup2(filler, fd)
                os.close(filler)


def stdin_from_devnull() -> None:
    """Make fd 0 /dev/null unless it is (one fstat: a job may have put anything there)."""
    global _devnull_identity
    try:
        found = os.fstat(STDIN_FD)
        if (found.st_dev, found.st_ino) == _devnull_identity:
            return
    except OSError:
        pass
    os.dup2(devnull(), STDIN_FD)
    found = os.fstat(STDIN_FD)
    _devnull_identity = (found.st_dev, found.st_ino)


_kept_devnull: tuple[int, int] | None = None  # a descriptor of /dev/null and its inode
_devnull_identity: tuple[int, int] | None = None  # /dev/null's device and inode, once fd 0 was made it


def devnull() -> int:
    """A descriptor of /dev/null, for reading and writing (what fds 0, 1 and 2 point at when not a
    job's). Kept (checked: a job may close any descriptor)."""
    global _kept_devnull
    if _kept_devnull is not None:
        fd, inode = _kept_devnull
        with contextlib.suppress(OSError):
            if os.fstat(fd).st_ino == inode:
                return fd
    fd = os.open(os.devnull, os.O_RDWR)
    if fd <= STDERR_FD:  # a job closed that one: it stays, as stdio (inheritable), and ours goes above
        os.set_inheritable(fd, True)
        fd = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, STDERR_FD + 1)
    _kept_devnull = (fd, os.fstat(fd).st_ino)
    return fd


class StdioNotDedicated(RuntimeError):
    """A job was run before the process handed its fds 0, 1 and 2 to job captures."""


_dedicated = False


def dedicate_stdio() -> int:
    """Hand fds 0, 1 and 2 to job captures for good; return a new descriptor of what fd 2 was.

    From here on fds 1 and 2 stay on the captures' pipes (or /dev/null) between jobs, and fd 0
    on /dev/null: whatever this process writes to them outside a job is dropped, so its own
    messages go to the descriptor returned (the executor's log). Call it once, before the first
    job, in a process that runs nothing but jobs (the executor; a test's child).
    """
    global _dedicated
    log = os.dup(STDERR_FD)  # not inherited by a job's processes (os.dup's default)
    _dedicated = True
    return log


def keep_pipes(pipes: CapturePipes) -> None:
    """Give ``pipes`` to the next capture (their capture ended, nothing of its job left), which checks fds 1 and 2 again."""
    global _kept
    _kept = pipes
