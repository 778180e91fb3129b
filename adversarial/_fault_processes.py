"""The processes the fault suite aims at (docs/faults.md): finding a running job's sandbox and
its gofer, which router a client is connected to, starting a killed process again as a
supervisor would, and a second router in front of a cluster's workers."""

from __future__ import annotations

import os
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from readie_policy.testing import free_port
from readie_protocol.errors import ReadieError
from readie_rpc.client import WorkerClient
from readie_rpc.testing import Cluster
from readie_worker.testing import wait_until

# How long a (re)started router may take to serve (a manifest check and a listen).
ROUTER_START_S = 30.0


def processes() -> list[tuple[int, list[str]]]:
    """Every process's pid and argv (those that vanish while read are left out)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                argv = [part.decode(errors="replace") for part in cmdline.read().split(b"\0") if part]
        except OSError:
            continue
        if argv:
            found.append((int(entry), argv))
    return found


def runsc_processes(container_id: str, program: str | None = None) -> list[int]:
    """The pids of the runsc processes naming ``container_id`` (``program``: only argv[0] that)."""
    return [
        pid
        for pid, argv in processes()
        if argv[0].startswith("runsc") and container_id in " ".join(argv) and (program is None or argv[0] == program)
    ]


def peer_ports(pid: int) -> set[int]:
    """The remote ports of the process's established TCP connections (IPv4, and IPv6 where gRPC
    dials 127.0.0.1 as a v4-mapped address): which router a client is talking to (a fault aimed
    at a router nobody uses would test nothing)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    ports = set()
    for family in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{family}") as table:
            for line in table.readlines()[1:]:
                fields = line.split()
                established = fields[3] == "01"
                if established and fields[9] in inodes:
                    ports.add(int(fields[2].rsplit(":", 1)[1], 16))
    return ports


def containers(runsc_root: Path) -> list[str]:
    listed = subprocess.run(["runsc", f"--root={runsc_root}", "list", "--quiet"], capture_output=True, text=True, timeout=30)
    return listed.stdout.split()


def kill_all(pids: list[int], signum: int = signal.SIGKILL) -> int:
    sent = 0
    for pid in pids:
        try:
            os.kill(pid, signum)
            sent += 1
        except ProcessLookupError:
            pass
    return sent


def argv_of(process: subprocess.Popen[bytes]) -> list[str]:
    """A running process's command line, to start it again the same way (same port, same dirs)."""
    with open(f"/proc/{process.pid}/cmdline", "rb") as cmdline:
        return [part.decode() for part in cmdline.read().split(b"\0") if part]


def relaunch(argv: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    """Start ``argv`` again (as a supervisor would), appending to its log."""
    with open(log_path, "ab") as log:
        return subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)


def serves_beneath(container_id: str, directory: Path) -> bool:
    """Whether the container's gofer or sentry holds ``directory`` open: its job uses a grant
    there (a warm spare mounts none until a job takes it). A grant mounted before the sandbox
    started is opened by the gofer; one mounted after, beneath its slot (decision 34), by the
    sentry when the job first reaches it. Compared by device and inode, since both see the
    grant through a bind mount at a path of the worker's own."""
    wanted = os.stat(directory)
    for pid, argv in processes():
        if argv[0] in ("runsc-gofer", "runsc-sandbox") and container_id in " ".join(argv):
            try:
                fds = os.listdir(f"/proc/{pid}/fd")
            except OSError:
                continue
            for fd in fds:
                try:
                    held = os.stat(f"/proc/{pid}/fd/{fd}")
                except OSError:
                    continue
                if (held.st_dev, held.st_ino) == (wanted.st_dev, wanted.st_ino):
                    return True
    return False


@dataclass
class Router:
    """One of the two routers in front of the workers, restarted on its own port when killed."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def serving(self) -> bool:
        with grpc.insecure_channel(self.address) as channel:
            try:
                status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
            except grpc.RpcError:
                return False
        return status == health_pb2.HealthCheckResponse.SERVING

    def placing_on(self) -> int:
        """The job slots of the workers this router places on now (0 if it does not answer)."""
        client = WorkerClient(self.address)
        try:
            return client.capacity(2.0)[0].slots
        except ReadieError:
            return 0
        finally:
            client.close()


def second_router(base: Path, cluster: Cluster) -> Router:
    """Another router in front of the same workers: the first's command line on a port of its own."""
    port = free_port()
    argv = [f"--listen=127.0.0.1:{port}" if arg.startswith("--listen=") else arg for arg in argv_of(cluster.router)]
    router = Router("router-b", relaunch(argv, base / "router-b.log"), port, base / "router-b.log")
    assert wait_until(router.serving, ROUTER_START_S, 0.1), f"router-b not serving:\n{router.log_path.read_text()[-3000:]}"
    return router


def store_entries(store: Path) -> list[str]:
    """The sessions the store holds: its entries are named by a SHA-256 (decision 32)."""
    return [p.name for p in store.iterdir() if len(p.name) == 64 and all(c in "0123456789abcdef" for c in p.name)]


def holds_image(entry: Path) -> bool:
    """Whether a store entry holds anything but its lease (a generation, one being written, ...)."""
    try:
        return any(p.name != "lease" and not p.name.startswith(".lease-") for p in entry.iterdir())
    except FileNotFoundError:  # removed meanwhile
        return False
