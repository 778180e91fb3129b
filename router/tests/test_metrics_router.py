"""``readie router --metrics-listen``: jobs and a session through a real router, then its /metrics.

The router counts the gRPC calls it handled by method and status code
(its workers export their jobs' metrics on their own endpoints), and its
placement: probes by outcome, evictions by reason, workers found by DNS.
With the probe timer set beyond the test, the only probes are the one
round at start, so their count is exact. DNS discovery's metrics moving:
test_discovery.py (exact, by hand) and test_router_dns.py (real processes).
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from readie_rpc.client import WorkerClient
from readie_rpc.stubs import pool_pb2, pool_pb2_grpc
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.testing import start_cluster
from readie_worker.jobs import CodeJob, Step
from readie_worker.testing import FakeHost, free_port, sample, scrape, wait_until

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

JOB_TIMEOUT_MS = 30_000
# The probe timer, beyond the test's length: only the start's round of probes happens.
NO_PROBES = "1h"


def test_router_metrics_count_exactly_the_calls_it_handled(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="rrm-", dir="/tmp"))
    port = free_port()
    cluster = start_cluster(
        base, CHECKPOINTS / "manifest.json", router_args=[f"--metrics-listen=127.0.0.1:{port}", f"--probe-interval={NO_PROBES}"]
    )
    client = WorkerClient(cluster.address)
    try:
        start = scrape(port)
        assert sample(start, "grpc_server_handled_total", grpc_method="RunJob", grpc_code="OK") == 0
        # One probe of each of the two workers at start, both answered; nobody evicted, nothing from DNS.
        assert placement_samples(start) == {
            ("readie_router_probes_total", "ok"): 2,
            ("readie_router_probes_total", "failed"): 0,
            ("readie_router_evictions_total", "probes"): 0,
            ("readie_router_evictions_total", "lost"): 0,
            ("readie_router_evictions_total", "retired"): 0,
            ("readie_router_discovered_workers", ""): 0,
        }
        for code in ("print(1)", "print(2)", "raise ValueError('no')"):
            cluster.stub.RunJob(pb.RunJobRequest(checkpoint="base", code=code), timeout=30)
        host = FakeHost(add=lambda a, b: a + b)
        asked = CodeJob(checkpoint="base", code="from readie_host import add\nprint(add(1, 2))", functions=host.names)
        assert client.run_job(asked, host=host).stdout == "3\n"
        session, _ = client.open_session(CodeJob(checkpoint="base", code="x = 1", timeout_ms=JOB_TIMEOUT_MS))
        assert session.run_step(Step("print(x)")).outcome.stdout == "1\n"
        session.close()
        assert wait_until(lambda: sample(scrape(port), "grpc_server_handled_total", grpc_method="Interact", grpc_code="OK") == 2, 10)
        # One Pool.Session stream: its lines answer a job, then its EOF ends the stream.
        pool = pool_pb2_grpc.PoolStub(cluster.channel)
        lines = list(pool.Session(iter([pool_pb2.PoolInput(data=b'{"id": 1, "code": "print(5)"}\n')]), timeout=60))
        assert any(b'"stdout": "5\\n"' in line.line for line in lines), lines
        assert wait_until(lambda: sample(scrape(port), "grpc_server_handled_total", grpc_method="Session", grpc_code="OK") == 1, 10)
        after = scrape(port)
        # A job that raised is still an answered call: OK at the gRPC level.
        assert sample(after, "grpc_server_handled_total", grpc_method="RunJob", grpc_code="OK") == 3
        handled = {labels: value for (name, labels), value in after.items() if name == "grpc_server_handled_total" and value}
        assert sum(handled.values()) == 6, handled  # nothing else was called on the router
        assert placement_samples(after) == placement_samples(start)  # jobs and a session probe nobody
    finally:
        client.close()
        cluster.stop()
        shutil.rmtree(base, ignore_errors=True)


def placement_samples(samples) -> dict[tuple[str, str], float]:
    """The router's placement metrics, by name and their one label's value."""
    names = ("readie_router_probes_total", "readie_router_evictions_total", "readie_router_discovered_workers")
    return {
        (name, next(iter(dict(labels).values()), "")): value for (name, labels), value in samples.items() if name in names
    }
