"""docker-compose.yml's exact command lines, run as processes on loopback (no Docker engine runs here).

`docker-compose config` resolves the file (with the documented overrides below); for each service
the test runs its image's ENTRYPOINT with the service's ``command:`` and ``environment:``, starts
the services in ``depends_on`` order, waits for each image's own HEALTHCHECK command to pass, runs a
call and a Pool.Session through the router with the real client, then stops everything with
SIGTERM (the images' STOPSIGNAL) and checks each exits 0 within its ``stop_grace_period`` and no
runsc sandbox is left. Only what Compose and Docker themselves provide is replaced, each stand-in
derived from the parsed file or the Dockerfile (client/tests/_compose_model.py):

- The documented overrides, as an operator sets them: ``READIE_CHECKPOINTS_DIR`` (the checkpoints
  the other gVisor tests use), ``READIE_ROOTFS_DIR`` (the manifest's ``"rootfs"`` without its last
  two components, as docs/deploy.md says), ``READIE_TOKEN_FILE`` (a token file the test writes),
  ``READIE_SESSION_KEY_FILE`` (a session-store key the test writes) and ``READIE_ROUTER_PORT`` (a free
  port).
- ``volumes:``: a path under a bind mount's container path is the same path under its host source
  (the checkpoints dir; the rootfs, mounted at its own path, is unchanged); a named volume
  (``packages``, ``sessions``) is a fresh directory of the test's, shared by every service that mounts it.
  ``:ro`` is not enforced (the processes run as root on the host's filesystem).
- ``secrets:``: ``/run/secrets/<target>`` is the secret's ``file:``.
- The network: each service name (``worker-1``, ``worker-2``) is a loopback address 127.0.0.x of its
  own, the port unchanged, as Compose's DNS answers it; ``--listen=0.0.0.0:P`` is the service's own
  address with port P, except a port in ``ports:``, which listens where Compose publishes it on the
  host (the router's ``127.0.0.1:$READIE_ROUTER_PORT``), the address the client dials.
- The image: the ENTRYPOINT and the HEALTHCHECK's files are this checkout's, by the Dockerfile's
  COPY lines and its ``UV_PROJECT_ENVIRONMENT`` (the venv ``uv sync`` makes is this one); the
  HEALTHCHECK's ``127.0.0.1:P`` (the container's loopback) is where the service listens for P.
- The container's own filesystem: the working directory (WORKDIR, which holds no build/) and HOME
  are empty directories of the service's, and ``READIE_RUNTIME_DIR`` points the readie runtime dir
  (where each worker makes its state dir) into a /tmp of its own; nothing else of the test's environment is passed on
  (PATH aside), so no ``READIE_CHECKPOINTS`` or ``./build/checkpoints`` is found by accident.
- HEALTHCHECK: the command as the image gives it, run with its ``--timeout``, but every 0.5 s rather
  than every ``--interval``, and waited for at most ``--start-period`` plus ``--retries`` intervals.

A flag or environment value naming a container path no volume, secret or image file provides fails
the test (:class:`ComposeBug`): in a container it would not exist. So does a rootfs (named by the
manifest, not a flag) that no worker volume mounts at its own path. Not emulated: ``restart:`` (a
process that exits fails the test instead), ``init:`` (the signal goes straight to the process, as
tini forwards it), ``privileged:`` (the test runs as root), ``expose:`` and the container's own
network namespace (``--egress-netns`` and ``--egress-own-netns`` are left out: on the host they
would name the host's own).

The router's checkpoints (it reads only manifest.json, for Pool.Session) are checked three more
ways, by its own command line with the file edited after parsing, without runsc: without the
volume the --checkpoints flag is such a bug; without both it serves without Pool.Session and says
so; with the volume's host dir empty (what Docker mounts when the host never captured) it exits 2
naming the missing manifest.
"""

from __future__ import annotations

import json
import os
import queue
import secrets as token_bytes
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

import readie
from client.tests._compose_model import ComposeBug, Deployment, Service, compose_config, lookup, plan
from conftest import CHECKPOINTS
from readie_rpc.security import ClientSecurity
from readie_rpc.stubs import pool_pb2, pool_pb2_grpc, worker_pb2 as pb, worker_pb2_grpc as pb_grpc
from readie_worker.runsc import Runsc
from readie_worker.state_dir import RUNSC
from readie_worker.testing import free_port, wait_until

