"""Trees on disk for checkpoint archives: listing one (export, reuse checks) and writing one (import).

Writing never follows a symlink and never leaves the install root: every
directory is opened ``O_NOFOLLOW | O_DIRECTORY`` relative to its parent's
descriptor, starting from the root's, and every file is created
``O_EXCL | O_NOFOLLOW`` in such a directory. A symlink is made as a symlink
and never entered, so a member ``a -> /etc`` followed by ``a/passwd`` fails
at the open of ``a`` (the digest manifest's own rules refuse it earlier).
Nothing in Python's tarfile extraction is used (its filters arrived in
3.11.4 and are not ours to rely on).
"""

from __future__ import annotations

import errno
import hashlib
import os
import stat
from collections.abc import Callable, Iterator
from pathlib import Path

from .archive_format import (
    DIR,
    FILE,
    KEPT_MODE_BITS,
    MAX_READ_BYTES,
    SYMLINK,
    ArchiveError,
    DigestMismatch,
    ArchiveMember,
    UnsafeMember,
    check_name,
    kind_of,
)

# Copy and hash in blocks this size: big enough for throughput, far below MAX_READ_BYTES.
BLOCK_BYTES = 1024 * 1024
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def list_tree(root: Path, prefix: str, *, hash_files: bool = True) -> tuple[list[ArchiveMember], list[str]]:
    """Every entry under ``root`` as members named ``prefix/...`` (``prefix`` is ``root`` itself),
    parents before children, sorted; and the names of what is not carried (devices, fifos, sockets)."""
    members = [_member_of(root, prefix, os.lstat(root), hash_files)]
    if members[0].type != DIR:
        raise ArchiveError(f"{root} is not a directory")
    skipped: list[str] = []
    for path, name, info in _walk(root, prefix):
        kind = kind_of(info.st_mode)
        if kind is None:
            skipped.append(name)
            continue
        check_name(name)
        members.append(_member_of(path, name, info, hash_files))
    return members, skipped


def _walk(root: Path, prefix: str) -> Iterator[tuple[Path, str, os.stat_result]]:
    with os.scandir(root) as scan:
        entries = sorted(scan, key=lambda entry: entry.name)
    for entry in entries:
        info = entry.stat(follow_symlinks=False)
        name = f"{prefix}/{entry.name}"
        yield Path(entry.path), name, info
        if stat.S_ISDIR(info.st_mode):
            yield from _walk(Path(entry.path), name)


def _member_of(path: Path, name: str, info: os.stat_result, hash_files: bool) -> ArchiveMember:
    kind = kind_of(info.st_mode)
    mode = stat.S_IMODE(info.st_mode) & KEPT_MODE_BITS
    if kind == FILE:
        digest = sha256_of(path, info.st_size) if hash_files else None
        return ArchiveMember(name, FILE, mode, info.st_mtime_ns, info.st_size, digest)
    if kind == SYMLINK:
        return ArchiveMember(name, SYMLINK, 0o777, info.st_mtime_ns, target=os.readlink(path))
    return ArchiveMember(name, DIR, mode, info.st_mtime_ns)


