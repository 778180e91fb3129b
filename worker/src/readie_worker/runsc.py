"""runsc at arm's length: every call has a timeout, stderr goes to a file, and a
failure raises :class:`RunscError` with runsc's own words attached."""

from __future__ import annotations

import dataclasses
import json
import os
import select
import shutil
import subprocess
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from . import _reaper
from .errors import SandboxSetupError

# Flags that every runsc invocation of one checkpoint family must share: a
# restore refuses (or misbehaves) when they differ from the capture's.
DEFAULT_FLAGS = (
    "--platform=ptrace",  # KVM hangs at boot on these VMs; systrap does not exist in this runsc
    "--network=none",
    "--host-uds=create",  # lets the executor bind its socket in a bind-mounted dir
    "--overlay2=root:memory",  # a writable root per sandbox that dies with it
)
# Short commands (kill, delete, state, checkpoint) finish in well under a
# second here; the margin covers a loaded two-core machine.
COMMAND_TIMEOUT_S = 30.0
NETNS_DIR = Path("/var/run/netns")
CGROUP_V1_MEMORY = Path("/sys/fs/cgroup/memory")
CGROUP_V2 = Path("/sys/fs/cgroup")
# runsc keeps this much of its stderr in an error message.
STDERR_TAIL = 2000


class RunscError(SandboxSetupError):
    def __init__(self, args: Sequence[str], returncode: int | None, stderr: str) -> None:
        what = "timed out" if returncode is None else f"exited {returncode}"
        super().__init__(f"runsc {' '.join(args)} {what}: {stderr.strip()[-STDERR_TAIL:] or 'no output'}")
        self.returncode = returncode
        self.stderr = stderr


@dataclass(frozen=True)
class Runsc:
    """One runsc state directory (``--root``) and the flags shared by its sandboxes."""

    root: Path
    flags: tuple[str, ...] = DEFAULT_FLAGS
    binary: str = "runsc"
    # Runs runsc inside another namespace, e.g. ("nsenter", "--net=/var/run/netns/N").
    prefix: tuple[str, ...] = ()

    def command(self, *args: str) -> list[str]:
        return [*self.prefix, self.binary, f"--root={self.root}", *self.flags, *args]

    def with_network(self, namespace: str) -> Runsc:
        """Host networking, but inside ``namespace``: the sandbox sees that namespace's interfaces only.

        ``ip netns exec`` would remount /sys, after which runsc cannot find the
        memory cgroup (notes), so the namespace is entered with nsenter.
        """
        flags = tuple("--network=host" if flag.startswith("--network") else flag for flag in self.flags)
        return dataclasses.replace(self, flags=flags, prefix=("nsenter", f"--net={NETNS_DIR / namespace}"))

    def run(self, *args: str, timeout: float = COMMAND_TIMEOUT_S, reaping: bool = False) -> str:
        """Run a short runsc command and return its stdout."""
        self.root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile("w+") as stderr:
            try:
                completed = _reaper.run(self.command(*args), stderr=stderr, timeout=timeout, reaping=reaping)
            except subprocess.TimeoutExpired:
                raise RunscError(args, None, _read(stderr)) from None
            if completed.returncode != 0:
                raise RunscError(args, completed.returncode, _read(stderr))
            return completed.stdout

    def start_detached(
        self, args: Sequence[str], stderr_path: Path, timeout: float = COMMAND_TIMEOUT_S
    ) -> subprocess.Popen[bytes]:
        """Start ``run --detach`` or ``restore --detach`` with pipes on the container's stdio.

        A detached runsc leaves a grandchild holding its stdio, so stderr goes
        to a file (a pipe would never see EOF); stdin and stdout stay pipes,
        which is how the executor is handed its settings and announces itself.
        The returned process has exited when this returns.
        """
        self.root.mkdir(parents=True, exist_ok=True)
        with open(stderr_path, "ab") as stderr:
            process = _reaper.popen(
                self.command(*args), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr
            )
        try:
            returncode = process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            _close(process)
            raise RunscError(args, None, _tail(stderr_path)) from None
        if returncode != 0:
            _close(process)
            raise RunscError(args, returncode, _tail(stderr_path))
        return process

    def state(self, container_id: str) -> dict[str, object]:
        return json.loads(self.run("state", container_id))

    def list_ids(self) -> list[str]:
        if not self.root.exists():
            return []
        lines = self.run("list", "--quiet").split()
        return [line for line in lines if line]

    def destroy(self, container_id: str) -> None:
        """Kill and delete a container, quickly and without raising for one already gone."""
        try:
            self.run("kill", container_id, "KILL", reaping=True)
        except RunscError:
            pass  # already stopped, or never started
        try:
            self.run("delete", "--force", container_id, reaping=True)
        except RunscError:
            if container_id in self.list_ids():
                raise

    def oom_killed(self, container_id: str) -> bool:
        """Whether the kernel's OOM killer struck the container's memory cgroup (the backstop).

        runsc names the cgroup after the container; read it before ``delete`` removes it.
        """
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

    def sweep(self) -> list[str]:
        """Destroy every container in this state dir and remove what runsc left behind.

        A worker owns its state dir alone, so anything found here at start-up
        belongs to an earlier run of the same worker that did not shut down.
        """
        swept = []
        for container_id in self.list_ids():
            self.destroy(container_id)
            swept.append(container_id)
        if self.root.exists():
            for leftover in self.root.iterdir():
                if leftover.is_dir():
                    shutil.rmtree(leftover, ignore_errors=True)
                else:
                    leftover.unlink(missing_ok=True)
        return swept


def version(binary: str = "runsc") -> str:
    """``runsc --version`` first line, e.g. ``runsc version 0.0~20221219.0``."""
    try:
        completed = subprocess.run(
            [binary, "--version"], capture_output=True, text=True, timeout=COMMAND_TIMEOUT_S
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SandboxSetupError(f"cannot run {binary}: {exc}") from None
    if completed.returncode != 0:
        raise RunscError(["version"], completed.returncode, completed.stderr)
    return completed.stdout.splitlines()[0].strip()


def available(binary: str = "runsc") -> bool:
    return shutil.which(binary) is not None and os.geteuid() == 0


def wait_for_line(stream: IO[bytes], prefix: bytes, timeout: float, limit: int = 1 << 20) -> bytes:
    """Read lines from a container's stdout pipe until one starts with ``prefix``."""
    deadline = time.monotonic() + timeout
    fd = stream.fileno()
    buffer = bytearray()
    while True:
        newline = buffer.find(b"\n")
        while newline >= 0:
            line = bytes(buffer[: newline + 1])
            del buffer[: newline + 1]
            if line.startswith(prefix):
                return line[len(prefix) :]
            newline = buffer.find(b"\n")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise SandboxSetupError(f"no {prefix.decode().strip()!r} line within {timeout:.0f} s")
        ready, _, _ = select.select([fd], [], [], remaining)
        if not ready:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise SandboxSetupError(f"container stdout closed before a {prefix.decode().strip()!r} line")
        buffer += chunk
        if len(buffer) > limit:
            raise SandboxSetupError(f"container printed over {limit} bytes without a newline")


def _read(stream: IO[str]) -> str:
    stream.seek(0)
    return stream.read()


def _tail(path: Path) -> str:
    try:
        with open(path, "rb") as file:
            file.seek(0, os.SEEK_END)
            file.seek(max(0, file.tell() - STDERR_TAIL))
            return file.read().decode("utf-8", "replace")
    except OSError:
        return ""


def _close(process: subprocess.Popen[bytes]) -> None:
    for stream in (process.stdin, process.stdout):
        if stream is not None:
            stream.close()
