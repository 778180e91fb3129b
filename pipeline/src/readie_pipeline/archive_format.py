"""The checkpoint archive: one plain tar whose first member lists every other (decision 18).

Layout, in this order::

    readie-checkpoints.json   the digest manifest (this module): format
                              version, the set's host facts, and every
                              other member's path, type, size and sha256
    set/manifest.json         the checkpoint manifest (image paths relative)
    set/<image>/...           the image directories
    rootfs/...                the sandbox rootfs the set was captured from

The digest manifest is read first and checked as a whole before anything is
written; every member after it is then held to its entry. An archive is
hostile input: :func:`parse_digest` takes bytes and gives back a validated
:class:`Digest` or raises one of the typed errors below, and does no I/O.
"""

from __future__ import annotations

import json
import re
import stat
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from readie_worker.errors import SandboxSetupError
from readie_worker.manifest import platform_of

DIGEST_NAME = "readie-checkpoints.json"
FORMAT = "readie-checkpoints"
# Bump on any change a reader of the old format would misread; a mismatch is refused naming both.
FORMAT_VERSION = 1
SET_PREFIX = "set"
ROOTFS_PREFIX = "rootfs"
TOP_LEVEL = (SET_PREFIX, ROOTFS_PREFIX)
FILE, DIR, SYMLINK = "file", "dir", "symlink"

# Limits. The current set (three images and a pandas rootfs) is ~0.42 GB in
# ~15,000 members with names of at most ~160 bytes; each bound leaves a wide
# margin above that and still stops an archive from filling a disk, a
# listing from filling memory, or a name from reaching the kernel's limits.
#: Bytes of all member data together: a rootfs with torch is ~5 GB.
MAX_TOTAL_BYTES = 16 * 1024**3
#: Members listed: a rootfs with many packages has ~60,000 entries.
MAX_MEMBERS = 200_000
#: The digest manifest itself: ~200 bytes a member at MAX_MEMBERS.
MAX_DIGEST_BYTES = 64 * 1024 * 1024
#: A member's path in bytes; PATH_MAX is 4096, and the install root's own path comes on top.
MAX_NAME_BYTES = 1024
#: One path component, the kernel's NAME_MAX.
MAX_COMPONENT_BYTES = 255
#: A symlink's target, as long as a name.
MAX_LINK_BYTES = 1024
#: The largest single read the tar reader may ask for: its 512-byte blocks, a
#: long-name or pax header, our 1 MiB copy blocks. A header claiming more is
#: an attack on memory (tarfile would allocate it), refused before the read.
MAX_READ_BYTES = 8 * 1024 * 1024
# A GNU long-name or long-link header's data: a name or a link target, each at most
# MAX_NAME_BYTES / MAX_LINK_BYTES, and a NUL. Checked before tarfile reads it.
MAX_LONG_HEADER_BYTES = max(MAX_NAME_BYTES, MAX_LINK_BYTES) + 1
#: Permission bits kept on install: no setuid/setgid/sticky (a setuid-root
#: file in a cache would be a way onto the host), no group/other write
#: (locations.check_owned refuses those). The sandbox runs as root anyway.
KEPT_MODE_BITS = 0o755
#: Any other string of the listing (flags, versions, paths of the build host): PATH_MAX.
MAX_TEXT_CHARS = 4096
_SHA256 = re.compile(r"sha256:[0-9a-f]{64}")
_MAX_MTIME_NS = 2**63 - 1


class ArchiveError(SandboxSetupError):
    """A checkpoint archive cannot be exported, imported or trusted."""


class ArchiveFormatError(ArchiveError):
    """Not a readie checkpoint archive of a version we read, or its digest manifest is malformed."""


class UnsafeMember(ArchiveError):
    """A member whose name or type could write outside the install root or make a special file."""


class UnlistedMember(ArchiveError):
    """A member the digest manifest does not list, or one that appears twice."""


class MissingMember(ArchiveError):
    """A member the digest manifest lists but the archive does not hold."""


class ArchiveTooLarge(ArchiveError):
    """Over one of the named limits above."""


class DigestMismatch(ArchiveError):
    """A member whose size, type or sha256 differs from its entry: a tampered or damaged archive."""


class HostMismatch(ArchiveError):
    """The set cannot be restored on this host (runsc, platform, executor); names both sides."""


@dataclass(frozen=True)
class ArchiveMember:
    """One entry of the digest manifest; ``size`` and ``sha256`` for files, ``target`` for symlinks."""

    path: str
    type: str
    mode: int = 0o755
    mtime_ns: int = 0
    size: int = 0
    sha256: str | None = None
    target: str | None = None

    @property
    def parts(self) -> tuple[str, ...]:
        return tuple(self.path.split("/"))

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"path": self.path, "type": self.type, "mode": self.mode, "mtime_ns": self.mtime_ns}
        if self.type == FILE:
            out.update(size=self.size, sha256=self.sha256)
        if self.type == SYMLINK:
            out["target"] = self.target
        return out


