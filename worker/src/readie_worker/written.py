"""Files a job wrote to its write grants: what ``"report_files": true`` lists in its result.

The worker lists each write grant before the job and again after it, and
reports the regular files that are new or changed: a file the job wrote, by
the worker's account. The listings are ``_grant_fs``'s (decision 24): each
grant is held by descriptor and must still be what the sandbox has mounted,
the walk goes by descriptor, trusts no path twice, enters no link, swap or
mount point, reads no file, and stops at a bound of entries, depth, name
bytes and time. This module only compares two listings (pure). What could
not be seen (a bound reached, a directory not entered, a grant moved or
replaced while held) is reported as ``truncated``, never guessed. A change
is told by size, modification time, inode and status-change time (which the
job cannot set back, as it can the modification time).
"""

from __future__ import annotations

import os

from readie_protocol.events import FileInfo
from readie_protocol.requests import MAX_LISTED_FILES

from ._grant_fs import Listing

__all__ = ["MAX_LISTED_FILES", "written_since"]



def written_since(before: Listing, after: Listing) -> tuple[tuple[FileInfo, ...], bool]:
    """The files new or changed from ``before`` to ``after``, sorted, at most MAX_LISTED_FILES;
    and whether the list is incomplete (a walk stopped, a grant changed, or the list was cut)."""
    changed = sorted(path for path, seen in after.files.items() if before.files.get(path) != seen)
    listed = tuple(FileInfo(_text(path), after.files[path][0]) for path in changed[:MAX_LISTED_FILES])
    seen_whole = before.complete and after.complete and not (before.changed or after.changed)
    return listed, not seen_whole or len(listed) < len(changed)


def _text(path: str) -> str:
    # A name the job chose may not be UTF-8: shown with replacement characters, as a result's text is.
    return os.fsencode(path).decode("utf-8", "replace")
