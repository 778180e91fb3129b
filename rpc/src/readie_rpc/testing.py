"""Helpers for tests (ours and yours) over gRPC: real ``readie worker`` processes on loopback,
a ``readie router`` in front of some (:func:`start_cluster`), a ceiling for them, and a test
PKI for TLS."""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from readie_policy.testing import free_port, readie_command

from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from .security import ClientSecurity

# Start-up is a manifest check and a sweep; pools fill in the background.
STARTUP_TIMEOUT_S = 30.0

# A drain with nothing running takes well under a second; the rest is margin.
EXIT_TIMEOUT_S = 30.0

# Where a worker's runsc keeps its containers, beneath its --state-dir (readie_worker.state_dir.RUNSC).
RUNSC_DIR = "runsc"
# runsc list and delete answer in well under a second; past this the machine is wedged.
RUNSC_TIMEOUT_S = 30.0

SERVING = health_pb2.HealthCheckResponse.SERVING

NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


def runsc_containers(root: Path) -> list[str]:
    """The containers runsc holds under ``root``, asked of runsc itself: a leak check made from
    outside the worker under test (which lists them through ``readie_worker.runsc``)."""
    if not root.exists():
        return []
    listed = subprocess.run(
        ["runsc", "--root", str(root), "list", "--quiet"], capture_output=True, text=True, timeout=RUNSC_TIMEOUT_S, check=True
    )
    return listed.stdout.split()


def _release_paused(root: Path, container: str) -> None:
    """Let a container its dead worker may have left paused (an idle warm or session sandbox) run
    again: runsc delete would wait for it. Thawed from its freezer cgroup (readie_worker.cgroups),
    and its sentry sent a SIGCONT, as an earlier readie paused it; its pid is in runsc's own record."""
    for path, value in (
        (Path("/sys/fs/cgroup/freezer") / container / "freezer.state", "THAWED"),
        (Path("/sys/fs/cgroup") / container / "cgroup.freeze", "0"),
    ):
        try:  # never created: on a v1 host /sys/fs/cgroup itself is a tmpfs
            descriptor = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
        except OSError:
            continue  # not this cgroup version's, or gone already
        try:
            os.write(descriptor, value.encode())
        except OSError:
            pass
        finally:
            os.close(descriptor)
    try:
        state = json.loads((root / f"{container}_sandbox:{container}.state").read_text())
        os.kill(int(state["sandbox"]["pid"]), signal.SIGCONT)
    except (OSError, ValueError, KeyError, TypeError):
        pass  # gone already, or not a sandbox runsc recorded: delete as it is


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    port: int
    state_dir: Path  # named by --state-dir; made, and removed at exit, by the worker
    log_path: Path
    channel: grpc.Channel

    @property
    def runsc_root(self) -> Path:
        return self.state_dir / RUNSC_DIR

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
        return runsc_containers(self.runsc_root)  # none once the worker removed its state dir

#: A ceiling for test clusters: grants anywhere under /tmp, where tests keep
#: their projects (the worker still refuses its own directories), and answers
#: as large as a worker makes them. Without one a network server grants nothing.
TEST_CEILING = """
[pool.limits]
allow_read = ["/tmp"]
allow_write = ["/tmp"]
max_output = "16m"
"""


def ceiling_file() -> Path:
    """:data:`TEST_CEILING` as a config file for ``--config``; remove its directory when done.

    Not under /tmp: a config beneath one of its own write grants is refused
    (a job could rewrite it), so it goes on /dev/shm.
    """
    path = Path(tempfile.mkdtemp(prefix="readie-ceiling-", dir="/dev/shm")) / "ceiling.toml"
    path.write_text(TEST_CEILING)
    return path


def start_worker(
    base: Path,
    name: str,
    manifest: Path,
    warm: str = "base=1",
    slots: int = 2,
    *,
    args: Iterable[str] = (),
    security: ClientSecurity = ClientSecurity(),
    host: str = "127.0.0.1",
    port: int | None = None,
) -> WorkerProcess:
    """A ``readie worker`` process on ``host:port`` (by default a free loopback port), serving once this returns.

    ``args`` are further flags (``--config``, ``--token-file``, ...);
    ``security`` is how the returned channel reaches it.
    """
    port = port or free_port()
    base.mkdir(parents=True, exist_ok=True)
    state_dir, log_path = base / "state", base / "worker.log"
    command = [
        *readie_command(),
        "worker",
        f"--listen={host}:{port}",
        f"--manifest={manifest}",
        f"--state-dir={state_dir}",
        f"--warm={warm}",
        f"--slots={slots}",
        f"--name={name}",
        "--drain-grace=20",
        "--drain-notice=0",  # tests stop hundreds of workers; none has a balancer to tell
        "--log=json",
        *args,
    ]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    worker = WorkerProcess(process, port, state_dir, log_path, security.channel(f"{host}:{port}"))
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


