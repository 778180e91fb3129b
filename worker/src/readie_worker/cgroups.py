"""A container's cgroups, which runsc names after it: what the worker reads, limits and freezes there.

runsc puts every process of a sandbox (its gofer, its sentry and systrap's stub processes, which
run the sandbox's code) in cgroups named after the container: one directory per controller under
``/sys/fs/cgroup`` on a cgroup v1 host, one directory under the unified root on a v2 one. The
worker reads the memory and CPU there, lowers the memory limit there, and pauses an idle sandbox
by freezing it there (decision 33, "A sandbox paused by its freezer"). Every function takes the
id readie gave the container, never a name a sandbox chose.
"""

from __future__ import annotations

import os
from pathlib import Path

from .errors import SandboxSetupError, host_failure

__all__ = [
    "CGROUP_V1_CPUACCT", "CGROUP_V1_FREEZER", "CGROUP_V1_MEMORY", "CGROUP_V2", "cpu_usage_ns", "freeze",
    "memory_limit", "memory_usage", "limit_memory", "oom_killed",
]

CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_V1_CPUACCT = Path("/sys/fs/cgroup/cpuacct")
CGROUP_V1_FREEZER = Path("/sys/fs/cgroup/freezer")
CGROUP_V2 = Path("/sys/fs/cgroup")
# What each freezer file takes to freeze and to thaw.
_FREEZER_STATES = {"freezer.state": (b"FROZEN", b"THAWED"), "cgroup.freeze": (b"1", b"0")}


def oom_killed(container_id: str) -> bool:
    """Whether the kernel's OOM killer struck the container's memory cgroup (the backstop). Read it
    before ``runsc delete`` removes the cgroup."""
    for path, marker in (
        (CGROUP_V1_MEMORY / container_id / "memory.oom_control", "oom_kill "),
        (CGROUP_V2 / container_id / "memory.events", "oom_kill "),
    ):
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        for line in lines:
            if line.startswith(marker):
                return int(line.split()[1]) > 0
    return False


def memory_usage(container_id: str) -> int | None:
    """Bytes the container's memory cgroup holds now (sentry, gofer, and the sandbox's memory, files
    in its tmpfs and overlay included), or None without such a cgroup."""
    for path in (CGROUP_V1_MEMORY / container_id / "memory.usage_in_bytes", CGROUP_V2 / container_id / "memory.current"):
        try:
            return int(path.read_text())
        except (OSError, ValueError):
            continue
    return None


def cpu_usage_ns(container_id: str) -> int | None:
    """CPU nanoseconds the container's cgroup has used (sentry, gofer and the sandbox's code), or
    None without such a cgroup."""
    try:
        return int((CGROUP_V1_CPUACCT / container_id / "cpuacct.usage").read_text())
    except (OSError, ValueError):
        pass
    try:
        stat = (CGROUP_V2 / container_id / "cpu.stat").read_text().split()
        return int(stat[stat.index("usage_usec") + 1]) * 1000
    except (OSError, ValueError, IndexError):
        return None


def memory_limit(container_id: str) -> int | None:
    """The container's memory cgroup limit in bytes, or None without one (or without a limit)."""
    for path in (CGROUP_V1_MEMORY / container_id / "memory.limit_in_bytes", CGROUP_V2 / container_id / "memory.max"):
        try:
            return int(path.read_text())
        except OSError:
            continue
        except ValueError:  # v2's "max": no limit
            return None
    return None


def limit_memory(container_id: str, limit_bytes: int) -> None:
    """Lower a running container's memory cgroup limit (and its swap, so it cannot page out past
    it). The kernel reclaims down to it or refuses; refused is a SandboxSetupError."""
    v1 = CGROUP_V1_MEMORY / container_id
    settings = (
        [(v1 / "memory.limit_in_bytes", limit_bytes), (v1 / "memory.memsw.limit_in_bytes", limit_bytes)]
        if v1.is_dir()
        else [(CGROUP_V2 / container_id / "memory.max", limit_bytes), (CGROUP_V2 / container_id / "memory.swap.max", 0)]
    )
    for path, value in settings:
        if path.name.startswith("memory.memsw") or path.name == "memory.swap.max":
            if not path.exists():
                continue  # no swap accounting on this host: nothing to page out to
        with host_failure(SandboxSetupError, f"cannot limit the memory of {container_id} to {value} bytes"):
            path.write_text(str(value))


def freeze(container_id: str, frozen: bool) -> bool | None:
    """Freeze (``frozen``) or thaw every process of the container; whether the freezer took it,
    None where the container has no freezer cgroup.

    Frozen, no thread of the sandbox runs, however busy it was, and no signal tells it so: unlike a
    SIGSTOP of its sentry, which left systrap's stubs running user code to their next system call
    and kept the sentry's first answer after a SIGCONT up to 13 ms late one time in four. A process
    in a v1-frozen cgroup does not even die of SIGKILL until thawed: ``Runsc.destroy`` thaws after
    its kill. The write returns at once; the kernel finishes freezing each thread as it can.
    """
    for path in (CGROUP_V1_FREEZER / container_id / "freezer.state", CGROUP_V2 / container_id / "cgroup.freeze"):
        try:
            descriptor = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except FileNotFoundError:
            continue
        except OSError:
            return False
        try:
            os.write(descriptor, _FREEZER_STATES[path.name][0 if frozen else 1])
            return True
        except OSError:
            return False
        finally:
            os.close(descriptor)
    return None
