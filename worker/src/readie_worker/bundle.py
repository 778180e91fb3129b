"""OCI bundles for executor sandboxes, and the mount plan they share.

gVisor takes a restored sandbox's mount tree from the checkpoint image: at
restore only the *source* of an existing mount may change. So every mount a
later sandbox could need (its executor dir, read and write grants, package
dirs) is a slot planned at capture time, pointed at an empty placeholder then
and at a source of the sandbox's own when it is restored: a package dir
itself, or, for a read or write slot, a directory on whose ``grant`` point the
grant is mounted whenever a job takes the sandbox (``_sandbox_dir``).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from readie_executor import AFTER_RESTORE_VARIABLE

# Where things live inside every sandbox.
EXECUTOR_DIR = PurePosixPath("/readie/run")
SITE_DIR = PurePosixPath("/opt/readie/site")
GRANT_SLOT_DIR = PurePosixPath("/readie/grants")
PACKAGE_SLOT_DIR = PurePosixPath("/readie/packages")
#: Where a read or write slot holds its grant: the slot is mounted when a sandbox is restored,
#: its grant beneath it whenever a job takes the sandbox (decision 0034), so a warm sandbox
#: can serve a job with grants.
GRANT_POINT = "grant"
SANDBOX_PYTHON = "/usr/bin/python3"
EXECUTOR_ARGV = (SANDBOX_PYTHON, "-u", "-m", "readie_executor")

# The capture environment pins BLAS/OpenMP pools to one thread: a helper
# thread in the template would be cloned into every sandbox (notes, "Traps").
SINGLE_THREAD_ENV = {"OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
# Keep the hostname predictable and free of anything of the host's.
HOSTNAME = "readie"
# Enough descriptors for ordinary jobs; the host's limit never leaks in.
NOFILE_LIMIT = 4096


#: An after-restore hook as a capture plan and a manifest name it: ``package.module``
#: (whose ``after_restore`` is called) or ``package.module:function``. A manifest may
#: come from another host, so the name is checked before it reaches an environment.
AFTER_RESTORE_HOOK = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*(:[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*)?$"
)


def capture_env(plan: MountPlan, preimport: tuple[str, ...], after_restore: str = "") -> dict[str, str]:
    """The environment an executor is captured (or cold-started) with.

    No ``PYTHONHASHSEED``: every capture draws its own string-hash seed (the
    sandboxes restored from one image share it; docs/security.md).
    """
    hook = {AFTER_RESTORE_VARIABLE: after_restore} if after_restore else {}
    return {
        **serve_env(preimport),
        **SINGLE_THREAD_ENV,
        **hook,
        "PYTHONPATH": plan.python_path(),
        "EXECUTOR_DIR": str(EXECUTOR_DIR),
        "EXECUTOR_MODE": "capture",
    }


def serve_env(preimport: tuple[str, ...]) -> dict[str, str]:
    """The base of what a sandbox's executor is handed after restore; jobs add their own."""
    return {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        "HOME": "/tmp",
        "READIE_PREIMPORT": ",".join(preimport),
    }


#: Slots of one kind a plan may have: every slot is a bind mount in every sandbox of the
#: family, and a manifest is read from disk (an imported one from another host).
MAX_SLOTS = 16


@dataclass(frozen=True)
class MountPlan:
    """How many grant and package slots every sandbox of a checkpoint family has."""

    read_slots: int = 4
    write_slots: int = 4
    package_slots: int = 2

    def read_slot(self, index: int) -> PurePosixPath:
        return GRANT_SLOT_DIR / f"read-{index}"

    def write_slot(self, index: int) -> PurePosixPath:
        return GRANT_SLOT_DIR / f"write-{index}"

    def package_slot(self, index: int) -> PurePosixPath:
        return PACKAGE_SLOT_DIR / str(index)

    def grant_slots(self) -> list[PurePosixPath]:
        """The read and write slots: those a grant reaches after restore, beneath the slot."""
        return [self.read_slot(i) for i in range(self.read_slots)] + [self.write_slot(i) for i in range(self.write_slots)]

    def slots(self) -> list[tuple[PurePosixPath, bool]]:
        """(destination, writable) for every slot, in a fixed order."""
        return (
            [(self.read_slot(i), False) for i in range(self.read_slots)]
            + [(self.write_slot(i), True) for i in range(self.write_slots)]
            + [(self.package_slot(i), False) for i in range(self.package_slots)]
        )

    def python_path(self) -> str:
        """sys.path is frozen into the template, so the package slots join it at capture."""
        return ":".join([str(SITE_DIR), *(str(self.package_slot(i)) for i in range(self.package_slots))])

    def to_json(self) -> dict[str, int]:
        return {"read": self.read_slots, "write": self.write_slots, "packages": self.package_slots}

    @classmethod
    def from_json(cls, raw: Mapping[str, object]) -> MountPlan:
        """The plan a manifest records; ValueError for counts that are not 0 to MAX_SLOTS integers."""
        counts = [raw[key] for key in ("read", "write", "packages")]
        if any(isinstance(count, bool) or not isinstance(count, int) or not 0 <= count <= MAX_SLOTS for count in counts):
            raise ValueError(f"mount plan {dict(raw)!r:.200}: each count is an integer from 0 to {MAX_SLOTS}")
        return cls(*counts)  # type: ignore[arg-type]


