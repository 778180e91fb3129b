"""The sandbox's own root filesystem, built once per fingerprint of its inputs.

Two layers, each cached under ``$READIE_CACHE`` (default ``~/.cache/readie``)
by the fingerprint of what went into it, so a fresh clone reuses them and a
change rebuilds only what it touches:

* ``base/<fp>``: Debian bookworm minbase from debootstrap, with its python3;
* ``rootfs/<fp>``: a hard-linked copy of the base plus ``/opt/readie/site``
  (cloudpickle, ``readie_executor``, the packages checkpoints pre-import).

A layer counts only once its stamp file exists and names its fingerprint:
the stamp is written last, so an interrupted build is never mistaken for a
finished one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import readie_executor
from readie_executor.digest import source_digest
from readie_policy import locations
from readie_worker.bundle import EXECUTOR_DIR

from .plan import Plan

SUITE = "bookworm"
VARIANT = "minbase"
INCLUDE = ("python3", "ca-certificates")
# Bump when the build steps change in a way the inputs below do not show.
# 2: site packages are byte-compiled.
BUILD_RECIPE = 2
STAMP = "readie-layer.json"
# Old rootfs layers kept besides the current one, however old; each holds ~150 MB of site packages.
KEEP_OLD_LAYERS = 2
# A layer a capture built or reused this recently is never pruned: its checkpoints may be in
# use. Two checkouts capturing on one machine (a developer's and CI's clean clone) each prune
# the other's layer otherwise, and the other's sandboxes then fail to start ("mounting root").
LAYER_IN_USE_S = 24 * 3600
# The most old layers kept, recently used or not: the cache's bound.
MAX_OLD_LAYERS = 8
# debootstrap downloads ~100 MB; on a slow mirror it can take minutes.
DEBOOTSTRAP_TIMEOUT_S = 20 * 60
INSTALL_TIMEOUT_S = 10 * 60


def cache_dir() -> Path:
    """``$READIE_CACHE``, else ``~/.cache/readie``: the one rule, shared with the checkpoints' default."""
    return locations.cache_dir()


@dataclass(frozen=True)
class Rootfs:
    path: Path  # the directory given to runsc as root.path
    fingerprint: str
    python: str  # version of the sandbox's own python3


def base_fingerprint() -> str:
    return _fingerprint({"suite": SUITE, "variant": VARIANT, "include": INCLUDE, "recipe": BUILD_RECIPE})


def rootfs_fingerprint(plan: Plan) -> str:
    return _fingerprint(
        {
            "base": base_fingerprint(),
            "requirements": plan.requirements,
            "mounts": plan.mounts.to_json(),
            "executor": source_digest(),
            "recipe": BUILD_RECIPE,
        }
    )


def ensure_rootfs(plan: Plan, report: Callable[[str], None] | None = None) -> Rootfs:
    """Return the rootfs for ``plan``, building whatever layer is missing."""
    cache = cache_dir()
    base = _layer(cache / "base" / base_fingerprint()[7:23], base_fingerprint(), _build_base, report)
    fingerprint = rootfs_fingerprint(plan)
    layer = _layer(
        cache / "rootfs" / fingerprint[7:23],
        fingerprint,
        lambda target: _build_site(base / "rootfs", target, plan),
        report,
    )
    os.utime(layer)  # reused counts as used: _prune keeps what was used lately
    _prune(cache / "rootfs", keep=layer)
    return Rootfs(layer / "rootfs", fingerprint, _sandbox_python_version(layer / "rootfs"))


