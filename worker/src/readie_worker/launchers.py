"""Launchers: how one kind of sandbox is started and torn down, behind one protocol.

The lifecycle around them (directory, hand-over, socket, exchange, destroy)
is ``sandbox.launch``'s, written once; a launcher only starts a process that
sits at its capture point and tears down what it started:

* :class:`RunscRestore`: ``runsc restore`` from a checkpoint image;
* :class:`RunscCold`: ``runsc run`` of the same rootfs and imports (fallback);
* :class:`LocalProcess`: a plain host subprocess, for development only: no
  isolation at all, refused unless explicitly enabled.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import structlog

from . import cgroups
from ._sandbox_dir import SandboxDir
from .bundle import EXECUTOR_DIR, SINGLE_THREAD_ENV, MountPlan, SandboxSpec
from .errors import RequestError, SandboxSetupError
from ._sentry import signal_sandbox_process
from .runsc import Launched, Runsc, RunscError

__all__ = ["JOB_MEMORY_SLACK", "Launcher", "LocalProcess", "RunscCold", "RunscRestore"]

log = structlog.get_logger("readie.sandbox")

# What gVisor's sentry adds to the memory cgroup for a job's own memory: page
# tables and bookkeeping for what the job maps, measured at ~2 % (244 MB of
# cgroup growth for a 240 MB bytearray); this covers a multi-GiB job.
JOB_MEMORY_SLACK = 64 * 1024**2

class Launcher(Protocol):
    """How one kind of sandbox is started and torn down."""

    name: str
    isolated: bool
    plan: MountPlan  # the slots every sandbox it starts has

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> Launched:
        """Start an executor at its capture point; its stdin and stdout are pipes."""

    def executor_dir(self, sandbox: SandboxDir) -> str:
        """EXECUTOR_DIR as the executor inside sees it."""

    def hold_mounts(self, sandbox: SandboxDir) -> int | None:
        """A descriptor that keeps the started sandbox's view of its grants whole until closed
        (``Runsc.gofer_namespace``); None where there is nothing to hold."""

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> None:
        """Tear down whatever ``start`` left, ``process`` or not (a start that failed part-way)."""

    def pause(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        """Stop the started sandbox's processes, which then use no CPU; whether they were. Only
        ``resume`` or ``destroy`` may follow."""

    def resume(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        """Let a paused sandbox run again; whether it was (else it stays stopped: destroy it)."""

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        """Whether the memory backstop killed the sandbox (asked before destroy)."""

    def limit_memory(self, sandbox: SandboxDir, job_bytes: int) -> int | None:
        """Bound the whole sandbox to what it holds now plus ``job_bytes``; the limit set, if any."""

    def memory_usage(self, sandbox: SandboxDir) -> int | None:
        """Bytes the sandbox's memory cgroup holds now; None where there is none."""

    def memory_left(self, sandbox: SandboxDir) -> int | None:
        """Bytes the sandbox may still take before its memory cgroup's limit; None where none is known."""

    def cpu_ns(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> int | None:
        """CPU nanoseconds the sandbox has used so far, all its processes; None where unknown."""

    def checkpoint(self, sandbox: SandboxDir, image_dir: Path, *, leave_running: bool = False) -> None:
        """Save the sandbox, its executor hibernating, to ``image_dir``; the container ends unless
        ``leave_running``."""


@dataclass(frozen=True)
class _RunscLauncher:
    runsc: Runsc
    rootfs: Path
    plan: MountPlan
    base_env: Mapping[str, str]
    # The cgroup backstop of every sandbox, under the per-job RLIMIT_AS: it kills the whole sandbox.
    memory_limit_bytes: int | None = None
    isolated: bool = True
    # The network namespace the sandbox joins (runsc from egress_net.with_sandbox_network); None: none.
    network_namespace: Path | None = None

    def executor_dir(self, sandbox: SandboxDir) -> str:
        return str(EXECUTOR_DIR)

    def hold_mounts(self, sandbox: SandboxDir) -> int | None:
        """The gofer's mount namespace, held: without it a gofer that dies takes its mounts along,
        and a grant beneath its slot (decision 34) would turn, under a running job, into the slot's
        empty read-only directory instead of failing the sandbox as a dead gofer does."""
        state_file = self.runsc.root / f"{sandbox.id}_sandbox:{sandbox.id}.state"  # runsc's own record
        try:
            gofer = json.loads(state_file.read_text())["goferPid"]
            if isinstance(gofer, bool) or not isinstance(gofer, int) or gofer <= 0:
                raise ValueError(f"goferPid {gofer!r}")
            return os.open(f"/proc/{gofer}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        except (OSError, ValueError, KeyError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) else exc  # no host path in a client's error
            raise SandboxSetupError(f"sandbox {sandbox.id}: cannot hold its gofer's mount namespace: {reason}") from None

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        return cgroups.oom_killed(sandbox.id)

    def pause(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        # The whole sandbox, by its cgroup's freezer; where it has none (a host runsc gave none), its
        # sentry alone by SIGSTOP, which systrap's stubs outrun to their next system call.
        frozen = cgroups.freeze(sandbox.id, True)
        return signal_sandbox_process(sandbox.id, sandbox.pid_file, signal.SIGSTOP) if frozen is None else frozen

    def resume(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        # A SIGCONT is forwarded by runsc to the sandbox's init, the executor: ignored there by default.
        thawed = cgroups.freeze(sandbox.id, False)
        return signal_sandbox_process(sandbox.id, sandbox.pid_file, signal.SIGCONT) if thawed is None else thawed

    def limit_memory(self, sandbox: SandboxDir, job_bytes: int) -> int | None:
        usage = cgroups.memory_usage(sandbox.id)
        if usage is None:  # fail closed: without the cgroup, files would not count against 'memory'
            raise SandboxSetupError(f"sandbox {sandbox.id}: no memory cgroup found to limit")
        limit = usage + job_bytes + JOB_MEMORY_SLACK
        if self.memory_limit_bytes is not None:
            limit = min(limit, self.memory_limit_bytes)
        cgroups.limit_memory(sandbox.id, limit)
        return limit

    def spec(self, sandbox: SandboxDir) -> SandboxSpec:
        return SandboxSpec(
            rootfs=self.rootfs,
            executor_dir=sandbox.executor_dir,
            env=self.base_env,
            plan=self.plan,
            sources=sandbox.sources,
            unused_slot_source=sandbox.unused_slots,
            memory_limit_bytes=self.memory_limit_bytes,
            network_namespace=self.network_namespace,
        )

    def memory_usage(self, sandbox: SandboxDir) -> int | None:
        return cgroups.memory_usage(sandbox.id)

    def cpu_ns(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> int | None:
        return cgroups.cpu_usage_ns(sandbox.id)

    def memory_left(self, sandbox: SandboxDir) -> int | None:
        limit, usage = cgroups.memory_limit(sandbox.id), cgroups.memory_usage(sandbox.id)
        return None if limit is None or usage is None else max(0, limit - usage)

    def checkpoint(self, sandbox: SandboxDir, image_dir: Path, *, leave_running: bool = False) -> None:
        self.runsc.checkpoint(sandbox.id, image_dir, leave_running=leave_running)

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> None:
        try:
            self.runsc.destroy(sandbox.id, sandbox.pid_file)
        except RunscError as exc:
            # Its gofer keeps its own copy of the grants' mounts while it lives: the
            # worker's close() sweeps the state dir for such survivors.
            log.error("sandbox survived destroy", sandbox=sandbox.id, error=str(exc))


@dataclass(frozen=True)
class RunscRestore(_RunscLauncher):
    """``runsc restore`` of an image: a checkpoint's, or a hibernated session's."""

    image_path: Path | None = None
    name: str = "runsc-restore"

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> Launched:
        assert self.image_path is not None
        self.spec(sandbox).write(sandbox.path)
        args = ["restore", "--detach", f"--image-path={self.image_path}", f"--pid-file={sandbox.pid_file}", "--bundle", str(sandbox.path), sandbox.id]
        return self.runsc.start_detached(args)


@dataclass(frozen=True)
class RunscCold(_RunscLauncher):
    """A cold runsc start that still pre-imports: the executor starts in capture
    mode and is handed its serving environment at once, so the path to the
    socket is the same as after a restore."""

    name: str = "runsc-cold"

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> Launched:
        self.spec(sandbox).write(sandbox.path)
        return self.runsc.start_detached(["run", "--detach", f"--pid-file={sandbox.pid_file}", "--bundle", str(sandbox.path), sandbox.id])


@dataclass(frozen=True)
class LocalProcess:
    """No isolation whatsoever: the executor runs as a host process. Development only."""

    preimport: tuple[str, ...] = ()
    python: str = sys.executable  # the worker's own environment has readie_executor
    name: str = "local-unisolated"
    isolated: bool = False
    plan: MountPlan = MountPlan(0, 0, 0)  # grants are never mounted: the executor sees the host

    def executor_dir(self, sandbox: SandboxDir) -> str:
        return str(sandbox.executor_dir)

    def hold_mounts(self, sandbox: SandboxDir) -> int | None:
        return None  # a host process: no mounts of its own

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> Launched:
        capture_env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            **SINGLE_THREAD_ENV,
            "EXECUTOR_DIR": str(sandbox.executor_dir),
            "EXECUTOR_MODE": "capture",
            "READIE_PREIMPORT": ",".join(self.preimport),
        }
        return Launched.popen([self.python, "-u", "-m", "readie_executor"], env=capture_env, cwd=sandbox.path)

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> None:
        if process is not None:
            process.kill()
            process.wait()

    def pause(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        if process is None or process.poll() is not None:
            return False
        process.send_signal(signal.SIGSTOP)
        return True

    def resume(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        if process is None or process.poll() is not None:
            return False
        process.send_signal(signal.SIGCONT)
        return True

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        return False

    def limit_memory(self, sandbox: SandboxDir, job_bytes: int) -> int | None:
        return None  # a host process: RLIMIT_AS inside is all there is

    def memory_usage(self, sandbox: SandboxDir) -> int | None:
        return None

    def memory_left(self, sandbox: SandboxDir) -> int | None:
        return None

    def cpu_ns(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> int | None:
        if process is None:
            return None
        try:  # the executor's own (utime, stime), in clock ticks
            fields = Path(f"/proc/{process.pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) * 1_000_000_000 // os.sysconf("SC_CLK_TCK")

    def checkpoint(self, sandbox: SandboxDir, image_dir: Path, *, leave_running: bool = False) -> None:
        raise RequestError("an unisolated worker cannot hibernate or fork a session: it has no gVisor to checkpoint", "session")
