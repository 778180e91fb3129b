"""collect: the files a job's ``collect`` patterns match in its workspace, read after it ran
(decision 31).

What a pattern matches is :mod:`readie_executor.filewire`'s (the worker checks the answer
against it); the walk is this module's own, on directory descriptors (:mod:`._workspace`): it
never follows a link, looks at no more than ``MAX_WALK_ENTRIES`` entries and goes no deeper
than ``MAX_WALK_DEPTH``.

What matched and is not brought back is left out with a reason: ``link`` (never followed, on
the way or at the end), ``not_file`` (a device, FIFO or socket; a directory only when named
exactly: a glob walks through directories), ``changed`` (it grew, shrank or was replaced while
read), ``unreadable`` (it could not be opened or read; an exact path that names nothing), and
``count`` or ``size`` past the job's ``max_files`` or ``max_bytes``. A file matched twice is
taken once. The answer (:mod:`readie_executor.filewire`) lists the files taken, in the order
found, and holds their bytes one after the other.

Standard library only: this runs in the sandbox's own python3.
"""

from __future__ import annotations

import os
import stat
from fnmatch import fnmatchcase

from .._calls import RAW_RESPONSE_ATTRIBUTE
from ..filewire import encode_answer, is_glob, pattern_parts
from ._workspace import MAX_WALK_ENTRIES, READ_FLAGS, WorkspaceError, entry_names, open_dir, open_workspace, read_regular

__all__ = ["MAX_WALK_DEPTH", "collect"]

# Directories one ``**`` descends through: each level holds a descriptor open while the levels
# below are walked, and a result's path is at most 1 KiB anyway.
MAX_WALK_DEPTH = 32


def collect(
    cwd: str, patterns: list[str], max_files: int, max_bytes: int, max_left_out: int, max_path_bytes: int
) -> bytearray:
    """The files ``patterns`` match in the workspace ``cwd``, as a filewire answer:
    ``{"files": [{"path", "size"}], "left_out": [{"path", "reason", "size"}], "left_out_more",
    "walk_cut"}`` and the files' bytes. Never raises for what it finds."""
    collector = _Collector(max_files, max_bytes, max_left_out, max_path_bytes)
    try:
        root: int | None = open_workspace(cwd)
    except (WorkspaceError, OSError):
        root = None  # gone or replaced: exact paths are left out as unreadable, globs match nothing
    try:
        for pattern in patterns:
            parts = pattern_parts(pattern)
            if any(is_glob(part) for part in parts):
                if root is not None:
                    collector.match(root, "", parts, 0)
            else:
                collector.exact(root, parts)
    finally:
        if root is not None:
            os.close(root)
    return collector.answer()


setattr(collect, RAW_RESPONSE_ATTRIBUTE, True)


