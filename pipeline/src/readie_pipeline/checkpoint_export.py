"""``readie checkpoints export``: a checkpoint set and its rootfs as one plain tar (archive_format).

The set must be whole and self-consistent before it is packed: its manifest
reads (executor protocol and digest are this checkout's), its spec
fingerprint is what its own rootfs path, mount plan and flags give, every
image matches its recorded sha256, and the rootfs beside it is stamped with
the fingerprint the manifest names. Every file is hashed before the tar is
written (the digest manifest goes first) and hashed again as it is copied
in, so a file that changes meanwhile fails the export instead of shipping
an archive that no import would accept.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import tarfile
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import IO

import structlog

from readie_worker.bundle import family_fingerprint
from readie_worker.errors import CheckpointUnusable
from readie_worker.manifest import MANIFEST_NAME, Manifest, read_manifest, verify_image

from .archive_format import (
    DIGEST_NAME,
    DIR,
    FILE,
    FORMAT_VERSION,
    ROOTFS_PREFIX,
    SET_PREFIX,
    SYMLINK,
    ArchiveError,
    Digest,
    DigestMismatch,
    HostFacts,
    ArchiveMember,
    check_name,
)
from .archive_tree import BLOCK_BYTES, list_tree
from .rootfs import STAMP, stamp_matches

log = structlog.get_logger("readie.checkpoints")


@dataclass(frozen=True)
class Exported:
    path: Path
    members: int
    bytes: int
    skipped: tuple[str, ...]


def set_facts(manifest: Manifest) -> HostFacts:
    return HostFacts(
        executor_protocol=manifest.executor_protocol,
        executor_digest=manifest.executor_digest,
        runsc_version=manifest.runsc_version,
        runsc_flags=manifest.runsc_flags,
        rootfs=str(manifest.rootfs),
        rootfs_fingerprint=manifest.rootfs_fingerprint,
        spec_fingerprint=manifest.spec_fingerprint,
    )


def check_consistent(manifest: Manifest, where: str) -> None:
    """Refuse a manifest whose spec fingerprint is not what its own rootfs, plan and flags give."""
    expected = family_fingerprint(manifest.rootfs, manifest.mount_plan, manifest.runsc_flags)
    if expected != manifest.spec_fingerprint:
        raise ArchiveError(
            f"{where}: the set is not self-consistent: its spec fingerprint is {manifest.spec_fingerprint}, but its "
            f"rootfs, mount plan and flags give {expected}; recapture it (make capture)"
        )


def export_checkpoints(manifest_path: Path, output: Path) -> Exported:
    """Pack the set at ``manifest_path`` (a located, owner-checked manifest) into ``output``."""
    manifest = read_manifest(manifest_path)
    check_consistent(manifest, str(manifest_path))
    for checkpoint in manifest.checkpoints.values():
        try:
            verify_image(checkpoint)
        except CheckpointUnusable as exc:
            raise ArchiveError(f"not exporting a damaged set: {exc}") from None
    if not stamp_matches(manifest.rootfs.parent / STAMP, manifest.rootfs_fingerprint):
        raise ArchiveError(
            f"the rootfs {manifest.rootfs} is missing or is not the one the set was captured from "
            f"(no {STAMP} beside it naming {manifest.rootfs_fingerprint[:23]}...): recapture (make capture)"
        )
    base = manifest_path.parent
    manifest_bytes = (json.dumps(manifest.to_json(base), indent=2) + "\n").encode()
    sources: dict[str, Path | bytes] = {f"{SET_PREFIX}/{MANIFEST_NAME}": manifest_bytes}
    members = [ArchiveMember(SET_PREFIX, DIR, 0o755, _now_ns()), _bytes_member(f"{SET_PREFIX}/{MANIFEST_NAME}", manifest_bytes)]
    for checkpoint in manifest.checkpoints.values():
        relative = Path(os.path.relpath(checkpoint.image_path, base))
        if relative.is_absolute() or ".." in relative.parts:
            raise ArchiveError(f"checkpoint {checkpoint.name!r}: its image {checkpoint.image_path} is outside {base}")
        for depth in range(1, len(relative.parts) + 1):
            name = "/".join((SET_PREFIX, *relative.parts[:depth]))
            if not any(member.path == name for member in members):
                check_name(name)
                members.append(ArchiveMember(name, DIR, 0o755, os.lstat(base.joinpath(*relative.parts[:depth])).st_mtime_ns))
        for file in checkpoint.files:
            name = f"{SET_PREFIX}/{relative.as_posix()}/{file.name}"
            path = checkpoint.image_path / file.name
            check_name(name)
            # The manifest's own hash, verified just above: no second full read of the images.
            members.append(ArchiveMember(name, FILE, 0o644, os.lstat(path).st_mtime_ns, file.size_bytes, file.sha256))
            sources[name] = path
    rootfs_members, skipped = list_tree(manifest.rootfs, ROOTFS_PREFIX)
    for member in rootfs_members:
        if member.type == FILE:
            sources[member.path] = manifest.rootfs.joinpath(*member.parts[1:])
    members += rootfs_members
    created = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    digest = Digest(FORMAT_VERSION, created, set_facts(manifest), tuple(members), tuple(skipped))
    _write_atomically(output, digest, sources)
    if skipped:
        log.info("special files not carried", count=len(skipped), first=skipped[:3])
    return Exported(output, len(members), digest.total_bytes, tuple(skipped))


def _write_atomically(output: Path, digest: Digest, sources: dict[str, Path | bytes]) -> None:
    output.parent.mkdir(parents=True, exist_ok=True)
    fd, temporary = tempfile.mkstemp(dir=output.parent, prefix=f".{output.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as raw:
            # GNU, not pax: long names as GNU long-name headers. The importer refuses pax
            # headers, whose parsing in tarfile is quadratic (CVE-2024-6232) and whose
            # records tarfile copies into every later member; the exact mtimes and modes
            # are in the digest manifest, not in the tar headers.
            with tarfile.open(fileobj=raw, mode="w", format=tarfile.GNU_FORMAT) as tar:
                data = digest.to_bytes()
                tar.addfile(_info(_bytes_member(DIGEST_NAME, data)), _Hashing(_BytesReader(data), None, DIGEST_NAME))
                for member in digest.members:
                    source = sources.get(member.path)
                    if member.type != FILE:
                        tar.addfile(_info(member))
                    elif isinstance(source, bytes):
                        tar.addfile(_info(member), _Hashing(_BytesReader(source), member.sha256, member.path))
                    else:
                        assert source is not None
                        handle = os.fdopen(os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb")
                        with handle, _Hashing(handle, member.sha256, member.path) as reader:
                            tar.addfile(_info(member), reader)
                            reader.check(member.size)
            raw.flush()
            os.fsync(raw.fileno())
        os.chmod(temporary, 0o644)
        os.replace(temporary, output)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise


def _info(member: ArchiveMember) -> tarfile.TarInfo:
    info = tarfile.TarInfo(member.path)
    info.mtime = member.mtime_ns // 1_000_000_000  # the exact ns are in the digest manifest
    info.mode = member.mode
    info.uid = info.gid = 0
    info.uname = info.gname = "root"
    if member.type == FILE:
        info.type, info.size = tarfile.REGTYPE, member.size
    elif member.type == DIR:
        info.type = tarfile.DIRTYPE
    elif member.type == SYMLINK:
        info.type, info.linkname = tarfile.SYMTYPE, member.target or ""
    return info


def _bytes_member(name: str, data: bytes) -> ArchiveMember:
    return ArchiveMember(name, FILE, 0o644, _now_ns(), len(data), "sha256:" + hashlib.sha256(data).hexdigest())


def _now_ns() -> int:
    return time.time_ns()


class _BytesReader:
    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def read(self, size: int = -1) -> bytes:
        end = len(self._data) if size < 0 else self._at + size
        block, self._at = self._data[self._at:end], min(end, len(self._data))
        return block


class _Hashing:
    """A reader that hashes what tarfile copies, so the bytes shipped are the bytes listed."""

    def __init__(self, source: IO[bytes] | _BytesReader, expected: str | None, name: str) -> None:
        self._source, self._expected, self._name = source, expected, name
        self._digest, self._count = hashlib.sha256(), 0

    def __enter__(self) -> _Hashing:
        return self

    def __exit__(self, *exc: object) -> None:
        pass

    def read(self, size: int = BLOCK_BYTES) -> bytes:
        block = self._source.read(size)
        self._digest.update(block)
        self._count += len(block)
        return block

    def check(self, size: int) -> None:
        # tarfile copies exactly `size` bytes; a file that grew keeps bytes we did not read.
        extra = self._source.read(1)
        found = "sha256:" + self._digest.hexdigest()
        if extra or self._count != size or (self._expected is not None and found != self._expected):
            raise DigestMismatch(f"{self._name} changed while it was exported; export again")


__all__ = ["Exported", "check_consistent", "export_checkpoints", "set_facts"]