def sha256_of(path: Path, size: int) -> str:
    """The hash of ``path``, opened without following a symlink; refused if it is not ``size`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        digest, seen = hashlib.sha256(), 0
        while block := file.read(BLOCK_BYTES):
            digest.update(block)
            seen += len(block)
    if seen != size:
        raise DigestMismatch(f"{path} changed while it was read ({seen} bytes, {size} listed)")
    return "sha256:" + digest.hexdigest()


class TreeWriter:
    """Creates members under one install root, by descriptor; :meth:`finish` sets directory modes last.

    Directories are made owner-only and given their listed mode (and mtime)
    only at :meth:`finish`, deepest first, so a read-only directory does not
    stop its own children from being created.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self._root_fd = os.open(root, _DIR_FLAGS)
        self._dirs: list[ArchiveMember] = []

    def close(self) -> None:
        if self._root_fd >= 0:
            os.close(self._root_fd)
            self._root_fd = -1

    def __enter__(self) -> TreeWriter:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def mkdir(self, member: ArchiveMember) -> None:
        parent, name = self._parent(member)
        try:
            os.mkdir(name, 0o700, dir_fd=parent)
        except OSError as exc:
            raise UnsafeMember(f"member {member.path!r}: cannot create the directory: {exc.strerror}") from None
        finally:
            os.close(parent)
        self._dirs.append(member)

    def symlink(self, member: ArchiveMember) -> None:
        assert member.target is not None
        parent, name = self._parent(member)
        try:
            os.symlink(member.target, name, dir_fd=parent)  # made, never followed
            os.utime(name, ns=(member.mtime_ns, member.mtime_ns), dir_fd=parent, follow_symlinks=False)
        except OSError as exc:
            raise UnsafeMember(f"member {member.path!r}: cannot create the symlink: {exc.strerror}") from None
        finally:
            os.close(parent)

    def write_file(self, member: ArchiveMember, read: Callable[[int], bytes]) -> None:
        """Create ``member`` from ``read(n)``, hashing as it goes; refused if its bytes are not the listed ones."""
        parent, name = self._parent(member)
        try:
            fd = os.open(name, _NEW_FILE_FLAGS, 0o600, dir_fd=parent)
        except OSError as exc:
            raise UnsafeMember(f"member {member.path!r}: cannot create the file: {exc.strerror}") from None
        finally:
            os.close(parent)
        with os.fdopen(fd, "wb") as file:
            digest = hashlib.sha256()
            left = member.size
            while left > 0:
                block = read(min(BLOCK_BYTES, left))
                if not block:
                    raise DigestMismatch(f"member {member.path!r} ends {left} bytes short of its listed {member.size}")
                digest.update(block)
                file.write(block)
                left -= len(block)
            os.fchmod(file.fileno(), member.mode & KEPT_MODE_BITS)
            file.flush()
            os.utime(file.fileno(), ns=(member.mtime_ns, member.mtime_ns))
        found = "sha256:" + digest.hexdigest()
        if found != member.sha256:
            raise DigestMismatch(f"member {member.path!r} is corrupt: sha256 {found}, the digest manifest says {member.sha256}")

    def finish(self) -> None:
        """Give each directory its listed mode and mtime, children before parents."""
        for member in sorted(self._dirs, key=lambda m: len(m.parts), reverse=True):
            fd = self._open_dir(member.parts, member.path)
            try:
                os.fchmod(fd, member.mode & KEPT_MODE_BITS)
                os.utime(fd, ns=(member.mtime_ns, member.mtime_ns))
            finally:
                os.close(fd)

    def _parent(self, member: ArchiveMember) -> tuple[int, str]:
        """A descriptor of ``member``'s parent directory (the caller closes it) and its own name."""
        parts = member.parts
        return self._open_dir(parts[:-1], member.path), parts[-1]

    def _open_dir(self, parts: tuple[str, ...], path: str) -> int:
        fd = os.dup(self._root_fd)
        for part in parts:
            try:
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
            except OSError as exc:
                os.close(fd)
                why = "is a symlink or not a directory" if exc.errno in (errno.ELOOP, errno.ENOTDIR) else exc.strerror
                raise UnsafeMember(f"member {path!r}: its parent component {part!r} {why}; refusing to write through it") from None
            os.close(fd)
            fd = child
        return fd


def same_tree(listed: list[ArchiveMember], found: list[ArchiveMember]) -> list[str]:
    """What differs between two listings of a tree (mtimes aside: restore does not depend on them,
    decision 18); empty when they are the same tree."""
    def key(member: ArchiveMember) -> tuple[object, ...]:
        return (member.type, member.mode if member.type != SYMLINK else None, member.size, member.sha256, member.target)

    want = {member.path: key(member) for member in listed}
    have = {member.path: key(member) for member in found}
    problems = [f"{path} missing" for path in sorted(want.keys() - have.keys())]
    problems += [f"{path} not in the archive" for path in sorted(have.keys() - want.keys())]
    problems += [f"{path} differs" for path in sorted(want.keys() & have.keys()) if want[path] != have[path]]
    return problems


__all__ = ["BLOCK_BYTES", "MAX_READ_BYTES", "TreeWriter", "list_tree", "same_tree", "sha256_of"]
