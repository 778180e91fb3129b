"""Hibernated sessions' images: a directory of the worker's own, bounded in number and bytes.

A session that hibernates (``sessions.py``) is checkpointed into an image
here and its sandbox ends; its next step restores it. A fork is a hibernate
whose image two sessions then share: each holds its own hard links, so
either may end and remove its copy without touching the other's.

The directory is the worker's alone (``images/`` in its state dir, mode
0700, in its private dirs: no grant may reach it), made empty at start
and removed at close with the state dir (``state_dir.py``): a worker
restart forgets hibernated sessions, as it forgets open ones. The image files are
runsc's, written by the sentry from its own state; the only reader is
``runsc restore``.

Bounds, checked before each checkpoint: at most ``max_images`` images, and
at most ``max_bytes`` in all. An image's size is known only once it is
written, so a hibernation books the sandbox's memory (what the image holds,
give or take the sentry's own share) when it starts, and the real size
replaces it when it is written: hibernations under way at once are counted
too. A refusal is a SandboxSetupError: the worker is full, not the request
wrong. The files hold the session's memory in clear, so they are the
worker's alone (0600 in a 0700 dir).
"""

from __future__ import annotations

import os
import secrets
import stat
import threading
from pathlib import Path

from .errors import SandboxSetupError
from .paths import remove_tree

__all__ = ["DEFAULT_MAX_HIBERNATED", "DEFAULT_MAX_HIBERNATED_BYTES", "SessionImages"]

#: Images kept at once: each is a session that left memory for disk, and a
#: worker keeps at most ``max_sessions`` sessions (default 16) anyway; forks
#: of one session are sessions too.
DEFAULT_MAX_HIBERNATED = 64
#: All images together. An idle pandas session's image is ~50 MB uncompressed
#: (``--compression=none``, measured), so this holds about eighty.
DEFAULT_MAX_HIBERNATED_BYTES = 4 * 1024**3
# Image directory names: unguessable is not needed (nothing else writes here), unique is.
_NAME_BYTES = 8


class SessionImages:
    """The images of one worker's hibernated sessions, each a directory under ``root`` (an
    empty directory of the worker's own, made by its state dir)."""

    def __init__(self, root: Path, max_images: int = DEFAULT_MAX_HIBERNATED, max_bytes: int = DEFAULT_MAX_HIBERNATED_BYTES) -> None:
        self.root = root
        self.max_images = max_images
        self.max_bytes = max_bytes
        self._lock = threading.Lock()
        self._sizes: dict[Path, int] = {}  # reserved or written images, and their bytes

    @property
    def count(self) -> int:
        with self._lock:
            return len(self._sizes)

    @property
    def bytes(self) -> int:
        with self._lock:
            return sum(self._sizes.values())

    def reserve(self, estimate: int = 0) -> Path:
        """An empty directory for a new image of about ``estimate`` bytes, booked until it is
        written; SandboxSetupError when the bounds would be passed."""
        with self._lock:
            self._check_room(estimate)
            image = self.root / secrets.token_hex(_NAME_BYTES)
            image.mkdir(mode=0o700)
            self._sizes[image] = estimate
            return image

    def written(self, image: Path) -> int:
        """Record the size of the image runsc wrote into ``image`` (and keep its files to the worker)."""
        size = _size_of(image)
        with self._lock:
            if image in self._sizes:
                self._sizes[image] = size
        return size

    def share(self, image: Path) -> Path:
        """A second image of the same bytes (hard links), for a fork; bounded like a new one."""
        copy = self.reserve()
        try:
            for entry in os.scandir(image):
                os.link(entry.path, copy / entry.name, follow_symlinks=False)
        except OSError as exc:
            self.remove(copy)
            raise SandboxSetupError(f"cannot share a session image: {exc.strerror}") from None
        self.written(copy)
        return copy

    def remove(self, image: Path) -> None:
        with self._lock:
            self._sizes.pop(image, None)
        remove_tree(image)

    def close(self) -> None:
        with self._lock:
            images, self._sizes = list(self._sizes), {}
        for image in images:
            remove_tree(image)

    def _check_room(self, estimate: int) -> None:
        if len(self._sizes) >= self.max_images:
            raise SandboxSetupError(f"this worker keeps at most {self.max_images} hibernated session images, and has as many")
        total = sum(self._sizes.values())
        if total + estimate > self.max_bytes:
            raise SandboxSetupError(
                f"this worker's hibernated session images take {total} bytes and this one about {estimate}; "
                f"its limit is {self.max_bytes}"
            )


def _size_of(image: Path) -> int:
    """Bytes of the regular files directly in ``image`` (runsc writes no others)."""
    total = 0
    for entry in os.scandir(image):
        info = entry.stat(follow_symlinks=False)
        if stat.S_ISREG(info.st_mode):
            os.chmod(entry.path, 0o600, follow_symlinks=False)
            total += info.st_size
    return total
