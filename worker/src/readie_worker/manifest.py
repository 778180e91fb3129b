"""The checkpoint manifest: what the pipeline wrote and what a worker may trust.

Loading rules, strictest first:

* no manifest at all: cold starts only (not an error);
* an ``executor_protocol`` other than ours (absent counts as 1): refused,
  naming both versions, because a restored executor that speaks another
  framing connects and then hangs;
* an ``executor_digest`` other than our executor's source digest: refused,
  because the frozen executor would refuse or misread this worker's jobs
  (absent, in manifests that predate it: accepted);
* a different runsc version, platform or spec fingerprint: the checkpoints
  are dropped (``strict``: refused), naming both sides, because restore needs
  the runsc, the platform and the mount shape that made them;
* a missing or corrupt image: that checkpoint alone is unusable.
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from readie_executor.digest import source_digest
from readie_executor.framing import PROTOCOL_VERSION
from readie_policy.locations import MANIFEST_NAME

from .bundle import AFTER_RESTORE_HOOK, MountPlan, family_fingerprint
from .errors import CheckpointUnusable, ManifestError
from .runsc import Runsc, features

# A manifest lists a handful of checkpoints; anything near this is not one.
MAX_MANIFEST_BYTES = 1024 * 1024
_HASH_BLOCK = 1024 * 1024


@dataclass(frozen=True)
class ImageFile:
    """One file of an image directory: runsc 2024 writes three when uncompressed."""

    name: str
    size_bytes: int
    sha256: str


@dataclass(frozen=True)
class Checkpoint:
    name: str
    preimport: tuple[str, ...]
    image_path: Path  # absolute; stored relative to the manifest's directory
    files: tuple[ImageFile, ...]  # every file of image_path, no more, no fewer
    restore_p50_ms: float  # runsc restore until the measure-mode executor exits
    cold_start_p50_ms: float  # runsc run, imports and all, until the socket answers
    restore_to_socket_p50_ms: float
    # The memory cgroup of a restored, idle sandbox (sentry, gofer, template):
    # what a job's 'memory' comes on top of. None in manifests that predate it.
    idle_memory_bytes: int | None = None
    # The operator's after-restore hook (decision 23), run in every sandbox woken from the image.
    after_restore: str = ""

    @property
    def size_bytes(self) -> int:
        return sum(file.size_bytes for file in self.files)


@dataclass(frozen=True)
class Manifest:
    executor_protocol: int
    runsc_version: str
    runsc_flags: tuple[str, ...]
    spec_fingerprint: str
    rootfs: Path
    rootfs_fingerprint: str
    python: str
    executor_argv: tuple[str, ...]
    mount_plan: MountPlan
    created_at: str
    checkpoints: Mapping[str, Checkpoint]
    # The executor's source digest when captured (readie_executor.digest); None in older manifests.
    executor_digest: str | None = None

    def to_json(self, base: Path) -> dict[str, Any]:
        return {
            "executor_protocol": self.executor_protocol,
            "executor_digest": self.executor_digest,
            "runsc_version": self.runsc_version,
            "runsc_flags": list(self.runsc_flags),
            "spec_fingerprint": self.spec_fingerprint,
            "rootfs": str(self.rootfs),
            "rootfs_fingerprint": self.rootfs_fingerprint,
            "python": self.python,
            "executor_argv": list(self.executor_argv),
            "mount_plan": self.mount_plan.to_json(),
            "created_at": self.created_at,
            "checkpoints": [
                {**asdict(c), "preimport": list(c.preimport), "image_path": os.path.relpath(c.image_path, base)}
                for c in self.checkpoints.values()
            ],
        }


@dataclass(frozen=True)
class LoadedCheckpoints:
    """The outcome of loading: usable checkpoints, and why the others are not."""

    manifest: Manifest | None
    usable: Mapping[str, Checkpoint] = field(default_factory=dict)
    problems: Mapping[str, str] = field(default_factory=dict)  # checkpoint name, or "*" for all


def write_manifest(manifest: Manifest, path: Path) -> None:
    """Write atomically: a reader sees the old manifest or the new one, never half."""
    path.parent.mkdir(parents=True, exist_ok=True)
    data = json.dumps(manifest.to_json(path.parent), indent=2, sort_keys=False) + "\n"
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".manifest-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            file.write(data)
            file.flush()
            os.fsync(file.fileno())
        os.chmod(tmp, 0o644)  # workers may run as another user than the pipeline
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def read_manifest(path: Path) -> Manifest:
    """Parse and check the version; raise ManifestError for anything unusable as a whole."""
    try:
        size = path.stat().st_size
        if size > MAX_MANIFEST_BYTES:
            raise ManifestError(f"{path}: {size} bytes is not a manifest (limit {MAX_MANIFEST_BYTES})")
        raw = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError) as exc:
        raise ManifestError(f"{path}: cannot read the checkpoint manifest: {exc}") from None
    if not isinstance(raw, dict):
        raise ManifestError(f"{path}: the checkpoint manifest is not a JSON object")
    version = raw.get("executor_protocol", 1)
    if version != PROTOCOL_VERSION:
        raise ManifestError(protocol_mismatch_message(path, version))
    captured_with = raw.get("executor_digest")
    if captured_with is not None and captured_with != source_digest():
        raise ManifestError(
            f"{path}: the checkpoints were captured with another executor (its source changed since: "
            f"{str(captured_with)[:23]}..., this worker's is {source_digest()[:23]}...); a restored sandbox "
            "would refuse or misread this worker's jobs: recapture them (make capture)"
        )
    try:
        return _parse(raw, path.parent)
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ManifestError(f"{path}: malformed checkpoint manifest: {type(exc).__name__}: {exc}") from None


def protocol_mismatch_message(path: Path, found: object) -> str:
    return (
        f"{path}: checkpoints were built for executor protocol {found!r}, but this worker speaks "
        f"executor protocol {PROTOCOL_VERSION}; rebuild them with the current pipeline (make capture)"
    )


def checkpoints_for(runsc: Runsc, path: Path, *, strict: bool = False) -> LoadedCheckpoints:
    """The checkpoints at ``path`` that ``runsc`` (its binary and flags) can restore."""
    if not path.exists():
        return load_checkpoints(path, runsc_version="", spec_fingerprint="")
    manifest = read_manifest(path)
    return load_checkpoints(
        path,
        runsc_version=features(runsc.binary).version,
        spec_fingerprint=family_fingerprint(manifest.rootfs, manifest.mount_plan, runsc.family_flags),
        runsc_flags=runsc.family_flags,
        strict=strict,
    )


def load_checkpoints(
    path: Path,
    *,
    runsc_version: str,
    spec_fingerprint: str,
    runsc_flags: Sequence[str] | None = None,
    strict: bool = False,
    verify_images: bool = True,
) -> LoadedCheckpoints:
    """Load ``path`` for a runsc of ``runsc_version`` whose family has ``spec_fingerprint``.

    ``runsc_flags``, when given, are named beside the manifest's in a mismatch.
    """
    if not path.exists():
        return LoadedCheckpoints(None, problems={"*": f"no manifest at {path}: cold starts only"})
    manifest = read_manifest(path)
    mismatch = []
    if manifest.runsc_version != runsc_version:
        mismatch.append(f"captured with {manifest.runsc_version!r}, this host runs {runsc_version!r}")
    # The platform is in no fingerprint, and a systrap image restored under
    # ptrace is not refused by runsc (the job segfaults): named on its own.
    captured_on, runs_on = platform_of(manifest.runsc_flags), platform_of(runsc_flags or ())
    if runsc_flags is not None and captured_on != runs_on:
        mismatch.append(f"captured with platform {captured_on or '(runsc default)'}, this host runs {runs_on or '(runsc default)'}")
    if manifest.spec_fingerprint != spec_fingerprint:
        mismatch.append(f"spec fingerprint {manifest.spec_fingerprint} != expected {spec_fingerprint}")
        if runsc_flags is not None and tuple(runsc_flags) != manifest.runsc_flags:
            mismatch.append(f"captured with flags {' '.join(manifest.runsc_flags)}, this host uses {' '.join(runsc_flags)}")
    if mismatch:
        reason = f"{path}: checkpoints dropped: " + "; ".join(mismatch) + " (rebuild with make capture)"
        if strict:
            raise ManifestError(reason)
        return LoadedCheckpoints(manifest, problems={"*": reason})
    usable: dict[str, Checkpoint] = {}
    problems: dict[str, str] = {}
    for name, checkpoint in manifest.checkpoints.items():
        try:
            if verify_images:
                verify_image(checkpoint)
        except CheckpointUnusable as exc:
            problems[name] = str(exc)
        else:
            usable[name] = checkpoint
    return LoadedCheckpoints(manifest, usable, problems)


def platform_of(flags: Sequence[str]) -> str | None:
    """The ``--platform=`` value among runsc flags (runsc takes ``-platform=`` too); None when unnamed."""
    for flag in flags:
        name, _, value = flag.lstrip("-").partition("=")
        if name == "platform":
            return value
    return None


def image_files(image_dir: Path) -> tuple[ImageFile, ...]:
    """Name, size and hash of every file in ``image_dir``, as the pipeline records them."""
    return tuple(
        ImageFile(path.name, path.stat().st_size, file_sha256(path)) for path in sorted(image_dir.iterdir())
    )


def verify_image(checkpoint: Checkpoint) -> None:
    """Refuse an image directory whose files are not exactly those recorded, byte for byte.

    Sizes first (cheap), then hashes. A file added beside the image counts:
    runsc reads every file it finds there.
    """
    where = f"checkpoint {checkpoint.name!r}: image {checkpoint.image_path}"
    try:
        entries = {entry.name: entry for entry in os.scandir(checkpoint.image_path)}
    except OSError as exc:
        raise CheckpointUnusable(f"{where} missing: {exc}") from None
    recorded = {file.name: file for file in checkpoint.files}
    if entries.keys() != recorded.keys():
        missing, extra = sorted(recorded.keys() - entries.keys()), sorted(entries.keys() - recorded.keys())
        raise CheckpointUnusable(f"{where} has other files than recorded (missing {missing}, unexpected {extra})")
    for name, file in recorded.items():
        entry = entries[name]
        if not entry.is_file(follow_symlinks=False):
            raise CheckpointUnusable(f"{where}: {name} is not a regular file")
        if entry.stat(follow_symlinks=False).st_size != file.size_bytes:
            raise CheckpointUnusable(f"{where}: {name} is {entry.stat().st_size} bytes, the manifest says {file.size_bytes}")
    for name, file in recorded.items():
        try:
            digest = _sha256_no_follow(checkpoint.image_path / name, file.size_bytes)
        except OSError as exc:
            raise CheckpointUnusable(f"{where}: cannot read {name}: {exc}") from None
        if digest != file.sha256:
            raise CheckpointUnusable(f"{where}: {name} is corrupt (sha256 {digest}, manifest says {file.sha256})")


def _sha256_no_follow(path: Path, size: int) -> str:
    """The hash of at most ``size`` bytes of ``path``, opened without following a symlink
    swapped in since the directory was listed; a file of another size is corrupt."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as file:
        if os.fstat(file.fileno()).st_size != size:
            return "sha256:size-changed"
        digest = hashlib.sha256()
        while block := file.read(min(_HASH_BLOCK, size - file.tell())):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        while block := file.read(_HASH_BLOCK):
            digest.update(block)
    return "sha256:" + digest.hexdigest()


