"""Files a job wrote to its write grants: what ``"report_files": true`` lists in its result.

The worker snapshots each write grant before the job and again after it
(the grants are host directories it can read), and lists the regular files
that are new or changed (size, modification time or inode): a file the job
wrote, by the job's own account of nothing. The tree is the job's: it can
hold links, a million entries or a deep nest by the time it is read, so the
walk follows no link (a link is listed as nothing), reads no file, and stops
at :data:`MAX_SCANNED_ENTRIES` or :data:`MAX_SCAN_DEPTH`; what it could not
see is reported as ``truncated``, never guessed.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Iterable
from dataclasses import dataclass

from readie_protocol.events import FileInfo

__all__ = ["MAX_LISTED_FILES", "MAX_SCANNED_ENTRIES", "MAX_SCAN_DEPTH", "Snapshot", "snapshot", "written_since"]

# Entries one snapshot stats, over all grants: about 0.1 s of the worker's time
# (twice per job that asks), and more files than a job's report is read for.
MAX_SCANNED_ENTRIES = 100_000
# Deeper than any tree a job means to write; a deeper one is a nest built to cost the walk.
MAX_SCAN_DEPTH = 64
# A result lists at most this many files: a model or a person reads the first
# thousand, and the line stays well under a megabyte (paths are at most 4 KiB).
MAX_LISTED_FILES = 1000
# PATH_MAX: a longer path cannot be opened by its name anyway.
MAX_PATH_BYTES = 4096


@dataclass(frozen=True, slots=True)
class Snapshot:
    files: dict[str, tuple[int, int, int]]  # path -> (size, mtime_ns, inode)
    complete: bool  # False when the walk stopped at a bound


def snapshot(roots: Iterable[str]) -> Snapshot:
    """The regular files beneath ``roots`` (absolute host directories), without following links."""
    files: dict[str, tuple[int, int, int]] = {}
    budget = MAX_SCANNED_ENTRIES
    complete = True
    pending = [(root, 0) for root in roots]
    while pending:
        directory, depth = pending.pop()
        try:
            with os.scandir(directory) as entries:
                for entry in entries:
                    budget -= 1
                    if budget < 0:
                        return Snapshot(files, False)
                    try:
                        info = entry.stat(follow_symlinks=False)
                    except OSError:  # gone meanwhile
                        continue
                    if stat.S_ISDIR(info.st_mode):
                        if depth + 1 > MAX_SCAN_DEPTH:
                            complete = False
                        else:
                            pending.append((entry.path, depth + 1))
                    elif stat.S_ISREG(info.st_mode):
                        files[entry.path] = (info.st_size, info.st_mtime_ns, info.st_ino)
        except OSError:  # not a directory (any more), or not readable: nothing to list there
            continue
    return Snapshot(files, complete)


def written_since(before: Snapshot, after: Snapshot) -> tuple[tuple[FileInfo, ...], bool]:
    """The files new or changed from ``before`` to ``after``, sorted, at most MAX_LISTED_FILES;
    and whether the list is incomplete (a walk stopped, or the list was cut)."""
    changed = sorted(path for path, seen in after.files.items() if before.files.get(path) != seen)
    listed = tuple(
        FileInfo(_text(path), after.files[path][0])
        for path in changed[:MAX_LISTED_FILES]
        if len(os.fsencode(path)) <= MAX_PATH_BYTES
    )
    return listed, not (before.complete and after.complete) or len(listed) < len(changed)


def _text(path: str) -> str:
    # A name the job chose may not be UTF-8: shown with replacement characters, as a result's text is.
    return os.fsencode(path).decode("utf-8", "replace")
