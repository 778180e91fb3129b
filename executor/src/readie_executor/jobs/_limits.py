"""Memory and file-size limits, applied from inside the sandbox with setrlimit, and the
job's deadline, kept from inside with SIGALRM so that a timed-out job still answers
with its output so far.

These give honest code the errors it expects (MemoryError, OSError EFBIG) and
leave the sandbox alive to report them. They are not the last line: the
cgroup limit the worker sets on the sandbox kills the whole sandbox if memory
runs out anyway (gvisor-notes.md, Limits), and files the job writes outside
its grants land in the in-memory overlay that dies with the sandbox.

Both limits are kept in the hard limit too, so the job cannot lift them with
one setrlimit call; they last for the rest of the process, which is one job,
or one session whose limits are fixed by its first request.
"""

from __future__ import annotations

import contextlib
import resource
import signal
from collections.abc import Iterator
from dataclasses import dataclass

PROC_STATUS = "/proc/self/status"
# After the job the runner still formats a traceback and encodes a result of up
# to twice max_output; the hard limit leaves it this much beyond the job's
# limit. A job that raises its own soft limit gains at most this much.
MEMORY_HEADROOM_BYTES = 64 * 1024 * 1024
# Per output byte kept, the result costs a few copies (raw, decoded, escaped,
# encoded); the headroom grows with max_output by this factor.
HEADROOM_PER_OUTPUT_BYTE = 8


class JobTimedOut(BaseException):
    """Raised in the job's code at its deadline: a BaseException, so ``except Exception`` in
    the job does not swallow it (``except BaseException`` can; then the worker's kill follows)."""


_deadline_armed = False  # a job's deadline is running: SIGALRM means it has passed


def _deadline_passed(signum: int, frame: object) -> None:
    if not _deadline_armed:
        return  # between jobs (sent by something a job left behind): there is nothing to stop
    signal.setitimer(signal.ITIMER_REAL, 0)
    raise JobTimedOut


@contextlib.contextmanager
def deadline(timeout_ms: int | None) -> Iterator[None]:
    """Raise :class:`JobTimedOut` in the main thread once ``timeout_ms`` have passed.

    SIGALRM, so that a blocking call (a sleep, a socket read) is cut short
    too; C code that holds the GIL without checking for signals is not,
    and the worker's own deadline kills the sandbox shortly after. The
    handler stays installed between jobs (two system calls a job fewer,
    decision 33), put back only if a job replaced it through ``signal``; it
    acts only while a deadline runs. A job that changes SIGALRM's handling
    below Python (``sigaction`` through ctypes) loses this deadline for its
    session's later steps too, and meets the worker's.
    """
    global _deadline_armed
    if timeout_ms is None:
        yield
        return
    if signal.getsignal(signal.SIGALRM) is not _deadline_passed:
        signal.signal(signal.SIGALRM, _deadline_passed)
    _deadline_armed = True
    signal.setitimer(signal.ITIMER_REAL, timeout_ms / 1000)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        _deadline_armed = False


@dataclass(slots=True)
class _MemoryCeiling:
    memory_bytes: int
    soft: int


_ceiling: _MemoryCeiling | None = None


def virtual_memory_size() -> int | None:
    """This process's virtual size in bytes (VmSize), or None if it cannot be read."""
    try:
        with open(PROC_STATUS, encoding="ascii", errors="replace") as status:
            for line in status:
                if line.startswith("VmSize:"):
                    value, unit = line.split()[1:3]
                    return int(value) * 1024 if unit == "kB" else None
    except (OSError, ValueError):
        pass
    return None


def apply_memory_limit(memory_bytes: int | None, max_output: int) -> list[str]:
    """Limit the address space to the current size plus ``memory_bytes``; return policy notes.

    RLIMIT_AS counts address space, not resident memory, and a preloaded
    interpreter maps a lot before any job runs, so the limit is measured from
    that baseline rather than from zero. In a session the first step fixes the
    ceiling: what earlier steps keep in their namespace counts against it.
    """
    global _ceiling
    if memory_bytes is None:
        return []
    _, hard = resource.getrlimit(resource.RLIMIT_AS)
    if _ceiling is not None:
        notes = []
        if _ceiling.memory_bytes != memory_bytes:
            notes.append(
                f"memory: this process already runs under the limit of an earlier step "
                f"({_ceiling.memory_bytes} bytes); it was kept"
            )
        return notes + _set_address_space(_ceiling.soft, hard)
    baseline = virtual_memory_size()
    if baseline is None:
        return [f"memory: limit not applied: cannot read VmSize from {PROC_STATUS}"]
    soft = baseline + memory_bytes
    headroom = MEMORY_HEADROOM_BYTES + HEADROOM_PER_OUTPUT_BYTE * max_output
    notes = _set_address_space(soft, _lower(hard, soft + headroom))
    if not notes:
        _ceiling = _MemoryCeiling(memory_bytes, soft)
    return notes


def relax_memory_limit() -> None:
    """Lift the soft limit to the hard one, so the runner can write the result (ours, or one the
    job set itself: one getrlimit when neither did)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    if soft == hard:
        return
    with contextlib.suppress(OSError, ValueError):
        resource.setrlimit(resource.RLIMIT_AS, (hard, hard))


def memory_limit_bytes() -> int | None:
    return None if _ceiling is None else _ceiling.memory_bytes


def apply_file_size_limit(max_file_size: int | None) -> list[str]:
    """Make writes past ``max_file_size`` fail with OSError(EFBIG) instead of a signal."""
    if max_file_size is None:
        return []
    notes = []
    try:
        # CPython already ignores SIGXFSZ at start-up; said again because the
        # default action would kill the executor instead of failing the write.
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    except (OSError, ValueError) as exc:  # ValueError: not the main thread
        notes.append(
            f"file size: SIGXFSZ could not be ignored ({exc}); a large write may end the job"
        )
    _, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    limit = _lower(hard, max_file_size)
    if limit != max_file_size:
        notes.append(
            f"file size: an earlier limit of {hard} bytes is lower than the {max_file_size} asked"
        )
    try:
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))
    except (OSError, ValueError) as exc:
        notes.append(f"file size: limit not applied: {exc}")
    return notes


def _set_address_space(soft: int, hard: int) -> list[str]:
    try:
        resource.setrlimit(resource.RLIMIT_AS, (min(soft, hard), hard))
    except (OSError, ValueError) as exc:
        return [f"memory: limit not applied: setrlimit(RLIMIT_AS) failed: {exc}"]
    return []


def _lower(current_hard: int, wanted: int) -> int:
    return wanted if current_hard == resource.RLIM_INFINITY else min(current_hard, wanted)
