"""Files the operator names on the command line (a config, a checkpoint archive, a plan), opened
so that naming something other than a file cannot stall readie.

``open()`` of a FIFO for reading waits for a writer, forever if none comes,
and a character device can answer a read without end. Such a path is opened
``O_NONBLOCK`` (which a FIFO honours at open and a regular file ignores),
held to be a regular file by ``fstat`` on that descriptor, and only then
switched back to blocking reads: what was checked is what is read.

Symlinks are followed: these are the operator's own paths. A path a request
names is never opened this way (``paths`` opens those without following links).
"""

from __future__ import annotations

import os
import stat

__all__ = ["FileRefused", "open_regular", "read_regular"]

_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
)


class FileRefused(OSError):
    """Not a regular file, or larger than the caller's limit. An OSError, so that every caller's
    "cannot read" path reports it; ``str()`` is the reason, without the path."""


def open_regular(path: str | os.PathLike[str]) -> int:
    """A blocking, read-only descriptor of the regular file at ``path``; :class:`FileRefused` for
    anything else, before a single byte is read. The caller closes it."""
    # O_NOCTTY: a terminal named by mistake does not become the process's controlling tty.
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC)
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            kind = next((name for test, name in _KINDS if test(mode)), "not a file")
            raise FileRefused(f"not a regular file ({kind})")
        os.set_blocking(fd, True)
    except BaseException:
        os.close(fd)
        raise
    return fd


def read_regular(path: str | os.PathLike[str], limit: int) -> bytes:
    """The contents of the regular file at ``path`` (:func:`open_regular`); :class:`FileRefused`
    past ``limit`` bytes, whether it was that large when opened or grew while it was read."""
    with os.fdopen(open_regular(path), "rb") as file:
        size = os.fstat(file.fileno()).st_size
        if size > limit:
            raise FileRefused(f"{size} bytes, more than the {limit} allowed")
        data = file.read(limit + 1)
    if len(data) > limit:
        raise FileRefused(f"more than the {limit} bytes allowed")
    return data
