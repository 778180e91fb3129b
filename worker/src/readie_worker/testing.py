"""Helpers for tests (ours and yours) of the worker without its gRPC edge: waiting, ports,
the ``readie`` command, a state dir's runsc, a fake host, a raw executor socket, and
:class:`FaultyLauncher`, a launcher that fails on demand. Real ``readie worker`` processes and clusters are
``readie_rpc.testing``'s."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from readie_policy.testing import free_port, readie_command  # noqa: F401  (named here too: tests import them from here)

from ._host_frames import HostCall, HostReply
from ._sandbox_dir import SandboxDir
from .cgroups import CGROUP_V1_FREEZER, CGROUP_V2
from .bundle import MountPlan
from .errors import SandboxSetupError
from .launchers import Launcher, LocalProcess
from .runsc import Launched, Runsc
from .state_dir import RUNSC

#: Debian 12's own runsc (0.0~20221219, ptrace, compressed images), kept beside
#: the default one by scripts/install-runsc.sh (OLD_BINARY there) for the
#: tests and the bench's comparison arm.
DEBIAN_12_RUNSC = Path("/usr/local/lib/readie/runsc-0.0~20221219.0/runsc")


def wait_until(condition: Callable[[], bool], timeout: float, poll_s: float = 0.01) -> bool:
    """Whether ``condition()`` came true within ``timeout`` seconds (polled every ``poll_s``)."""
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(poll_s)
    return True


def runsc_in(state_dir: Path) -> Runsc:
    """The runsc of the worker (or pool) whose ``--state-dir`` is ``state_dir``: to list or
    sweep its containers (none once it removed its state dir)."""
    return Runsc(root=state_dir / RUNSC)


class FakeHost:
    """Host functions for tests: Python callables that answer a job's calls, every call recorded.

    ::

        host = FakeHost(search=lambda query, limit=10: ["first hit", "second hit"][:limit])
        job = CodeJob(checkpoint="base", code=..., functions=host.names)
        outcome = run_in_sandbox(sandbox, job, (), host=host)
        assert host.calls[0].args == ("readie",)

    A callable's exception becomes an error reply with its text, as a pool
    client does; a name with no callable gets an error reply too.
    """

    def __init__(self, **functions: Callable[..., Any]) -> None:
        self.functions = functions
        self.calls: list[HostCall] = []

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(self.functions)

    def __call__(self, call: HostCall) -> HostReply:
        self.calls.append(call)
        function = self.functions.get(call.function)
        if function is None:
            return HostReply(error=f"no host function named {call.function}")
        try:
            return HostReply(result=function(*call.args, **call.kwargs))
        except Exception as exc:
            return HostReply(error=str(exc))

# Code a test runs INSIDE a sandbox to play a hostile job: it finds the
# executor's connected socket and can write framing-v2 frames by hand
# (send/receive/ask), as the host-function adversarial tests do.
CHANNEL_FORGER = r'''
import json, os, socket, struct

def channel():
    for name in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{name}")
        except OSError:
            continue
        if not target.startswith("socket:"):
            continue
        sock = socket.socket(fileno=os.dup(int(name)))
        try:
            sock.getpeername()  # the listener has no peer (gVisor says SO_ACCEPTCONN 0 for it too)
            return sock
        except OSError:
            sock.close()
    raise SystemExit("no connected socket found")

def send(sock, payload):
    sock.sendall(struct.pack(">Q", len(payload)) + payload + bytes(8))

def read_exact(sock, count):
    data = b""
    while len(data) < count:
        more = sock.recv(count - len(data))
        if not more:
            raise EOFError
        data += more
    return data

def receive(sock):
    chunks = []
    while True:
        (length,) = struct.unpack(">Q", read_exact(sock, 8))
        if length == 0:
            return b"".join(chunks)
        chunks.append(read_exact(sock, length))

def ask(sock, payload):
    send(sock, payload)
    return json.loads(receive(sock))["reply"]

sock = channel()
'''

@dataclass
class FaultyLauncher:
    """A launcher (``launchers.Launcher``) that fails its next ``fail_starts`` starts, else passes
    them to ``inner``: by default a plain host executor (:class:`LocalProcess`), so the worker's
    lifecycle (fallback, warm sandboxes, refills) runs for real, fast and without gVisor.

    ``starts`` and ``destroys`` count calls; a failed start still gets its destroy, as a real
    one that died part-way does.
    """

    inner: Launcher = field(default_factory=LocalProcess)
    fail_starts: int = 0
    fail_resumes: int = 0  # resumes that fail (the paused process stays stopped)
    starts: int = 0
    destroys: int = 0

    @property
    def name(self) -> str:
        return f"faulty-{self.inner.name}"

    @property
    def isolated(self) -> bool:
        return self.inner.isolated

    @property
    def plan(self) -> MountPlan:
        return self.inner.plan

    def start(self, sandbox: SandboxDir, env: Mapping[str, str]) -> Launched:
        self.starts += 1
        if self.fail_starts > 0:
            self.fail_starts -= 1
            raise SandboxSetupError(f"sandbox {sandbox.id}: start failed as the test asked")
        return self.inner.start(sandbox, env)

    def executor_dir(self, sandbox: SandboxDir) -> str:
        return self.inner.executor_dir(sandbox)

    def hold_mounts(self, sandbox: SandboxDir) -> int | None:
        return self.inner.hold_mounts(sandbox)

    def destroy(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> None:
        self.destroys += 1
        self.inner.destroy(sandbox, process)

    def oom_killed(self, sandbox: SandboxDir) -> bool:
        return self.inner.oom_killed(sandbox)

    def pause(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        return self.inner.pause(sandbox, process)

    def resume(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> bool:
        if self.fail_resumes > 0:
            self.fail_resumes -= 1
            return False
        return self.inner.resume(sandbox, process)

    def limit_memory(self, sandbox: SandboxDir, job_bytes: int) -> int | None:
        return self.inner.limit_memory(sandbox, job_bytes)

    def memory_left(self, sandbox: SandboxDir) -> int | None:
        return self.inner.memory_left(sandbox)

    def cpu_ns(self, sandbox: SandboxDir, process: subprocess.Popen[bytes] | None) -> int | None:
        return self.inner.cpu_ns(sandbox, process)


def scrape(port: int, timeout: float = 5.0) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """The samples ``/metrics`` on 127.0.0.1:``port`` serves, keyed by name and labels."""
    from urllib.request import urlopen

    from prometheus_client.parser import text_string_to_metric_families

    with urlopen(f"http://127.0.0.1:{port}/metrics", timeout=timeout) as response:  # noqa: S310 - our own loopback
        text = response.read().decode()
    return {
        (sample.name, frozenset(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
    }


@contextlib.contextmanager
def idle_connections(port: int, count: int) -> Iterator[list[socket.socket]]:
    """``count`` TCP connections to 127.0.0.1:``port`` that never send a byte, closed on exit."""
    held: list[socket.socket] = []
    try:
        for _ in range(count):
            held.append(socket.create_connection(("127.0.0.1", port), timeout=5))
            held[-1].settimeout(None)  # so that closed_by_peer's MSG_DONTWAIT is not waited out
        yield held
    finally:
        for connection in held:
            connection.close()


def closed_by_peer(connection: socket.socket) -> bool:
    """Whether the other end has closed ``connection`` (a blocking socket; without waiting)."""
    try:
        return connection.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except ConnectionError:
        return True


def thread_count(pid: int) -> int:
    """The threads process ``pid`` has now."""
    return len(os.listdir(f"/proc/{pid}/task"))


def _proc_stat(pid: int) -> list[str]:
    """Process ``pid``'s /proc stat fields after its command name (which may hold spaces)."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def stopped(pid: int) -> bool:
    """Whether process ``pid`` is paused: frozen with its cgroup (a paused sandbox's sentry), or
    stopped by SIGSTOP (a paused host process; a sentry where no freezer cgroup exists)."""
    if _proc_stat(pid)[0] == "T":
        return True
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        try:
            if controllers == "freezer":
                return (CGROUP_V1_FREEZER / path.lstrip("/") / "freezer.state").read_text().strip() == "FROZEN"
            if controllers == "" and "frozen 1" in (CGROUP_V2 / path.lstrip("/") / "cgroup.events").read_text():
                return True
        except OSError:
            continue
    return False


def cpu_ticks(pid: int) -> int:
    """The clock ticks process ``pid`` has run, user and system."""
    fields = _proc_stat(pid)
    return int(fields[11]) + int(fields[12])


def sample(samples: Mapping[tuple[str, frozenset[tuple[str, str]]], float], name: str, **labels: str) -> float:
    """One sample's value from :func:`scrape`'s answer (0 when absent: a labelled counter not yet moved)."""
    return samples.get((name, frozenset(labels.items())), 0.0)
