"""``readie checkpoints import``: a checkpoint archive into a cache, verified before it is usable.

In order (decision 18):

1. the digest manifest (the first member) is read and checked as a whole;
2. its host facts are held to this host (runsc version, platform, executor),
   so a set this host cannot restore fails before 400 MB are written;
3. every other member is streamed into a staging directory inside the cache,
   each held to its entry (listed, once, its type, size and sha256), by
   descriptor, never through a symlink (archive_tree);
4. the set's manifest must agree with the digest's facts and with itself;
   its ``rootfs`` is rewritten to where the rootfs lands in this cache;
5. the rootfs is installed as ``<cache>/rootfs/<fp16>`` (stamped like a
   built layer), or an identical one already there is reused;
6. the set is checked as a worker would load it (``checkpoint_verify``),
   renamed to ``<cache>/sets/<digest16>``, and ``<cache>/checkpoints`` is
   pointed at it (``locations.link_default``).

Any failure removes the staging directory, and a rootfs installed by this
import; the default link moves only at the very end.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import structlog

from readie_worker.bundle import MountPlan, family_fingerprint
from readie_policy.locations import CACHE_VARIABLE, check_owned, link_default
from readie_worker.manifest import MANIFEST_NAME, MAX_MANIFEST_BYTES
from readie_policy.operator_files import FileRefused, open_regular

from .archive_format import (
    DIGEST_NAME,
    DIR,
    FILE,
    KEPT_MODE_BITS,
    MAX_DIGEST_BYTES,
    MAX_LONG_HEADER_BYTES,
    MAX_MEMBERS,
    MAX_READ_BYTES,
    MAX_TOTAL_BYTES,
    ROOTFS_PREFIX,
    SET_PREFIX,
    SYMLINK,
    ArchiveError,
    ArchiveFormatError,
    ArchiveTooLarge,
    Digest,
    DigestMismatch,
    HostMismatch,
    ArchiveMember,
    MissingMember,
    UnlistedMember,
    UnsafeMember,
    check_name,
    parse_digest,
)
from .archive_tree import BLOCK_BYTES, TreeWriter, list_tree, same_tree
from .checkpoint_verify import host_problems, verify_manifest
from .rootfs import IMPORTED_LAYER_PREFIX, STAMP, stamp_matches

log = structlog.get_logger("readie.checkpoints")

# The archive itself: its data, the digest manifest, and headers (a pax
# header and a ustar header, 3 blocks at most for our names) per member.
MAX_ARCHIVE_BYTES = MAX_TOTAL_BYTES + MAX_DIGEST_BYTES + MAX_MEMBERS * 8 * 512
SETS_DIR = "sets"
_FINGERPRINT = re.compile(r"sha256:[0-9a-f]{64}")
_TYPES = {tarfile.REGTYPE: FILE, tarfile.AREGTYPE: FILE, tarfile.DIRTYPE: DIR, tarfile.SYMTYPE: SYMLINK}
_REFUSED_TYPES = {
    tarfile.LNKTYPE: "a hard link",
    tarfile.CHRTYPE: "a character device node",
    tarfile.BLKTYPE: "a block device node",
    tarfile.FIFOTYPE: "a fifo",
    tarfile.CONTTYPE: "a contiguous file",
}


@dataclass(frozen=True)
class Imported:
    set_dir: Path
    rootfs: Path
    rootfs_reused: bool
    linked: Path | None  # <cache>/checkpoints, when it moved
    captured_rootfs: str  # the rootfs path the set was captured with (rewritten when it differs)


def import_checkpoints(
    archive: Path,
    cache: Path,
    *,
    runsc_binary: str = "runsc",
    check_host: bool = True,
    link: bool = True,
) -> Imported:
    """Verify and install ``archive`` into ``cache``; raises an :class:`ArchiveError` and installs nothing on failure."""
    cache.mkdir(mode=0o755, parents=True, exist_ok=True)
    check_owned(cache.resolve(), "the import cache")
    cache = cache.resolve()
    default = cache / "checkpoints"
    if link and default.is_dir() and not default.is_symlink():
        # link_default would refuse at the very end, after all the work: say so first.
        raise ArchiveError(f"{default} is a directory of its own; readie points it at imported sets, so move it away first")
    try:
        fd = open_regular(archive)  # a FIFO named here would block open() for ever
    except FileRefused as exc:
        raise ArchiveFormatError(f"{archive}: {exc}") from None
    with os.fdopen(fd, "rb") as raw:
        size = os.fstat(raw.fileno()).st_size
        if size > MAX_ARCHIVE_BYTES:
            raise ArchiveTooLarge(f"{archive} is {size} bytes, over the limit of {MAX_ARCHIVE_BYTES}")
        staging = Path(tempfile.mkdtemp(dir=cache, prefix=".import-"))
        installed_layer: Path | None = None
        try:
            with _open_tar(_Bounded(raw)) as tar:
                digest, digest_bytes = _read_digest(tar)
                if check_host:
                    problems = host_problems(digest.host, runsc_binary)
                    if problems:
                        raise HostMismatch(f"{archive}: this host cannot restore the set: " + "; ".join(problems))
                layer = _layer_dir(cache, digest)
                reuse = _reusable(layer, digest)
                try:
                    _extract(tar, digest, staging, skip_rootfs=reuse)
                except (tarfile.TarError, EOFError) as exc:  # a member's data cut short, mostly
                    raise ArchiveFormatError(f"the tar is damaged: {exc}") from None
            rootfs = layer / ROOTFS_PREFIX
            set_dir = cache / SETS_DIR / hashlib.sha256(digest_bytes).hexdigest()[:16]
            _rewrite_manifest(staging / SET_PREFIX / MANIFEST_NAME, digest, rootfs)
            if not reuse:
                _install_layer(staging, layer, digest)
                installed_layer = layer
            if check_host:
                problems = verify_manifest(staging / SET_PREFIX / MANIFEST_NAME, runsc_binary).problems()
                if problems:
                    raise HostMismatch(f"{archive}: the imported set would not restore here: " + "; ".join(problems))
            _install_set(staging / SET_PREFIX, set_dir)
            installed_layer = None  # from here on, the set points at it
        except BaseException:
            if installed_layer is not None:
                shutil.rmtree(installed_layer, ignore_errors=True)
            raise
        finally:
            shutil.rmtree(staging, ignore_errors=True)
    linked = link_default(set_dir, {CACHE_VARIABLE: str(cache)}) if link else None
    log.info("checkpoints imported", set=str(set_dir), rootfs=str(rootfs), rootfs_reused=reuse, linked=str(linked))
    return Imported(set_dir, rootfs, reuse, linked, digest.host.rootfs)


class _Bounded:
    """The archive file as tarfile sees it, refusing any single read over MAX_READ_BYTES:
    tarfile allocates a long-name or pax header's claimed size before it reads it."""

    def __init__(self, file: Any) -> None:
        self._file = file

    def read(self, size: int = -1) -> bytes:
        if size < 0 or size > MAX_READ_BYTES:
            raise ArchiveTooLarge(f"the archive asks for a read of {size} bytes (a header over {MAX_READ_BYTES} bytes)")
        return self._file.read(size)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._file.seek(offset, whence)

    def tell(self) -> int:
        return self._file.tell()