class _Collector:
    def __init__(self, max_files: int, max_bytes: int, max_left_out: int, max_path_bytes: int) -> None:
        self._max_files = max_files
        self._max_bytes = max_bytes
        self._max_left_out = max_left_out
        self._max_path_bytes = max_path_bytes
        self._files: list[dict[str, object]] = []
        self._data = bytearray()  # the files' bytes, one after the other: the answer's data
        self._left_out: list[dict[str, object]] = []
        self._left_out_more = 0
        self._seen: set[str] = set()
        self._budget = [MAX_WALK_ENTRIES]
        self._cut = False

    def answer(self) -> bytearray:
        header = {
            "files": self._files,
            "left_out": self._left_out,
            "left_out_more": self._left_out_more,
            "walk_cut": self._cut,
        }
        return encode_answer(header, self._data)

    def exact(self, root: int | None, parts: list[str]) -> None:
        """A pattern without glob characters: one path, left out when it names no file."""
        path = "/".join(parts)
        if path in self._seen:
            return
        if root is None:
            self._leave(path, "unreadable")
            return
        fd = os.dup(root)
        try:
            for part in parts[:-1]:
                try:
                    child = open_dir(fd, part)
                except OSError:  # a link on the way is never followed
                    self._leave(path, "link" if _is_link(_mode(fd, part)) else "unreadable")
                    return
                os.close(fd)
                fd = child
            mode = _mode(fd, parts[-1])
            if mode is None:
                self._leave(path, "unreadable")
            else:
                self._take(fd, parts[-1], path, mode, exact=True)
        finally:
            os.close(fd)

    def match(self, fd: int, prefix: str, parts: list[str], depth: int) -> None:
        """Match ``parts`` in open directory ``fd``, whose path in the workspace is ``prefix``."""
        head, rest = parts[0], parts[1:]
        if head == "**":
            self.match(fd, prefix, rest, depth)  # no directory
            for entry in self._entries(fd, prefix):
                if entry.is_dir(follow_symlinks=False):
                    self._descend(fd, entry.name, prefix, parts, depth)
            return
        if is_glob(head):
            names = [(entry.name, _entry_mode(entry)) for entry in self._entries(fd, prefix) if fnmatchcase(entry.name, head)]
        else:
            names = [(head, _mode(fd, head))]
        for name, mode in names:
            if mode is None:
                continue  # gone, or a literal name that is not there: nothing matched
            if rest:
                if stat.S_ISDIR(mode):
                    self._descend(fd, name, prefix, rest, depth)
            else:
                self._take(fd, name, prefix + name, mode, exact=False)

    def _descend(self, fd: int, name: str, prefix: str, parts: list[str], depth: int) -> None:
        if depth >= MAX_WALK_DEPTH or len((prefix + name).encode("utf-8")) >= self._max_path_bytes:
            self._cut = True
            return
        try:
            child = open_dir(fd, name)
        except OSError:
            return  # replaced by a link or gone since it was listed: never followed
        try:
            self.match(child, f"{prefix}{name}/", parts, depth + 1)
        finally:
            os.close(child)

    def _entries(self, fd: int, prefix: str) -> list[os.DirEntry[str]]:
        if self._budget[0] <= 0:
            self._cut = True
            return []
        try:
            entries, cut = entry_names(fd, self._budget)
        except OSError:  # out of descriptors, or the directory went away: nothing matched here
            return []
        self._cut = self._cut or cut
        return [entry for entry in entries if len((prefix + entry.name).encode("utf-8")) <= self._max_path_bytes]

    def _take(self, fd: int, name: str, path: str, mode: int, *, exact: bool) -> None:
        if path in self._seen:
            return
        if stat.S_ISDIR(mode) and not exact:
            return  # a glob walks through directories; it does not collect them
        self._seen.add(path)
        if stat.S_ISLNK(mode):
            self._leave(path, "link")
        elif not stat.S_ISREG(mode):
            self._leave(path, "not_file")
        else:
            self._read(fd, name, path)

    def _read(self, fd: int, name: str, path: str) -> None:
        try:
            file = os.open(name, READ_FLAGS, dir_fd=fd)
        except OSError:  # replaced by a link since it was looked at, or gone
            self._leave(path, "link" if _is_link(_mode(fd, name)) else "unreadable")
            return
        try:
            st = os.fstat(file)
            if not stat.S_ISREG(st.st_mode):
                self._leave(path, "changed")
            elif len(self._files) >= self._max_files:
                self._leave(path, "count", st.st_size)
            elif len(self._data) + st.st_size > self._max_bytes:
                self._leave(path, "size", st.st_size)
            else:
                data = read_regular(file, st.st_size)
                if data is None:
                    self._leave(path, "changed")
                else:
                    self._files.append({"path": path, "size": len(data)})
                    self._data += data
        except (OSError, MemoryError):
            self._leave(path, "unreadable")
        finally:
            os.close(file)

    def _leave(self, path: str, reason: str, size: int | None = None) -> None:
        self._seen.add(path)
        if len(self._left_out) < self._max_left_out:
            self._left_out.append({"path": path, "reason": reason, "size": size})
        else:
            self._left_out_more += 1


def _mode(fd: int, name: str) -> int | None:
    try:
        return os.stat(name, dir_fd=fd, follow_symlinks=False).st_mode
    except OSError:
        return None


def _is_link(mode: int | None) -> bool:
    return mode is not None and stat.S_ISLNK(mode)


def _entry_mode(entry: os.DirEntry[str]) -> int | None:
    try:
        return entry.stat(follow_symlinks=False).st_mode
    except OSError:
        return None