# How often the test runs a HEALTHCHECK: faster than the images' --interval, to keep the test short.
HEALTH_POLL_S = 0.5
# A call restores a warm sandbox and runs one line; the rest is margin on a loaded 2-core host.
CALL_TIMEOUT_S = 60
# How long a stopped process's leftovers (a sandbox being torn down) may take to go.
LEFTOVER_WAIT_S = 10


@pytest.fixture
def base() -> Iterator[Path]:
    """Short (sandbox socket paths under the runtime dirs are bounded by 107 bytes) and ours."""
    path = Path(tempfile.mkdtemp(prefix="rcp-", dir="/tmp"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def overrides(base: Path, checkpoints: Path = CHECKPOINTS) -> dict[str, str]:
    """The documented variables of docker-compose.yml, set as an operator would."""
    token = base / "readie-token"
    token.write_text(token_bytes.token_urlsafe(32) + "\n")
    token.chmod(0o600)
    session_key = base / "readie-session-key"
    session_key.write_bytes(os.urandom(32))
    session_key.chmod(0o600)
    chosen = {
        "READIE_CHECKPOINTS_DIR": str(checkpoints),
        "READIE_TOKEN_FILE": str(token),
        "READIE_SESSION_KEY_FILE": str(session_key),
        "READIE_ROUTER_PORT": str(free_port()),
    }
    manifest = checkpoints / "manifest.json"
    if manifest.is_file():  # else the file's default: nothing restores without checkpoints anyway
        rootfs = Path(json.loads(manifest.read_text())["rootfs"])
        chosen["READIE_ROOTFS_DIR"] = str(rootfs.parent.parent)  # <dir>/<fingerprint>/rootfs
    return chosen


def config_or_skip(environ: dict[str, str]) -> dict:
    try:
        return compose_config(environ)
    except FileNotFoundError as missing:
        if os.environ.get("CI"):
            pytest.fail(str(missing))
        pytest.skip(str(missing))


class Running:
    """The deployment's processes, each logging to ``<base>/<service>.log``."""

    def __init__(self, deployment: Deployment, base: Path) -> None:
        self.deployment, self.base = deployment, base
        self.processes: dict[str, subprocess.Popen[bytes]] = {}

    def start(self, name: str) -> None:
        service = self.deployment.services[name]
        with open(self.log_path(name), "wb") as log:
            self.processes[name] = subprocess.Popen(
                service.argv, env=service.env, cwd=service.cwd,
                stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
            )

    def log_path(self, name: str) -> Path:
        return self.base / f"{name}.log"

    def log(self, name: str) -> str:
        return self.log_path(name).read_text(errors="replace")[-4000:]

    def healthy(self, name: str) -> bool:
        """The image's HEALTHCHECK, once: exit 0 within its --timeout."""
        check = self.deployment.services[name].healthcheck
        try:
            return subprocess.run(list(check.command), capture_output=True, timeout=check.timeout_s).returncode == 0
        except subprocess.TimeoutExpired:
            return False

    def wait_healthy(self, names: list[str]) -> None:
        """Docker's rule, polled faster: healthy at the first pass; unhealthy once start-period plus
        retries intervals have gone by without one (or when the process exits)."""
        started = time.monotonic()
        waiting = set(names)
        while waiting:
            for name in sorted(waiting):
                process, check = self.processes[name], self.deployment.services[name].healthcheck
                if process.poll() is not None:
                    pytest.fail(f"{name} exited {process.returncode} before it was healthy:\n{self.log(name)}")
                if self.healthy(name):
                    waiting.discard(name)
                elif time.monotonic() - started > check.start_period_s + check.retries * check.interval_s:
                    pytest.fail(f"{name} is unhealthy: {check.command}\n{self.log(name)}")
            time.sleep(HEALTH_POLL_S if waiting else 0)

    def start_in_order(self) -> None:
        """Services whose ``depends_on: condition: service_healthy`` holds start together, as Compose does."""
        pending = dict(self.deployment.services)
        while pending:
            ready = [name for name, s in pending.items() if all(dep in self.processes for dep in s.depends_on_healthy)]
            assert ready, f"depends_on cycle among {sorted(pending)}"
            for name in ready:
                self.start(name)
                del pending[name]
            self.wait_healthy(ready)

    def terminate(self, name: str) -> None:
        """SIGTERM, once, as Docker sends it (a second one could land in the interpreter's exit,
        after Python gave the signal back its default action)."""
        if self.processes[name].poll() is None:
            self.processes[name].send_signal(signal.SIGTERM)

    def wait(self, name: str) -> int | None:
        """The exit status within stop_grace_period (None: Docker would SIGKILL it now)."""
        try:
            return self.processes[name].wait(self.deployment.services[name].stop_grace_s)
        except subprocess.TimeoutExpired:
            return None

    def stop(self, name: str) -> int | None:
        self.terminate(name)
        return self.wait(name)

    def stop_in_order(self) -> dict[str, int | None]:
        """Dependents first (the router), then the rest together, as `docker-compose stop` does."""
        dependents = [n for n, s in self.deployment.services.items() if s.depends_on_healthy and n in self.processes]
        statuses = {name: self.stop(name) for name in dependents}
        rest = [n for n in self.processes if n not in dependents]
        for name in rest:
            self.terminate(name)
        statuses.update({name: self.wait(name) for name in rest})
        return statuses

    def kill_all(self) -> None:
        for process in self.processes.values():
            if process.poll() is None:
                process.kill()
                process.wait(10)


def runsc_processes(service: Service) -> list[str]:
    """runsc processes (sandbox, gofer, the CLI) of ``service``: they name its state dir, under its runtime dir."""
    found = subprocess.run(["pgrep", "-fa", f"runsc.*{service.runtime_dir}"], capture_output=True, text=True, check=False)
    return found.stdout.splitlines()


def runsc_roots(service: Service) -> list[Path]:
    """Its workers' runsc roots: in each state dir under its runtime dir (readie_worker.state_dir)."""
    return sorted(service.runtime_dir.glob(f"*/{RUNSC}"))


def containers(runsc_root: Path) -> list[str]:
    listed = subprocess.run(
        ["runsc", f"--root={runsc_root}", "list", "--quiet"], capture_output=True, text=True, timeout=30, check=False
    )
    return listed.stdout.split() if listed.returncode == 0 else []


def sweep(services: list[Service]) -> None:
    """After a failure: what a crashed worker left, removed as `readie` sweeps its own."""
    for service in services:
        for root in runsc_roots(service):
            Runsc(root=root).sweep()


def pool_session(address: str, token_file: Path, code: str) -> tuple[dict, dict]:
    """One job through the router's Pool.Session: (the ready event, the job's result)."""
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    with ClientSecurity.from_files(token_file=token_file).channel(address) as channel:
        stream = pool_pb2_grpc.PoolStub(channel).Session(iter(inbox.get, None), timeout=CALL_TIMEOUT_S)
        inbox.put(pool_pb2.PoolInput(data=(json.dumps({"id": "c1", "code": code}) + "\n").encode()))
        ready, result = (json.loads(next(stream).line) for _ in range(2))
        inbox.put(None)
        assert list(stream) == []
    return ready, result


def capacity(address: str, token_file: Path) -> pb.CapacityResponse:
    with ClientSecurity.from_files(token_file=token_file).channel(address) as channel:
        return pb_grpc.WorkerStub(channel).Capacity(pb.CapacityRequest(), timeout=CALL_TIMEOUT_S)


@pytest.mark.runsc
def test_the_compose_command_lines_run_as_processes_serve_a_call_through_the_router_and_stop_cleanly(base):
    deployment = plan(config_or_skip(overrides(base)), base)
    assert sorted(deployment.services) == ["router", "worker-1", "worker-2"]
    workers = [s for s in deployment.services.values() if not s.depends_on_healthy]
    # The manifest names the rootfs by its absolute path, beside any flag: a volume must put it there.
    rootfs = json.loads((CHECKPOINTS / "manifest.json").read_text())["rootfs"]
    assert all(lookup(s.mounts, rootfs) == Path(rootfs) for s in workers), "the rootfs is not mounted at its path"
    router_address = deployment.published_address("router")
    token_file = deployment.secrets["readie_token"]
    running = Running(deployment, base)
    try:
        running.start_in_order()
        assert all(running.healthy(name) for name in deployment.services), "all three healthy at once"
        # Each worker's sandboxes live in its own runsc state dir (warm ones fill in the background).
        assert all(wait_until(lambda s=s: any(containers(d) for d in runsc_roots(s)), 30, 0.2) for s in workers)
        assert all(runsc_processes(s) for s in workers), "the leftover check below sees running sandboxes"

        # The router placed on every worker its command names: their slots are its.
        slots = [capacity(s.listens[port], token_file).slots for s in workers for port in s.listens]
        assert capacity(router_address, token_file).slots == sum(slots), slots

        with readie.Client(router_address, token_file=token_file, echo_output=False, timeout=CALL_TIMEOUT_S) as client:
            assert client.call(sum, [1, 2, 39]) == 42
            # It ran in a gVisor sandbox on a worker, not here: the sandbox's kernel is gVisor's.
            assert client.call(lambda: open("/proc/version").read()).startswith("Linux version 4.4.0")
        ready, result = pool_session(router_address, token_file, "print('through Pool.Session')")
        assert ready["event"] == "ready" and ready["preloaded_modules"] == [], ready
        assert (result["exit"], result["stdout"]) == (0, "through Pool.Session\n"), result
        assert result["policy"]["backend"] == "gvisor:runsc-restore", result

        states = {s.name: runsc_roots(s) for s in workers}
        statuses = running.stop_in_order()
        assert statuses == {name: 0 for name in deployment.services}, {n: running.log(n) for n in deployment.services}
        for service in workers:
            assert wait_until(lambda s=service: not runsc_processes(s), LEFTOVER_WAIT_S, 0.2), runsc_processes(service)
            assert [d for d in states[service.name] if containers(d)] == [], f"{service.name} left sandboxes"
    finally:
        running.kill_all()
        sweep(workers)


def test_a_flag_naming_a_path_no_volume_provides_is_a_compose_bug(base):
    """The router's --checkpoints without the checkpoints volume: in a container the dir would not exist."""
    config = config_or_skip(overrides(base))
    del config["services"]["router"]["volumes"]
    with pytest.raises(ComposeBug, match=r"router: --checkpoints=/srv/readie/checkpoints names /srv/readie/checkpoints"):
        plan(config, base)


def start_router(base: Path, config: dict) -> tuple[Running, Deployment]:
    deployment = plan(config, base)
    running = Running(deployment, base)
    running.start("router")
    return running, deployment


def test_the_router_serves_without_pool_session_when_it_is_given_no_checkpoints(base):
    """The router only routes when neither the volume nor --checkpoints is there: a warning, health
    served (NOT_SERVING here, with no worker up), Pool.Session UNIMPLEMENTED, SIGTERM exits 0."""
    config = config_or_skip(overrides(base))
    router = config["services"]["router"]
    del router["volumes"]
    router["command"] = [arg for arg in router["command"] if not arg.startswith("--checkpoints")]
    running, deployment = start_router(base, config)
    try:
        assert wait_until(lambda: "router serving" in running.log_path("router").read_text(), 30, 0.1), running.log("router")
        assert "no checkpoints: serving without Pool.Session" in running.log("router")
        address, token = deployment.published_address("router"), deployment.secrets["readie_token"]
        with pytest.raises(grpc.RpcError) as refused:
            pool_session(address, token, "pass")
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        assert running.stop("router") == 0, running.log("router")
    finally:
        running.kill_all()


def test_the_router_refuses_to_start_when_its_checkpoints_volume_is_empty(base):
    """What the issue saw: no checkpoints on the host, so Docker mounts an empty dir; exit 2, saying where."""
    empty = base / "no-checkpoints"
    empty.mkdir()
    config = config_or_skip(overrides(base, checkpoints=empty))
    running, _ = start_router(base, config)
    try:
        assert running.processes["router"].wait(30) == 2
        assert f"no checkpoint manifest at {empty}/manifest.json" in running.log("router")
    finally:
        running.kill_all()
