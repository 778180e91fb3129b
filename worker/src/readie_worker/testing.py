"""Helpers for tests (ours and yours): real ``readie worker`` processes on loopback, a fake host."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ._host_frames import HostCall, HostReply
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc

# Start-up is a manifest check and a sweep; pools fill in the background.
STARTUP_TIMEOUT_S = 30.0
# A drain with nothing running takes well under a second; the rest is margin.
EXIT_TIMEOUT_S = 30.0
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    port: int
    state_dir: Path
    log_path: Path
    channel: grpc.Channel

    @property
    def stub(self) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self.channel)

    @property
    def health(self) -> health_pb2_grpc.HealthStub:
        return health_pb2_grpc.HealthStub(self.channel)

    def health_status(self, service: str = "") -> int:
        return self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5).status

    def log_lines(self) -> list[dict]:
        return [json.loads(line) for line in self.log_path.read_text().splitlines() if line.startswith("{")]

    def containers(self) -> list[str]:
        listed = subprocess.run(
            ["runsc", f"--root={self.state_dir}", "list", "--quiet"], capture_output=True, text=True, timeout=30, check=True
        )
        return listed.stdout.split()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def readie_command() -> list[str]:
    entry_point = Path(sys.executable).with_name("readie")
    if entry_point.exists():
        return [str(entry_point)]
    return [sys.executable, "-c", "import sys; from readie._cli import main; sys.exit(main())"]


def start_worker(base: Path, name: str, manifest: Path, warm: str = "base=1", slots: int = 2) -> WorkerProcess:
    port = free_port()
    base.mkdir(parents=True, exist_ok=True)
    state_dir, run_dir, log_path = base / "state", base / "run", base / "worker.log"
    command = [
        *readie_command(),
        "worker",
        f"--listen=127.0.0.1:{port}",
        f"--manifest={manifest}",
        f"--state-dir={state_dir}",
        f"--run-dir={run_dir}",
        f"--warm={warm}",
        f"--slots={slots}",
        f"--name={name}",
        "--drain-grace=20",
        "--log=json",
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    worker = WorkerProcess(process, port, state_dir, log_path, grpc.insecure_channel(f"127.0.0.1:{port}"))
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise AssertionError(f"worker exited {process.returncode} at start:\n{log_path.read_text()}")
        try:
            if worker.health_status() == SERVING:
                return worker
        except grpc.RpcError:
            pass
        if time.monotonic() > deadline:
            process.kill()
            raise AssertionError(f"worker not serving after {STARTUP_TIMEOUT_S} s:\n{log_path.read_text()}")
        time.sleep(0.1)


def stop_worker(worker: WorkerProcess) -> int:
    if worker.process.poll() is None:
        worker.process.send_signal(signal.SIGTERM)
    try:
        return worker.process.wait(EXIT_TIMEOUT_S)
    finally:
        worker.channel.close()
        if worker.process.poll() is None:
            worker.process.kill()




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