# prctl options: whether this process adopts its descendants' orphans.
PR_SET_CHILD_SUBREAPER, PR_GET_CHILD_SUBREAPER = 36, 37


@contextmanager
def not_a_subreaper() -> Iterator[None]:
    """This process stops adopting orphans while a test that kills workers runs, as a supervisor
    that reaps would.

    A worker that starts sandboxes makes its process a child subreaper, and so does every
    in-process worker an earlier test ran here. Then the sandboxes of a SIGKILLed worker are
    adopted by the test process, which never reaps them, and every ``runsc delete`` of them
    (the restarted worker's, :meth:`Cluster.stop`'s) waits for a zombie until it times out
    (30 s). Outside tests, init or the container's init (Compose's ``init: true``) adopts and
    reaps them.
    """
    libc = ctypes.CDLL(None, use_errno=True)
    was = ctypes.c_int(0)
    libc.prctl(PR_GET_CHILD_SUBREAPER, ctypes.byref(was), 0, 0, 0)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    try:
        yield
    finally:
        libc.prctl(PR_SET_CHILD_SUBREAPER, was.value, 0, 0, 0)


@dataclass
class Cluster:
    """``readie router`` on a free loopback port, placing on ``workers`` (see :func:`start_cluster`)."""

    base: Path
    workers: list[WorkerProcess]
    router: subprocess.Popen[bytes]
    port: int
    log_path: Path
    channel: grpc.Channel
    ceiling: Path | None = None  # the config file start_cluster wrote, removed by stop()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def stub(self) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self.channel)

    def containers(self) -> dict[str, list[str]]:
        """Each worker's runsc containers (warm sandboxes included), by its state dir."""
        return {str(w.state_dir): w.containers() for w in self.workers if w.process.poll() is None}

    def stop(self) -> None:
        """SIGTERM the router and every worker; raises if one fails to drain or leaves a container."""
        self.channel.close()
        if self.router.poll() is None:
            self.router.terminate()
        status = self.router.wait(EXIT_TIMEOUT_S)
        problems = []
        for worker in self.workers:
            alive = worker.process.poll() is None
            exit_status = stop_worker(worker)
            if not alive:  # killed by its test (under not_a_subreaper): its sandboxes outlive it, as after a crash
                for container in runsc_containers(worker.runsc_root):
                    _release_paused(worker.runsc_root, container)
                    try:  # one that will not go is named below as a leftover; the other workers still stop
                        subprocess.run(["runsc", "--root", str(worker.runsc_root), "delete", "--force", container],
                                       capture_output=True, timeout=RUNSC_TIMEOUT_S, check=False)
                    except subprocess.TimeoutExpired:
                        pass
            elif exit_status != 0:
                problems.append(f"{worker.log_path.parent.name} exited {exit_status}:\n{worker.log_path.read_text()[-2000:]}")
            leftovers = worker.containers()
            if leftovers:
                problems.append(f"{worker.log_path.parent.name} left runsc containers: {leftovers}")
        if status != 0:
            problems.append(f"the router exited {status}:\n{self.log_path.read_text()[-3000:]}")
        if self.ceiling is not None:
            shutil.rmtree(self.ceiling.parent, ignore_errors=True)
        assert not problems, "\n".join(problems)


