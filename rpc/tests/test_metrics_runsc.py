"""``readie worker --metrics-listen``: a real worker, a few jobs and a session over gRPC, then /metrics.

The counters must move by exactly what ran: two jobs over RunJob (one
failing), one job with a host call over Interact, one refused request, and
a two-step session; gRPC calls are counted by method and status code.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import grpc
import pytest
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc.client import WorkerClient
from readie_rpc.testing import ceiling_file, start_worker, stop_worker
from readie_worker.jobs import CodeJob, Step
from readie_worker.testing import FakeHost, free_port, sample, scrape, wait_until

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

WARM = 2
JOB_TIMEOUT_MS = 30_000


def test_worker_metrics_count_exactly_what_ran(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="rwm-", dir="/tmp"))  # short: sandbox socket paths
    ceiling = ceiling_file()
    port = free_port()
    worker = start_worker(
        base, "metrics-a", CHECKPOINTS / "manifest.json", warm=f"base={WARM}",
        args=[f"--config={ceiling}", f"--metrics-listen=127.0.0.1:{port}"],
    )
    client = WorkerClient(f"127.0.0.1:{worker.port}")
    try:
        assert wait_until(lambda: sample(scrape(port), "readie_worker_warm_sandboxes_ready", checkpoint="base") == WARM, 30)
        before = scrape(port)
        assert sample(before, "readie_worker_warm_sandboxes_target", checkpoint="base") == WARM
        assert sample(before, "readie_worker_jobs_total", checkpoint="base", outcome="ok") == 0

        def run(code: str) -> pb.RunJobResponse:
            return worker.stub.RunJob(pb.RunJobRequest(checkpoint="base", code=code), timeout=30)

        assert run("print(1)").exit == 0
        assert run("raise ValueError('no')").error.type == "ValueError"
        with pytest.raises(grpc.RpcError) as refused:
            worker.stub.RunJob(pb.RunJobRequest(checkpoint="no-such", code="1"), timeout=30)
        code = refused.value.code().name
        host = FakeHost(add=lambda a, b: a + b)
        asked = CodeJob(checkpoint="base", code="from readie_host import add\nprint(add(1, 2))", functions=host.names)
        assert client.run_job(asked, host=host).stdout == "3\n"
        session, first = client.open_session(CodeJob(checkpoint="base", code="x = 1", timeout_ms=JOB_TIMEOUT_MS))
        assert session.run_step(Step("print(x)")).outcome.stdout == "1\n"
        assert first.outcome.exit == 0
        assert sample(scrape(port), "readie_worker_sessions_active") == 1
        session.close()

        assert wait_until(lambda: sample(scrape(port), "grpc_server_handled_total", grpc_method="Interact", grpc_code="OK") == 2, 10)
        after = scrape(port)
        assert sample(after, "readie_worker_sessions_active") == 0
        # One-shot jobs only: the session's steps are not jobs; the refused request never ran.
        assert sample(after, "readie_worker_jobs_total", checkpoint="base", outcome="ok") == 2
        assert sample(after, "readie_worker_jobs_total", checkpoint="base", outcome="failed") == 1
        assert sample(after, "readie_worker_job_duration_seconds_count", checkpoint="base") == 3
        assert sample(after, "readie_worker_job_queue_duration_seconds_count", checkpoint="base") == 3
        assert sample(after, "readie_worker_host_calls_total", checkpoint="base") == 1
        assert sample(after, "grpc_server_handled_total", grpc_method="RunJob", grpc_code="OK") == 2
        assert sample(after, "grpc_server_handled_total", grpc_method="RunJob", grpc_code=code) == 1
        assert sample(after, "readie_worker_cold_fallbacks_total", checkpoint="base") == 0
        # The warm sandboxes at start, and one restored for each that served a job or the session.
        assert wait_until(lambda: sample(scrape(port), "readie_worker_warm_sandboxes_ready", checkpoint="base") == WARM, 30)
        restores = sample(scrape(port), "readie_worker_sandbox_start_duration_seconds_count", checkpoint="base", launcher="runsc-restore")
        assert restores == WARM + 4
        # The session's two steps, its first included, are counted as steps.
        assert sample(after, "readie_worker_session_steps_total", checkpoint="base", outcome="ok") == 2
        # Every sandbox that served is destroyed after its answer: the three jobs' and the session's.
        assert wait_until(lambda: sample(scrape(port), "readie_worker_sandbox_destroy_duration_seconds_count") == 4, 10)
        # A job with a grant takes a warm sandbox too (decision 0034), and the one restored in its
        # place is counted as made.
        grant = base / "granted"
        grant.mkdir()
        worker.stub.RunJob(pb.RunJobRequest(checkpoint="base", code="print(1)", allow_read=[str(grant)]), timeout=30)
        assert wait_until(lambda: sample(scrape(port), "readie_worker_warm_sandboxes_ready", checkpoint="base") == WARM, 30)
        made = sample(scrape(port), "readie_worker_sandbox_start_duration_seconds_count", checkpoint="base", launcher="runsc-restore")
        assert made == restores + 1
        assert sample(scrape(port), "readie_worker_runsc_command_failures_total", command="restore") == 0
    finally:
        client.close()
        status = stop_worker(worker)
        leftovers = worker.containers()
        shutil.rmtree(ceiling.parent, ignore_errors=True)
        shutil.rmtree(base, ignore_errors=True)
    assert status == 0
    assert leftovers == []
