"""`readie router --worker-dns`: real workers found through a name in /etc/hosts that changes under the router.

Workers listen on distinct loopback addresses and one port, as the pods
behind a Kubernetes headless Service do; the name is this test's own and
resolves through /etc/hosts (glibc reads the file at every lookup), which
the test rewrites (atomically: other processes on the machine resolve
localhost through it meanwhile) and restores in a ``finally``. Shown: jobs
go to both workers; an address removed from the answer gets no new jobs
while the job running there finishes; an address added later gets jobs;
the router's discovery metrics count exactly that.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.stubs import worker_pb2_grpc as pb_grpc
from readie_rpc.testing import SERVING, WorkerProcess, ceiling_file, stop_worker
from readie_rpc.testing import start_worker as start_testing_worker
from readie_worker.runsc import Runsc
from readie_worker.testing import free_port, readie_command, sample, scrape, wait_until

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

HOSTS = Path("/etc/hosts")
STARTUP_TIMEOUT_S = 60.0  # a worker restores its warm sandbox; other engineers' gVisor tests share the 2 cores
CHANGE_TIMEOUT_S = 20.0  # a few DNS rounds (0.2 s) and probes, with margin for a loaded machine
JOB_TIMEOUT_S = 90.0
OK_JOBS = ("readie_worker_jobs_total", {"checkpoint": "base", "outcome": "ok"})


@contextmanager
def hosts_entries() -> Iterator[Callable[[str, list[str]], None]]:
    """``set_name(name, [ips])`` rewrites /etc/hosts with those lines added; the file is restored at exit."""
    original = HOSTS.read_bytes()
    mode = HOSTS.stat().st_mode & 0o7777

    def write(content: bytes) -> None:
        fd, temporary = tempfile.mkstemp(dir=HOSTS.parent, prefix=".hosts-readie-test-")
        try:
            os.write(fd, content)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)
        try:
            os.replace(temporary, HOSTS)  # never a moment without localhost for the machine's other processes
        except OSError:  # /etc/hosts bind-mounted (a container): only writing it in place is possible
            os.unlink(temporary)
            HOSTS.write_bytes(content)

    def set_name(name: str, ips: list[str]) -> None:
        lines = "".join(f"{ip} {name}\n" for ip in ips)
        write(original + (b"" if original.endswith(b"\n") else b"\n") + lines.encode())

    try:
        yield set_name
    finally:
        write(original)


def resolved(name: str) -> set[str]:
    try:
        return {info[4][0] for info in socket.getaddrinfo(name, 1, type=socket.SOCK_STREAM)}
    except socket.gaierror:
        return set()


def start_worker(base: Path, ip: str, port: int) -> tuple[WorkerProcess, int]:
    """A ``readie worker`` on ``ip:port``, serving once this returns, with its /metrics port."""
    metrics_port = free_port()
    worker = start_testing_worker(
        base, f"worker-{ip}", CHECKPOINTS / "manifest.json", warm="base=1", slots=2, host=ip, port=port,
        args=[f"--metrics-listen=127.0.0.1:{metrics_port}"],
    )
    return worker, metrics_port


def ok_jobs(metrics_port: int) -> float:
    return sample(scrape(metrics_port), OK_JOBS[0], **OK_JOBS[1])


def run(stub: pb_grpc.WorkerStub, code: str) -> pb.RunJobResponse:
    return stub.RunJob(pb.RunJobRequest(checkpoint="base", code=code, timeout_ms=60_000), timeout=JOB_TIMEOUT_S)


def run_together(stub: pb_grpc.WorkerStub, code: str, count: int) -> list[pb.RunJobResponse]:
    replies: list[pb.RunJobResponse] = []
    threads = [threading.Thread(target=lambda: replies.append(run(stub, code))) for _ in range(count)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(JOB_TIMEOUT_S)
    return replies


def test_the_router_follows_a_name_whose_addresses_change():
    base = Path(tempfile.mkdtemp(prefix="rdns-", dir="/tmp"))
    name = f"readie-test-{uuid.uuid4().hex[:12]}.invalid"
    port = free_port()
    ips = ["127.0.0.2", "127.0.0.3", "127.0.0.4"]
    workers: dict[str, tuple[WorkerProcess, int]] = {}
    router: subprocess.Popen[bytes] | None = None
    ceiling = ceiling_file()
    router_metrics = free_port()
    router_log = base / "router.log"
    try:
        with hosts_entries() as set_name:
            for ip in ips[:2]:
                workers[ip] = start_worker(base / ip, ip, port)
            set_name(name, ips[:2])
            assert resolved(name) == set(ips[:2]), "glibc did not read the rewritten /etc/hosts"
            router_port = free_port()
            with open(router_log, "wb") as log:
                router = subprocess.Popen(
                    [
                        *readie_command(), "router", f"--listen=127.0.0.1:{router_port}",
                        f"--worker-dns={name}:{port}", "--dns-interval=0.2", "--probe-interval=0.2",
                        "--drain-notice=0", f"--checkpoints={CHECKPOINTS}", f"--config={ceiling}", "--log=json",
                        f"--metrics-listen=127.0.0.1:{router_metrics}",
                    ],
                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                )
            channel = grpc.insecure_channel(f"127.0.0.1:{router_port}")
            stub = pb_grpc.WorkerStub(channel)
            health = health_pb2_grpc.HealthStub(channel)

            def serving() -> bool:
                try:
                    return health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == SERVING
                except grpc.RpcError:
                    return False

            assert wait_until(serving, STARTUP_TIMEOUT_S), router_log.read_text()[-3000:]
            discovered = lambda: sample(scrape(router_metrics), "readie_router_discovered_workers")  # noqa: E731
            assert discovered() == 2

            # Both addresses get jobs: four at once, two slots each.
            replies = run_together(stub, "import time\ntime.sleep(1)\nprint('ok')", 4)
            assert [r.stdout for r in replies] == ["ok\n"] * 4, replies
            counts = {ip: ok_jobs(metrics) for ip, (_, metrics) in workers.items()}
            assert sum(counts.values()) == 4 and all(counts.values()), counts

            # A long job; then its worker's address leaves the answer.
            long_reply: list[pb.RunJobResponse] = []
            long_job = threading.Thread(target=lambda: long_reply.append(run(stub, "import time\ntime.sleep(15)\nprint('finished')")))
            long_job.start()
            assert wait_until(lambda: any(w.stub.Capacity(pb.CapacityRequest(), timeout=5).busy for w, _ in workers.values()), 20)
            hosting = next(ip for ip, (w, _) in workers.items() if w.stub.Capacity(pb.CapacityRequest(), timeout=5).busy)
            other = next(ip for ip in workers if ip != hosting)
            set_name(name, [other])
            assert wait_until(lambda: discovered() == 1, CHANGE_TIMEOUT_S)
            before = {ip: ok_jobs(metrics) for ip, (_, metrics) in workers.items()}
            for n in range(3):
                assert run(stub, f"print({n})").stdout == f"{n}\n"
            assert long_job.is_alive(), "the long job should still be running on the retired worker"
            after = {ip: ok_jobs(metrics) for ip, (_, metrics) in workers.items()}
            assert (after[hosting] - before[hosting], after[other] - before[other]) == (0, 3), (before, after)
            long_job.join(JOB_TIMEOUT_S)
            assert long_reply and long_reply[0].stdout == "finished\n" and not long_reply[0].HasField("error"), long_reply
            assert ok_jobs(workers[hosting][1]) == after[hosting] + 1  # it ran to its end there

            # A third worker, added to the answer later, gets jobs; the retired one none.
            workers[ips[2]] = start_worker(base / ips[2], ips[2], port)
            set_name(name, [other, ips[2]])
            assert wait_until(lambda: discovered() == 2, CHANGE_TIMEOUT_S)
            before = {ip: ok_jobs(metrics) for ip, (_, metrics) in workers.items()}
            replies = run_together(stub, "import time\ntime.sleep(1)\nprint('ok')", 4)
            assert [r.stdout for r in replies] == ["ok\n"] * 4, replies
            after = {ip: ok_jobs(metrics) for ip, (_, metrics) in workers.items()}
            assert after[ips[2]] > before.get(ips[2], 0), (before, after)
            assert after[hosting] == before[hosting], "a retired address got a job"

            samples = scrape(router_metrics)
            assert sample(samples, "readie_router_evictions_total", reason="retired") == 1
            assert sample(samples, "readie_router_evictions_total", reason="lost") == 0
            assert sample(samples, "readie_router_probes_total", outcome="ok") > 0
            channel.close()
        router.send_signal(signal.SIGTERM)
        assert router.wait(30) == 0, router_log.read_text()[-3000:]
        logged = router_log.read_text()
        assert "worker retired: its address left the DNS answer" in logged
        assert "retired worker dropped" in logged
    finally:
        if router is not None and router.poll() is None:
            router.kill()
            router.wait(10)
        problems = []
        for ip, (worker, _) in workers.items():
            if stop_worker(worker) != 0:
                problems.append(f"worker {ip} did not drain cleanly:\n{worker.log_path.read_text()[-2000:]}")
            leftovers = Runsc(root=worker.runsc_root).list_ids()
            if leftovers:
                problems.append(f"worker {ip} left containers {leftovers}")
                Runsc(root=worker.runsc_root).sweep()
        shutil.rmtree(ceiling.parent, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
        assert not problems, "\n".join(problems)