def start_cluster(
    base: Path,
    manifest: Path,
    *,
    workers: int = 2,
    warm: str = "base=1",
    slots: int = 2,
    router_args: Iterable[str] = (),
    worker_args: Iterable[str] = (),
    security: ClientSecurity = ClientSecurity(),
) -> Cluster:
    """Start ``workers`` workers and a router in front of them; wait until the router serves.

    Router and workers run under :data:`TEST_CEILING` unless the args name another
    ``--config``; ``security`` is how the cluster's channel reaches the router.
    """
    ceiling = ceiling_file()
    worker_args, router_args = list(worker_args), list(router_args)
    worker_args += [] if any(a.startswith("--config") for a in worker_args) else [f"--config={ceiling}"]
    router_args += [] if any(a.startswith("--config") for a in router_args) else [f"--config={ceiling}"]
    started: list[WorkerProcess] = []
    try:
        for i in range(workers):
            started.append(start_worker(base / f"worker-{i}", f"worker-{i}", manifest, warm=warm, slots=slots, args=worker_args))
    except BaseException:
        for worker in started:
            stop_worker(worker)
        shutil.rmtree(ceiling.parent, ignore_errors=True)
        raise
    port = free_port()
    log_path = base / "router.log"
    with open(log_path, "wb") as log:
        router = subprocess.Popen(
            [
                *readie_command(),
                "router",
                f"--listen=127.0.0.1:{port}",
                "--probe-interval=0.2",
                "--drain-notice=0",
                f"--checkpoints={manifest.parent}",
                *router_args,
                *(f"--worker=127.0.0.1:{w.port}" for w in started),
            ],
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    cluster = Cluster(base, started, router, port, log_path, security.channel(f"127.0.0.1:{port}"), ceiling)
    health = health_pb2_grpc.HealthStub(cluster.channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            serving = health.Check(health_pb2.HealthCheckRequest(), timeout=2).status
            if serving == health_pb2.HealthCheckResponse.SERVING:
                return cluster
        except grpc.RpcError:
            pass
        if router.poll() is not None or time.monotonic() > deadline:
            cluster.stop()
            raise AssertionError(f"the router did not serve:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.1)


@dataclass(frozen=True)
class TestPki:
    """PEM files of a throwaway CA, a server certificate for 127.0.0.1 and localhost, a
    client certificate it signed, and a client certificate of another CA (for refusals)."""

    __test__ = False  # not a pytest class

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    stranger_cert: Path
    stranger_key: Path


def make_pki(base: Path) -> TestPki:
    """Write :class:`TestPki` under ``base`` (needs the ``cryptography`` package, a dev dependency)."""
    import datetime
    import ipaddress

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    base.mkdir(parents=True, exist_ok=True)
    now = datetime.datetime.now(datetime.timezone.utc)

    def name(common: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])

    def certificate(subject: str, key: ec.EllipticCurvePrivateKey, issuer: tuple[x509.Name, ec.EllipticCurvePrivateKey] | None,
                    *, ca: bool = False, server: bool = False) -> x509.Certificate:
        issuer_name, issuer_key = issuer if issuer is not None else (name(subject), key)
        builder = (
            x509.CertificateBuilder()
            .subject_name(name(subject))
            .issuer_name(issuer_name)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=ca, path_length=None), critical=True)
        )
        if server:
            builder = builder.add_extension(
                x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                critical=False,
            ).add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        elif not ca:
            builder = builder.add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.CLIENT_AUTH]), critical=False)
        return builder.sign(issuer_key, hashes.SHA256())

    def write(stem: str, cert: x509.Certificate, key: ec.EllipticCurvePrivateKey | None = None) -> tuple[Path, Path | None]:
        cert_path = base / f"{stem}.crt"
        cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
        if key is None:
            return cert_path, None
        key_path = base / f"{stem}.key"
        key_path.write_bytes(
            key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )
        key_path.chmod(0o600)
        return cert_path, key_path

    ca_key, stranger_ca_key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca = certificate("readie test CA", ca_key, None, ca=True)
    stranger_ca = certificate("some other CA", stranger_ca_key, None, ca=True)
    server_key, client_key, stranger_key = (ec.generate_private_key(ec.SECP256R1()) for _ in range(3))
    ca_path, _ = write("ca", ca)
    server = write("server", certificate("readie test server", server_key, (ca.subject, ca_key), server=True), server_key)
    client = write("client", certificate("readie test client", client_key, (ca.subject, ca_key)), client_key)
    stranger = write("stranger", certificate("a stranger", stranger_key, (stranger_ca.subject, stranger_ca_key)), stranger_key)
    return TestPki(ca_path, server[0], server[1], client[0], client[1], stranger[0], stranger[1])  # type: ignore[arg-type]