class _StrictTarInfo(tarfile.TarInfo):
    """tarfile's header parsing, less what a hostile archive can make costly: pax headers
    (a quadratic regex over their records, CVE-2024-6232, and records copied into every
    later member), GNU sparse maps, and long-name headers longer than a name can be."""

    def _proc_pax(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        raise ArchiveFormatError(f"the tar has pax headers (near {self.name!r}); readie writes GNU tar")

    def _proc_sparse(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        raise ArchiveFormatError(f"member {self.name!r} is a sparse file")

    def _proc_gnulong(self, tarfile: tarfile.TarFile) -> tarfile.TarInfo:  # type: ignore[override]
        if self.size > MAX_LONG_HEADER_BYTES:
            raise ArchiveTooLarge(f"a long-name header of {self.size} bytes, over the limit of {MAX_LONG_HEADER_BYTES}")
        return super()._proc_gnulong(tarfile)  # type: ignore[misc]


# What tarfile raises for headers it cannot make sense of, beyond its own TarError.
_DAMAGED = (tarfile.TarError, EOFError, UnicodeError, ValueError, IndexError, OverflowError)


def _open_tar(reader: _Bounded) -> tarfile.TarFile:
    try:
        # mode "r" of the class itself: a plain tar only, no compression guessed.
        return tarfile.TarFile(fileobj=reader, mode="r", tarinfo=_StrictTarInfo)  # type: ignore[arg-type]
    except _DAMAGED as exc:
        raise ArchiveFormatError(f"not a plain tar archive: {exc}") from None


def _next(tar: tarfile.TarFile) -> tarfile.TarInfo | None:
    try:
        info = tar.next()
    except _DAMAGED as exc:
        raise ArchiveFormatError(f"the tar is damaged: {exc}") from None
    tar.members.clear()  # read once, in order: tarfile would keep every header for the archive's life
    return info


def _read_digest(tar: tarfile.TarFile) -> tuple[Digest, bytes]:
    first = _next(tar)
    if first is None or first.name != DIGEST_NAME or first.type not in (tarfile.REGTYPE, tarfile.AREGTYPE):
        found = "nothing" if first is None else repr(first.name)
        raise ArchiveFormatError(f"not a readie checkpoint archive: its first member is {found}, not {DIGEST_NAME}")
    if first.size > MAX_DIGEST_BYTES:
        raise ArchiveTooLarge(f"{DIGEST_NAME} is {first.size} bytes, over the limit of {MAX_DIGEST_BYTES}")
    data = _read_all(tar, first)
    return parse_digest(data), data


def _read_all(tar: tarfile.TarFile, info: tarfile.TarInfo) -> bytes:
    source = tar.extractfile(info)
    assert source is not None
    chunks, left = [], info.size
    while left > 0:
        block = source.read(min(BLOCK_BYTES, left))
        if not block:
            raise DigestMismatch(f"member {info.name!r} is cut short")
        chunks.append(block)
        left -= len(block)
    return b"".join(chunks)


def _layer_dir(cache: Path, digest: Digest) -> Path:
    """Where the archive's rootfs goes: named by its content, not by the fingerprint it claims.

    Under the fingerprint's name (as ``readie_pipeline.rootfs`` names the layers it
    builds) a capture on this host would take an imported tree for its own build, and
    a first archive claiming a fingerprint would squat it for every later one.
    """
    fingerprint = digest.host.rootfs_fingerprint
    if not _FINGERPRINT.fullmatch(fingerprint):
        raise ArchiveFormatError(f"the rootfs fingerprint {fingerprint[:80]!r} is not sha256:<64 hex>")
    content = hashlib.sha256()
    for member in _rootfs_members(digest):
        content.update(json.dumps([member.path, member.type, member.mode, member.size, member.sha256, member.target]).encode())
    return cache / "rootfs" / f"{IMPORTED_LAYER_PREFIX}{content.hexdigest()[:16]}"


def _rootfs_members(digest: Digest) -> list[ArchiveMember]:
    return [member for member in digest.members if member.parts[0] == ROOTFS_PREFIX]


def _reusable(layer: Path, digest: Digest) -> bool:
    """An installed rootfs of the same fingerprint is reused only if it is the archive's tree, byte for byte."""
    if not os.path.lexists(layer):
        return False
    if not stamp_matches(layer / STAMP, digest.host.rootfs_fingerprint):
        raise ArchiveError(f"{layer} exists but is not a finished rootfs of this fingerprint; remove it, then import again")
    check_owned(layer, "an installed rootfs")
    found, _ = list_tree(layer / ROOTFS_PREFIX, ROOTFS_PREFIX)
    differences = same_tree(_rootfs_members(digest), found) + _changed_since_installed(layer / ROOTFS_PREFIX)
    if differences:
        raise ArchiveError(
            f"the rootfs installed at {layer} was changed since it was imported ({len(differences)} differences, "
            f"first: {'; '.join(differences[:3])}); these checkpoints need the archive's own: remove it, or "
            "import with --into another cache"
        )
    log.info("reusing the installed rootfs", layer=str(layer))
    return True


def _changed_since_installed(root: Path) -> list[str]:
    """What a listing does not show but an install never makes: mode bits beyond the kept ones
    (setuid, group or world write), another owner, a file hard-linked elsewhere."""
    allowed, problems = {0, os.geteuid()}, []
    for directory, dirs, files in os.walk(root):  # does not follow symlinks to directories
        for name in (*dirs, *files):
            info = os.lstat(os.path.join(directory, name))
            where = os.path.relpath(os.path.join(directory, name), root)
            if info.st_uid not in allowed:
                problems.append(f"{where} belongs to uid {info.st_uid}")
            if not stat.S_ISLNK(info.st_mode) and stat.S_IMODE(info.st_mode) & ~KEPT_MODE_BITS:
                problems.append(f"{where} has mode {stat.filemode(info.st_mode)}")
            if stat.S_ISREG(info.st_mode) and info.st_nlink > 1:
                problems.append(f"{where} has {info.st_nlink} links")
            if len(problems) >= 3:
                return problems
    return problems


def _extract(tar: tarfile.TarFile, digest: Digest, staging: Path, *, skip_rootfs: bool) -> None:
    seen: set[str] = set()
    with TreeWriter(staging) as writer:
        while (info := _next(tar)) is not None:
            member = _listed(info, digest, seen)
            source = tar.extractfile(info) if member.type == FILE else None
            if skip_rootfs and member.parts[0] == ROOTFS_PREFIX:
                if source is not None:
                    _hash_only(member, source.read)  # still verified: the archive is whole or refused
            elif member.type == DIR:
                writer.mkdir(member)
            elif member.type == SYMLINK:
                writer.symlink(member)
            else:
                assert source is not None
                writer.write_file(member, source.read)
        missing = [member.path for member in digest.members if member.path not in seen]
        if missing:
            raise MissingMember(f"the archive lacks {len(missing)} listed member(s), first {missing[:3]}")
        writer.finish()


def _listed(info: tarfile.TarInfo, digest: Digest, seen: set[str]) -> ArchiveMember:
    """The digest entry for tar member ``info``, refused unless the two agree."""
    check_name(info.name)
    if info.type in _REFUSED_TYPES:
        raise UnsafeMember(f"member {info.name!r} is {_REFUSED_TYPES[info.type]}; an archive carries none")
    kind = _TYPES.get(info.type)
    if kind is None or info.sparse is not None:
        raise UnsafeMember(f"member {info.name!r} has tar type {info.type!r}; only files, directories and symlinks are carried")
    member = digest.by_path.get(info.name)
    if member is None:
        raise UnlistedMember(f"member {info.name!r} is not in the digest manifest")
    if info.name in seen:
        raise UnlistedMember(f"member {info.name!r} appears twice in the archive")
    seen.add(info.name)
    if member.type != kind:
        raise DigestMismatch(f"member {info.name!r} is a {kind} in the tar, a {member.type} in the digest manifest")
    if kind == FILE and info.size != member.size:
        raise DigestMismatch(f"member {info.name!r} is {info.size} bytes in the tar, {member.size} in the digest manifest")
    if kind == SYMLINK and info.linkname != member.target:
        raise DigestMismatch(f"symlink {info.name!r} points at {info.linkname!r} in the tar, {member.target!r} in the digest manifest")
    return member


def _hash_only(member: ArchiveMember, read: Callable[[int], bytes]) -> None:
    digest, left = hashlib.sha256(), member.size
    while left > 0:
        block = read(min(BLOCK_BYTES, left))
        if not block:
            raise DigestMismatch(f"member {member.path!r} is cut short")
        digest.update(block)
        left -= len(block)
    if "sha256:" + digest.hexdigest() != member.sha256:
        raise DigestMismatch(f"member {member.path!r} is corrupt: its sha256 is not the digest manifest's {member.sha256}")


def _rewrite_manifest(path: Path, digest: Digest, rootfs: Path) -> None:
    """Hold the set's manifest to the digest's facts and to itself, then name this cache's rootfs.

    Restore works with the rootfs at another path (decision 18, measured);
    the spec fingerprint is recomputed for the new path, after checking the
    set's own was what its captured path gave.
    """
    data = path.read_bytes()
    if len(data) > MAX_MANIFEST_BYTES:
        raise ArchiveTooLarge(f"the set's {MANIFEST_NAME} is {len(data)} bytes, over {MAX_MANIFEST_BYTES}")
    try:
        raw = json.loads(data)
        facts = digest.host
        stated = (raw["executor_protocol"], raw.get("executor_digest"), raw["runsc_version"], tuple(raw["runsc_flags"]),
                  raw["rootfs"], raw["rootfs_fingerprint"], raw["spec_fingerprint"])
        plan = MountPlan.from_json(raw["mount_plan"])
        images = [str(entry["image_path"]) for entry in raw["checkpoints"]]
    except (ValueError, KeyError, TypeError, RecursionError) as exc:
        raise ArchiveFormatError(f"the set's {MANIFEST_NAME} is malformed: {type(exc).__name__}: {exc}") from None
    listed = (facts.executor_protocol, facts.executor_digest, facts.runsc_version, facts.runsc_flags,
              facts.rootfs, facts.rootfs_fingerprint, facts.spec_fingerprint)
    if stated != listed:
        raise DigestMismatch(f"the set's {MANIFEST_NAME} does not say what the digest manifest's host facts say")
    for image in images:
        # read_manifest resolves these against the set's directory: an absolute one would point anywhere.
        if image.startswith("/") or ".." in image.split("/"):
            raise UnsafeMember(f"the set's {MANIFEST_NAME} names an image outside the set: {image!r}")
    if family_fingerprint(Path(facts.rootfs), plan, facts.runsc_flags) != facts.spec_fingerprint:
        raise ArchiveError("the archived set is not self-consistent: its spec fingerprint is not what its rootfs, plan and flags give")
    raw["rootfs"] = str(rootfs)
    raw["spec_fingerprint"] = family_fingerprint(rootfs, plan, facts.runsc_flags)
    rewritten = path.with_name(f".{path.name}.new")
    rewritten.write_text(json.dumps(raw, indent=2) + "\n")
    os.chmod(rewritten, 0o644)
    os.replace(rewritten, path)


def _install_layer(staging: Path, layer: Path, digest: Digest) -> None:
    staged = staging / "layer"
    staged.mkdir(mode=0o755)
    (staging / ROOTFS_PREFIX).rename(staged / ROOTFS_PREFIX)
    stamp = {"fingerprint": digest.host.rootfs_fingerprint, "built_at": time.time(), "imported": True}
    (staged / STAMP).write_text(json.dumps(stamp))
    os.chmod(staged / STAMP, 0o644)
    layer.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    os.sync()  # the data is on disk before the rename makes the layer count as finished
    try:
        staged.rename(layer)
    except OSError as exc:
        raise ArchiveError(f"cannot install the rootfs at {layer}: {exc.strerror} (another import at once?)") from None


def _install_set(staged: Path, set_dir: Path) -> None:
    set_dir.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
    if os.path.lexists(set_dir):
        # The same archive imported again: the name is its digest; swap the fresh copy in.
        aside = staged.with_name("previous")
        set_dir.rename(aside)
        staged.rename(set_dir)
        return
    staged.rename(set_dir)


__all__ = ["MAX_ARCHIVE_BYTES", "SETS_DIR", "Imported", "import_checkpoints"]
