"""``readie checkpoints verify``: would a worker on this host restore each checkpoint of a set?

The verdict is the worker's own (``readie_worker.manifest.checkpoints_for``:
executor protocol and digest, runsc version, platform, spec fingerprint,
every image's files and sha256), plus what the worker only finds out at the
first restore: whether the rootfs the manifest names is there and is the
one it was captured from (its layer stamp names the manifest's rootfs
fingerprint). When the set as a whole is refused, the images are still
checked, so one run names every problem.
"""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, field
from pathlib import Path

from readie_executor.digest import source_digest
from readie_executor.framing import PROTOCOL_VERSION
from readie_worker.errors import CheckpointUnusable, ManifestError, SandboxSetupError
from readie_worker.manifest import Manifest, checkpoints_for, platform_of, read_manifest, verify_image
from readie_worker.runsc import Runsc, features

from .archive_format import HostFacts
from .rootfs import STAMP, stamp_matches

ALL = "*"  # the key of a problem that concerns every checkpoint of the set


@dataclass(frozen=True)
class Verdict:
    manifest_path: Path
    manifest: Manifest | None
    checkpoints: tuple[str, ...] = ()
    # checkpoint name (or ALL) -> each problem, with both sides named
    found: dict[str, list[str]] = field(default_factory=dict)

    @property
    def usable(self) -> bool:
        return self.manifest is not None and not self.found

    def problems(self) -> list[str]:
        return [f"{'all checkpoints' if name == ALL else name}: {problem}" for name, items in self.found.items() for problem in items]

    def lines(self) -> list[str]:
        """What ``readie checkpoints verify`` prints: one line per checkpoint, then every problem."""
        out = [f"checkpoints at {self.manifest_path}"]
        for name in self.checkpoints:
            refused = self.found.get(ALL, []) + self.found.get(name, [])
            out.append(f"  {name}: {'refused' if refused else 'would restore'}")
        out += [f"  problem: {line}" for line in self.problems()]
        out.append("all usable" if self.usable else "NOT usable on this host")
        return out


def host_runsc(binary: str) -> Runsc:
    """The Runsc a worker here would use: its flags come from what ``binary`` supports.

    The state dir is never used: verification runs no sandbox.
    """
    return Runsc(root=Path(tempfile.gettempdir()) / "readie-verify-unused", binary=binary)


def host_problems(facts: HostFacts, binary: str) -> list[str]:
    """The digest manifest's facts against this host, before anything is written (import step 2)."""
    problems = []
    if facts.executor_protocol != PROTOCOL_VERSION:
        problems.append(f"captured for executor protocol {facts.executor_protocol}, this host speaks {PROTOCOL_VERSION}")
    if facts.executor_digest is not None and facts.executor_digest != source_digest():
        problems.append(f"captured with executor {facts.executor_digest}, this host's is {source_digest()}")
    try:
        runsc = host_runsc(binary)
        version = features(binary).version
    except SandboxSetupError as exc:
        return [*problems, f"this host cannot run {binary}: {exc}"]
    if facts.runsc_version != version:
        problems.append(f"captured with {facts.runsc_version!r}, this host runs {version!r}")
    captured_on, runs_on = platform_of(facts.runsc_flags), platform_of(runsc.family_flags)
    if captured_on != runs_on:
        problems.append(f"captured with platform {captured_on}, this host runs {runs_on}")
    flags = flags_problem(facts.runsc_flags, runsc.family_flags)
    return [*problems, flags] if flags else problems


def flags_problem(captured: tuple[str, ...], host: tuple[str, ...]) -> str | None:
    """The runsc flags beside the platform (named on its own): restore wants the capture's.

    The worker refuses a difference only when it changes the spec
    fingerprint (network, overlay); verify names any, e.g. a checkpoint
    compression the host's runsc would not pass.
    """
    others = [flag for flag in captured if platform_of([flag]) is None]
    ours = [flag for flag in host if platform_of([flag]) is None]
    if others == ours:
        return None
    return f"captured with flags {' '.join(others)}, this host uses {' '.join(ours)}"


def verify_manifest(path: Path, binary: str = "runsc") -> Verdict:
    """The verdict for the manifest at ``path`` (already located and owner-checked)."""
    try:
        manifest = read_manifest(path)
    except ManifestError as exc:  # protocol, executor digest, malformed: each message names both sides
        return Verdict(path, None, found={ALL: [str(exc)]})
    found: dict[str, list[str]] = {}
    names = tuple(manifest.checkpoints)
    try:
        runsc = host_runsc(binary)
        loaded = checkpoints_for(runsc, path)
    except SandboxSetupError as exc:
        found[ALL] = [f"this host cannot run {binary}: {exc}"]
    else:
        flags = flags_problem(manifest.runsc_flags, runsc.family_flags)
        if flags and not any("captured with flags" in problem for problem in loaded.problems.values()):
            found[ALL] = [flags]
        for name, problem in loaded.problems.items():
            found.setdefault(name, []).append(problem)
        if ALL in loaded.problems:  # the worker stopped before the images; name their problems too
            for checkpoint in manifest.checkpoints.values():
                try:
                    verify_image(checkpoint)
                except CheckpointUnusable as exc:
                    found.setdefault(checkpoint.name, []).append(str(exc))
    rootfs = manifest.rootfs
    if not rootfs.is_dir():
        found.setdefault(ALL, []).append(f"the rootfs {rootfs} is not there; import the set's archive (readie checkpoints import)")
    elif not stamp_matches(rootfs.parent / STAMP, manifest.rootfs_fingerprint):
        found.setdefault(ALL, []).append(
            f"the rootfs {rootfs} is not the one the set was captured from: its {STAMP} does not name "
            f"{manifest.rootfs_fingerprint}"
        )
    return Verdict(path, manifest, names, found)


__all__ = ["ALL", "Verdict", "flags_problem", "host_problems", "host_runsc", "verify_manifest"]