@dataclass(frozen=True)
class HostFacts:
    """What a host must offer to restore the set, copied from its manifest at export."""

    executor_protocol: int
    executor_digest: str | None
    runsc_version: str
    runsc_flags: tuple[str, ...]
    rootfs: str  # the absolute path the set was captured with
    rootfs_fingerprint: str
    spec_fingerprint: str

    @property
    def platform(self) -> str | None:
        return platform_of(self.runsc_flags)


@dataclass(frozen=True)
class Digest:
    format_version: int
    created_at: str
    host: HostFacts
    members: tuple[ArchiveMember, ...]
    skipped: tuple[str, ...] = ()  # rootfs entries not carried (device nodes: /dev is a tmpfs in every sandbox)
    by_path: Mapping[str, ArchiveMember] = field(default_factory=dict, compare=False)

    @property
    def total_bytes(self) -> int:
        return sum(member.size for member in self.members)

    def to_bytes(self) -> bytes:
        raw = {
            "format": FORMAT,
            "format_version": self.format_version,
            "created_at": self.created_at,
            "host": {**self.host.__dict__, "runsc_flags": list(self.host.runsc_flags)},
            "skipped": list(self.skipped),
            "members": [member.to_json() for member in self.members],
        }
        return (json.dumps(raw, indent=0, sort_keys=False) + "\n").encode()


def parse_digest(data: bytes) -> Digest:
    """The digest manifest of an archive, every entry checked; raises the typed errors above."""
    if len(data) > MAX_DIGEST_BYTES:
        raise ArchiveTooLarge(f"{DIGEST_NAME} is {len(data)} bytes, over the limit of {MAX_DIGEST_BYTES}")
    try:
        raw = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise ArchiveFormatError(f"{DIGEST_NAME} is not JSON: {exc}") from None
    if not isinstance(raw, dict) or raw.get("format") != FORMAT:
        raise ArchiveFormatError(f"not a readie checkpoint archive: {DIGEST_NAME} does not say format {FORMAT!r}")
    if raw.get("format_version") != FORMAT_VERSION:
        raise ArchiveFormatError(
            f"the archive is format version {raw.get('format_version')!r}; this readie reads version {FORMAT_VERSION}"
        )
    try:
        host = _host(raw["host"])
        entries = raw["members"]
        skipped = tuple(_text(name, "skipped") for name in raw.get("skipped", []))
        created_at = _text(raw.get("created_at", ""), "created_at")
        if not isinstance(entries, list):
            raise TypeError("members is not a list")
        if len(entries) > MAX_MEMBERS:
            raise ArchiveTooLarge(f"the archive lists {len(entries)} members, over the limit of {MAX_MEMBERS}")
        members = tuple(_member(entry) for entry in entries)
    except (KeyError, TypeError, ValueError) as exc:
        raise ArchiveFormatError(f"{DIGEST_NAME} is malformed: {type(exc).__name__}: {exc}") from None
    return _checked(Digest(FORMAT_VERSION, created_at, host, members, skipped))


def check_name(path: str) -> tuple[str, ...]:
    """The components of a member name, refused unless it is relative, normal and within limits."""
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        raise UnsafeMember(f"member name {path!r} is not valid UTF-8") from None
    if len(encoded) > MAX_NAME_BYTES:
        raise ArchiveTooLarge(f"member name {path[:80]!r}... is {len(encoded)} bytes, over the limit of {MAX_NAME_BYTES}")
    if path.startswith("/"):
        raise UnsafeMember(f"member {path!r} has an absolute name")
    if any(ord(char) < 0x20 or ord(char) == 0x7F for char in path):
        # NUL, newlines, escapes: a name that rewrites an operator's terminal or log line.
        raise UnsafeMember(f"member {path!r} has a control character in its name")
    parts = tuple(path.split("/"))
    if any(part in ("", ".", "..") for part in parts):
        raise UnsafeMember(f"member {path!r} is not a normal relative name (empty, '.' or '..' components)")
    if any(len(part.encode()) > MAX_COMPONENT_BYTES for part in parts):
        raise ArchiveTooLarge(f"member {path[:80]!r} has a component over {MAX_COMPONENT_BYTES} bytes")
    if parts[0] not in TOP_LEVEL:
        raise UnsafeMember(f"member {path!r} is outside {' and '.join(TOP_LEVEL)}/")
    return parts