def _parse(raw: Mapping[str, Any], base: Path) -> Manifest:
    checkpoints = {}
    for entry in raw["checkpoints"]:
        checkpoint = Checkpoint(
            name=str(entry["name"]),
            preimport=tuple(str(name) for name in entry["preimport"]),
            image_path=(base / str(entry["image_path"])).resolve(),
            files=tuple(
                ImageFile(str(file["name"]), int(file["size_bytes"]), str(file["sha256"])) for file in entry["files"]
            ),
            restore_p50_ms=float(entry["restore_p50_ms"]),
            cold_start_p50_ms=float(entry["cold_start_p50_ms"]),
            restore_to_socket_p50_ms=float(entry["restore_to_socket_p50_ms"]),
            idle_memory_bytes=None if entry.get("idle_memory_bytes") is None else int(entry["idle_memory_bytes"]),
            after_restore=_after_restore(entry.get("after_restore", "")),
        )
        names = [file.name for file in checkpoint.files]
        if len(set(names)) != len(names):
            raise ValueError(f"checkpoint {checkpoint.name!r} lists a file twice")
        checkpoints[checkpoint.name] = checkpoint
    return Manifest(
        executor_protocol=int(raw["executor_protocol"]),
        runsc_version=str(raw["runsc_version"]),
        runsc_flags=tuple(str(flag) for flag in raw["runsc_flags"]),
        spec_fingerprint=str(raw["spec_fingerprint"]),
        rootfs=Path(str(raw["rootfs"])),
        rootfs_fingerprint=str(raw["rootfs_fingerprint"]),
        python=str(raw["python"]),
        executor_argv=tuple(str(arg) for arg in raw["executor_argv"]),
        mount_plan=MountPlan.from_json(raw["mount_plan"]),
        created_at=str(raw["created_at"]),
        checkpoints=checkpoints,
        executor_digest=None if raw.get("executor_digest") is None else str(raw["executor_digest"]),
    )


def _after_restore(value: object) -> str:
    if value == "":
        return ""
    if not isinstance(value, str) or not AFTER_RESTORE_HOOK.fullmatch(value):
        raise ValueError(f"after_restore must name a module or module:callable, got {value!r}")
    return value
