"""Files a job wrote to its write grants: what ``"report_files": true`` lists in its result.

The worker lists each write grant before the job and again after it (the
grants are host directories it can read), and reports the regular files that
are new or changed: a file the job wrote, by the worker's account.

The tree is the job's, and may still be changing while it is read (a thread
the job left behind runs until its sandbox is destroyed), so the walk trusts
no path twice. It goes by file descriptor: each directory is opened relative
to its parent's descriptor with ``O_NOFOLLOW`` and must be, once open, the
very directory (device and inode) the listing saw, on the grant's own
filesystem; a link, a swap or a mount point is not entered. It reads no
file, and stops at a bound of entries, depth, name bytes and time; what it
could not see is reported as ``truncated``, never guessed. A change is told
by size, modification time, inode and status-change time (which the job
cannot set back, as it can the modification time).
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterable
from dataclasses import dataclass

from readie_protocol.events import FileInfo

__all__ = [
    "MAX_LISTED_FILES",
    "MAX_NAME_BYTES",
    "MAX_SCANNED_ENTRIES",
    "MAX_SCAN_DEPTH",
    "MAX_SCAN_SECONDS",
    "Snapshot",
    "snapshot",
    "written_since",
]

# Entries one listing stats, over all grants: about half a second of the
# worker's time measured here (0.39-0.54 s for 100,000 short names, twice per
# job that asks), and more files than a job's report is read for.
MAX_SCANNED_ENTRIES = 100_000
# Deeper than any tree a job means to write; a deeper one is a nest built to cost the walk.
MAX_SCAN_DEPTH = 64
# The names one listing keeps, in bytes of their paths below the grant: long
# names would otherwise make a listing of 100,000 entries hold hundreds of MiB.
MAX_NAME_BYTES = 16 * 1024 * 1024
# Wall time of one listing: it runs outside the job's timeout, on the worker's thread.
MAX_SCAN_SECONDS = 2.0
# A result lists at most this many files: a model or a person reads the first
# thousand. Paths are at most PATH_MAX, so the list is at most 4 MiB, and 12
# MiB of JSON for names that are not UTF-8 (each byte a replacement character).
MAX_LISTED_FILES = 1000
_DIRECTORY_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK


@dataclass(frozen=True, slots=True)
class Snapshot:
    files: dict[str, tuple[int, int, int, int]]  # path -> (size, mtime_ns, inode, ctime_ns)
    complete: bool  # False when the walk stopped at a bound, or a directory could not be entered


class _Walk:
    def __init__(self) -> None:
        self.files: dict[str, tuple[int, int, int, int]] = {}
        self.entries = MAX_SCANNED_ENTRIES
        self.name_bytes = MAX_NAME_BYTES
        self.deadline = time.monotonic() + MAX_SCAN_SECONDS
        self.complete = True

    def spent(self) -> bool:
        if self.entries < 0 or self.name_bytes < 0 or time.monotonic() > self.deadline:
            self.complete = False
            return True
        return False

    def directory(self, fd: int, path: str, device: int, depth: int) -> None:
        """List the open directory ``fd`` (``path`` on the host); closes ``fd``."""
        subdirectories = []
        try:
            with os.scandir(fd) as entries:
                for entry in entries:
                    self.entries -= 1
                    self.name_bytes -= len(entry.name) + 1
                    if self.spent():
                        return
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:  # gone meanwhile
                        continue
                    if stat.S_ISREG(info.st_mode):
                        child = os.path.join(path, entry.name)
                        self.files[child] = (info.st_size, info.st_mtime_ns, info.st_ino, info.st_ctime_ns)
                    elif stat.S_ISDIR(info.st_mode):
                        subdirectories.append((entry.name, info))
            for name, seen in subdirectories:
                if depth + 1 > MAX_SCAN_DEPTH or self.spent():
                    self.complete = False
                    return
                child_fd = _enter(fd, name, seen, device)
                if child_fd is None:
                    self.complete = False
                    continue
                self.directory(child_fd, os.path.join(path, name), device, depth + 1)
        finally:
            os.close(fd)


def _enter(parent: int, name: str, seen: os.stat_result, device: int) -> int | None:
    """The directory ``name`` in ``parent``, if it still is the one seen, on the grant's filesystem."""
    try:
        fd = os.open(name, _DIRECTORY_FLAGS, dir_fd=parent)  # a link in its place: ELOOP
    except OSError:
        return None
    now = os.fstat(fd)
    if (now.st_dev, now.st_ino) != (seen.st_dev, seen.st_ino) or now.st_dev != device:
        os.close(fd)  # swapped since it was listed, or another filesystem mounted there
        return None
    return fd


def snapshot(roots: Iterable[str]) -> Snapshot:
    """The regular files beneath ``roots`` (absolute host directories, the job's write grants)."""
    walk = _Walk()
    for root in roots:
        if walk.spent():
            break
        try:
            fd = os.open(root, _DIRECTORY_FLAGS)
        except OSError:  # gone, or not a directory: nothing of it to list
            continue
        walk.directory(fd, root, os.fstat(fd).st_dev, 0)
    return Snapshot(walk.files, walk.complete)


def written_since(before: Snapshot, after: Snapshot) -> tuple[tuple[FileInfo, ...], bool]:
    """The files new or changed from ``before`` to ``after``, sorted, at most MAX_LISTED_FILES;
    and whether the list is incomplete (a walk stopped, or the list was cut)."""
    changed = sorted(path for path, seen in after.files.items() if before.files.get(path) != seen)
    listed = tuple(FileInfo(_text(path), after.files[path][0]) for path in changed[:MAX_LISTED_FILES])
    return listed, not (before.complete and after.complete) or len(listed) < len(changed)


def _text(path: str) -> str:
    # A name the job chose may not be UTF-8: shown with replacement characters, as a result's text is.
    return os.fsencode(path).decode("utf-8", "replace")