def _checked(digest: Digest) -> Digest:
    """Whole-listing rules: no duplicates, each member's parent a listed directory, the totals in bounds."""
    by_path: dict[str, ArchiveMember] = {}
    for member in digest.members:
        if member.path in by_path:
            raise UnlistedMember(f"the digest manifest lists {member.path!r} twice")
        parts = member.parts
        if len(parts) > 1:
            parent = by_path.get("/".join(parts[:-1]))
            # Parents come first and are directories: so a symlink is never a parent, and
            # a member "a -> /etc" cannot be followed by "a/passwd".
            if parent is None or parent.type != DIR:
                raise UnsafeMember(f"member {member.path!r}: its parent is not a directory listed before it")
        elif member.type != DIR:
            raise UnsafeMember(f"top-level member {member.path!r} must be a directory")
        if member.type == SYMLINK and parts[0] != ROOTFS_PREFIX:
            raise UnsafeMember(f"member {member.path!r}: symlinks belong only in the rootfs")
        by_path[member.path] = member
    for top in TOP_LEVEL:
        if top not in by_path:
            raise MissingMember(f"the digest manifest lists no {top}/ directory")
    manifest = by_path.get(f"{SET_PREFIX}/manifest.json")
    if manifest is None or manifest.type != FILE:
        raise MissingMember(f"the digest manifest lists no {SET_PREFIX}/manifest.json file")
    if digest.total_bytes > MAX_TOTAL_BYTES:
        raise ArchiveTooLarge(f"the archive holds {digest.total_bytes} bytes, over the limit of {MAX_TOTAL_BYTES}")
    return Digest(digest.format_version, digest.created_at, digest.host, digest.members, digest.skipped, by_path)


def _member(raw: object) -> ArchiveMember:
    if not isinstance(raw, dict):
        raise TypeError("a member is not an object")
    path = _text(raw["path"], "path")
    check_name(path)
    kind = raw["type"]
    if kind not in (FILE, DIR, SYMLINK):
        raise UnsafeMember(f"member {path!r} has type {kind!r}; only files, directories and symlinks are carried")
    mode, mtime_ns = _int(raw.get("mode", 0o755), 0, 0o7777), _int(raw.get("mtime_ns", 0), 0, _MAX_MTIME_NS)
    if kind == FILE:
        sha256 = _text(raw["sha256"], "sha256")
        if not _SHA256.fullmatch(sha256):
            raise ValueError(f"member {path!r}: sha256 {sha256[:80]!r} is not sha256:<64 hex>")
        size = _int(raw["size"], 0, 2**63)
        if size > MAX_TOTAL_BYTES:
            raise ArchiveTooLarge(f"member {path!r} is {size} bytes, over the limit of {MAX_TOTAL_BYTES}")
        return ArchiveMember(path, FILE, mode & KEPT_MODE_BITS, mtime_ns, size, sha256)
    if kind == SYMLINK:
        target = _text(raw["target"], "target")
        if not target or "\0" in target or len(target.encode()) > MAX_LINK_BYTES:
            raise UnsafeMember(f"member {path!r}: symlink target is empty, has a NUL or is over {MAX_LINK_BYTES} bytes")
        return ArchiveMember(path, SYMLINK, 0o777, mtime_ns, target=target)
    return ArchiveMember(path, DIR, mode & KEPT_MODE_BITS, mtime_ns)


def _host(raw: object) -> HostFacts:
    if not isinstance(raw, dict):
        raise TypeError("host is not an object")
    digest = raw.get("executor_digest")
    flags = raw["runsc_flags"]
    if not isinstance(flags, list):
        raise TypeError("host.runsc_flags is not a list")
    return HostFacts(
        executor_protocol=_int(raw["executor_protocol"], 0, 2**31),
        executor_digest=None if digest is None else _text(digest, "executor_digest"),
        runsc_version=_text(raw["runsc_version"], "runsc_version"),
        runsc_flags=tuple(_text(flag, "runsc_flags") for flag in flags),
        rootfs=_text(raw["rootfs"], "rootfs"),
        rootfs_fingerprint=_text(raw["rootfs_fingerprint"], "rootfs_fingerprint"),
        spec_fingerprint=_text(raw["spec_fingerprint"], "spec_fingerprint"),
    )


def _text(value: object, what: str) -> str:
    # Every string of the listing ends up in a message or a path: bounded (names then more tightly, by check_name).
    if not isinstance(value, str) or len(value) > MAX_TEXT_CHARS:
        raise ValueError(f"{what} is not a string of at most {MAX_TEXT_CHARS} characters")
    return value


def _int(value: object, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise ValueError(f"{value!r} is not an integer in [{low}, {high}]")
    return value


def kind_of(mode: int) -> str | None:
    """The member type of an lstat mode; None for what an archive never carries."""
    if stat.S_ISREG(mode):
        return FILE
    if stat.S_ISDIR(mode):
        return DIR
    if stat.S_ISLNK(mode):
        return SYMLINK
    return None