def _layer(
    directory: Path,
    fingerprint: str,
    build: Callable[[Path], None],
    report: Callable[[str], None] | None,
) -> Path:
    stamp = directory / STAMP
    if stamp_matches(stamp, fingerprint):
        return directory
    if directory.exists():
        shutil.rmtree(directory)  # a half-built or foreign layer is never trusted
    staging = directory.with_name(f".staging-{directory.name}-{os.getpid()}")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    started = time.monotonic()
    if report:
        report(f"building {directory.parent.name} layer {directory.name} (fingerprint {fingerprint[:23]}…)")
    try:
        build(staging)
        (staging / STAMP).write_text(json.dumps({"fingerprint": fingerprint, "built_at": time.time()}))
        staging.rename(directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if report:
        report(f"built {directory.parent.name} layer in {time.monotonic() - started:.1f} s")
    return directory


#: Layers ``readie checkpoints import`` installed, named by their content: never taken for
#: a build of the same fingerprint (a capture here builds its own), never pruned.
IMPORTED_LAYER_PREFIX = "imported-"


def stamp_matches(stamp: Path, fingerprint: str) -> bool:
    try:
        return json.loads(stamp.read_text()).get("fingerprint") == fingerprint
    except (OSError, ValueError, AttributeError):
        return False


def _build_base(staging: Path) -> None:
    target = staging / "rootfs"
    _run(
        ["debootstrap", f"--variant={VARIANT}", f"--include={','.join(INCLUDE)}", SUITE, str(target)],
        staging / "debootstrap.log",
        DEBOOTSTRAP_TIMEOUT_S,
    )
    # Nothing of the build host may show inside a sandbox.
    (target / "etc" / "hostname").write_text("readie\n")
    (target / "etc" / "hosts").write_text("127.0.0.1 localhost readie\n::1 localhost\n")
    (target / "etc" / "resolv.conf").write_text("")
    (target / "etc" / "machine-id").write_text("")
    for cache in ("var/cache/apt/archives", "var/lib/apt/lists"):
        for entry in (target / cache).glob("*"):
            if entry.is_file():
                entry.unlink()


def _build_site(base_rootfs: Path, staging: Path, plan: Plan) -> None:
    target = staging / "rootfs"
    # Hard links: the base is never written after it is stamped, so sharing is safe and instant.
    _run(["cp", "-al", str(base_rootfs), str(target)], staging / "copy.log", INSTALL_TIMEOUT_S)
    site = target / "opt" / "readie" / "site"
    site.mkdir(parents=True)
    _run(
        ["uv", "pip", "install", "--quiet", "--python", sys.executable, "--target", str(site), *plan.requirements],
        staging / "install.log",
        INSTALL_TIMEOUT_S,
    )
    # runsc would create missing mount points itself, on the host side of the rootfs.
    for destination, _ in plan.mounts.slots():
        (target / destination.relative_to("/")).mkdir(parents=True, exist_ok=True)
    (target / EXECUTOR_DIR.relative_to("/")).mkdir(parents=True, exist_ok=True)
    shutil.copytree(
        Path(readie_executor.__file__).parent,
        site / "readie_executor",
        ignore=shutil.ignore_patterns("__pycache__", "*.pyc"),
    )
    # Byte-compiled here, once: otherwise every capture compiles pandas from
    # source (the compiler's garbage made the pandas image 77 MB instead of
    # 49, and its restore that much dearer), and so does every job that
    # imports a module the template did not. The host's python is the
    # sandbox's minor version (readie requires it), so the .pyc files match.
    _run([sys.executable, "-m", "compileall", "-q", "-j", "0", str(site)], staging / "compile.log", INSTALL_TIMEOUT_S)


def _sandbox_python_version(rootfs: Path) -> str:
    """The rootfs's python3 version, from dpkg's records (e.g. 3.11.2 of 3.11.2-6+deb12u6)."""
    status = (rootfs / "var" / "lib" / "dpkg" / "status").read_text(errors="replace")
    for stanza in status.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines() if ": " in line)
        if fields.get("Package") == "python3-minimal":
            return fields.get("Version", "unknown").split("-", 1)[0]
    return "unknown"


def _prune(layers: Path, keep: Path) -> None:
    # Imported layers (readie checkpoints import) are an imported set's, never this cache's to drop.
    others = [
        p for p in layers.iterdir()
        if p.is_dir() and p != keep and not p.name.startswith((".", IMPORTED_LAYER_PREFIX))
    ]
    others.sort(key=lambda p: p.stat().st_mtime, reverse=True)
    recent = time.time() - LAYER_IN_USE_S
    for rank, stale in enumerate(others):
        if rank < KEEP_OLD_LAYERS or (rank < MAX_OLD_LAYERS and stale.stat().st_mtime >= recent):
            continue
        shutil.rmtree(stale, ignore_errors=True)


def _run(args: list[str], log_path: Path, timeout: float) -> None:
    with open(log_path, "wb") as log_file:
        try:
            completed = subprocess.run(args, stdout=log_file, stderr=subprocess.STDOUT, timeout=timeout)
        except subprocess.TimeoutExpired:
            raise RootfsError(f"{args[0]} timed out after {timeout:.0f} s; see {log_path}") from None
        except FileNotFoundError:
            raise RootfsError(f"{args[0]} is not installed (apt-get install -y debootstrap; pip install uv)") from None
    if completed.returncode != 0:
        tail = log_path.read_text(errors="replace")[-1500:]
        raise RootfsError(f"{' '.join(args[:3])} … exited {completed.returncode}:\n{tail}")


class RootfsError(RuntimeError):
    pass


def _fingerprint(inputs: object) -> str:
    return "sha256:" + hashlib.sha256(json.dumps(inputs, sort_keys=True).encode()).hexdigest()