@dataclass(frozen=True)
class SandboxSpec:
    """Everything that varies between the sandboxes of one checkpoint family."""

    rootfs: Path
    executor_dir: Path  # host side of EXECUTOR_DIR
    env: Mapping[str, str]
    plan: MountPlan = field(default_factory=MountPlan)
    # destination -> host source; a slot not listed here gets the placeholder.
    sources: Mapping[PurePosixPath, Path] = field(default_factory=dict)
    # An empty per-sandbox dir for unused slots: a write slot must never be
    # shared between sandboxes, even when nothing was granted.
    unused_slot_source: Path | None = None
    memory_limit_bytes: int | None = None
    # A network namespace of readie's to join (egress_net.SandboxNetwork), else a new empty one.
    network_namespace: Path | None = None

    def oci_config(self) -> dict[str, object]:
        placeholder = self.unused_slot_source or self.executor_dir.parent / "unused"
        mounts: list[dict[str, object]] = [
            {"destination": "/proc", "type": "proc", "source": "proc"},
            {"destination": "/dev", "type": "tmpfs", "source": "tmpfs"},
            {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
            {"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": ["nosuid", "nodev"]},
            _bind(EXECUTOR_DIR, self.executor_dir, writable=True),
        ]
        for destination, writable in self.plan.slots():
            mounts.append(_bind(destination, self.sources.get(destination, placeholder), writable))
        linux: dict[str, object] = {
            "namespaces": [
                {"type": kind, "path": str(self.network_namespace)} if kind == "network" and self.network_namespace else {"type": kind}
                for kind in ("pid", "network", "ipc", "uts", "mount")
            ],
        }
        if self.memory_limit_bytes is not None:
            linux["resources"] = {"memory": {"limit": self.memory_limit_bytes}}
        return {
            "ociVersion": "1.0.0",
            "process": {
                "user": {"uid": 0, "gid": 0},
                "args": list(EXECUTOR_ARGV),
                "env": [f"{key}={value}" for key, value in sorted(self.env.items())],
                "cwd": "/",
                "capabilities": {},
                "rlimits": [{"type": "RLIMIT_NOFILE", "hard": NOFILE_LIMIT, "soft": NOFILE_LIMIT}],
                "noNewPrivileges": True,
            },
            # Writable only through --overlay2=root:memory: the rootfs on disk is shared and never written.
            "root": {"path": str(self.rootfs), "readonly": False},
            "hostname": HOSTNAME,
            "mounts": mounts,
            "linux": linux,
        }

    def write(self, bundle_dir: Path) -> Path:
        bundle_dir.mkdir(parents=True, exist_ok=True)
        path = bundle_dir / "config.json"
        # Unindented: json's C encoder takes no indent, and its Python one cost 0.1 ms (hot) of
        # every restore's launch. `jq . config.json` reads it.
        path.write_text(json.dumps(self.oci_config()))
        return path


def spec_fingerprint(config: Mapping[str, object], runsc_flags: Sequence[str]) -> str:
    """What a restore must match: everything but the environment and mount sources."""
    process = config["process"]
    assert isinstance(process, Mapping)
    root = config["root"]
    assert isinstance(root, Mapping)
    linux = config.get("linux") or {}
    assert isinstance(linux, Mapping)
    mounts = config.get("mounts") or []
    assert isinstance(mounts, list)
    flags = [flag.lstrip("-") for flag in runsc_flags]  # runsc takes -flag and --flag alike
    shape = {
        "args": process.get("args"),
        "cwd": process.get("cwd"),
        "root_readonly": root.get("readonly"),
        "mounts": [[m.get("destination"), m.get("type"), m.get("options")] for m in mounts],
        "namespaces": linux.get("namespaces"),
        "network": [flag for flag in flags if flag.startswith("network")],
        "overlay": [flag for flag in flags if flag.startswith("overlay")],
    }
    return "sha256:" + hashlib.sha256(json.dumps(shape, sort_keys=True).encode()).hexdigest()


def _bind(destination: PurePosixPath, source: Path, writable: bool) -> dict[str, object]:
    return {
        "destination": str(destination),
        "type": "bind",
        "source": str(source),
        "options": ["rbind", "rw" if writable else "ro"],
    }


def family_fingerprint(rootfs: Path, plan: MountPlan, runsc_flags: Sequence[str]) -> str:
    """The spec fingerprint every sandbox of one checkpoint family shares."""
    probe = SandboxSpec(rootfs=rootfs, executor_dir=Path("/nonexistent/run"), env={}, plan=plan)
    return spec_fingerprint(probe.oci_config(), runsc_flags)
