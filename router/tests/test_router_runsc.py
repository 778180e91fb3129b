"""`readie router` placing jobs on two real `readie worker` processes on loopback."""

from __future__ import annotations

import shutil
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readie_worker._proto.readie.v1 import worker_pb2 as pb
from readie_worker._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_router.testing import PoolProcess
from readie_worker.testing import free_port, readie_command, start_worker, stop_worker

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

STARTUP_TIMEOUT_S = 30.0


@pytest.fixture
def cluster() -> Iterator[dict]:
    base = Path(tempfile.mkdtemp(prefix="rr-", dir="/tmp"))
    workers = [
        start_worker(base / name, name, CHECKPOINTS / "manifest.json", warm="base=1", slots=2)
        for name in ("worker-a", "worker-b")
    ]
    port = free_port()
    log_path = base / "router.log"
    with open(log_path, "wb") as log:
        router = subprocess.Popen(
            [*readie_command(), "router", f"--listen=127.0.0.1:{port}", "--probe-interval=0.2",
             f"--checkpoints={CHECKPOINTS}", "--session-workers=2",
             *(f"--worker=127.0.0.1:{w.port}" for w in workers)],
            stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
        )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    health = health_pb2_grpc.HealthStub(channel)
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        try:
            if health.Check(health_pb2.HealthCheckRequest(), timeout=2).status == health_pb2.HealthCheckResponse.SERVING:
                break
        except grpc.RpcError:
            pass
        assert router.poll() is None and time.monotonic() < deadline, log_path.read_text()
        time.sleep(0.1)
    yield {"channel": channel, "stub": pb_grpc.WorkerStub(channel), "workers": workers, "router": router, "log": log_path, "port": port, "base": base}
    channel.close()
    router.terminate()
    assert router.wait(30) == 0, log_path.read_text()[-2000:]
    for worker in workers:
        stop_worker(worker)
        assert worker.containers() == []
    shutil.rmtree(base, ignore_errors=True)


def run(stub, code: str, **fields) -> pb.RunJobResponse:
    return stub.RunJob(pb.RunJobRequest(checkpoint=fields.pop("checkpoint", "base"), code=code, **fields), timeout=60)


def test_jobs_through_the_router_spread_over_both_workers(cluster):
    stub = cluster["stub"]
    replies = []
    threads = [threading.Thread(target=lambda: replies.append(run(stub, "import time\ntime.sleep(1)\nprint('ok')"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert [r.stdout for r in replies] == ["ok\n"] * 4
    capacity = stub.Capacity(pb.CapacityRequest(), timeout=5)
    assert capacity.slots == 4 and capacity.pools["base"].target == 2
    # Four concurrent jobs on two workers of two slots each: both took some.
    used = {reply.sandbox_id for reply in replies}
    assert len(used) == 4


def test_a_request_error_from_a_worker_comes_through_the_router(cluster):
    with pytest.raises(grpc.RpcError) as refused:
        run(cluster["stub"], "pass", checkpoint="nope")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refused.value.trailing_metadata())["readie-field"] == "checkpoint"


def test_killing_a_worker_mid_job_fails_that_job_and_the_other_keeps_serving(cluster):
    stub, (first, second) = cluster["stub"], cluster["workers"]
    replies: list[pb.RunJobResponse] = []
    jobs = [threading.Thread(target=lambda: replies.append(run(stub, "import time\ntime.sleep(6)", timeout_ms=40_000))) for _ in range(4)]
    for job in jobs:
        job.start()
    deadline = time.monotonic() + 20
    while len(first.containers()) < 2 and time.monotonic() < deadline:  # its two slots are busy
        time.sleep(0.1)
    first.process.kill()
    first.process.wait(10)
    for job in jobs[:]:
        job.join(60)
    lost = [r for r in replies if r.HasField("error")]
    assert len(lost) == 2 and all(r.error.type == "PoolWorkerError" for r in lost), replies
    assert sum(1 for r in replies if not r.HasField("error")) == 2
    after = run(stub, "print('still serving')")
    assert after.stdout == "still serving\n"
    # The killed worker's sandboxes outlive it; sweep them as its restart would.
    subprocess.run(["runsc", f"--root={first.state_dir}", "list", "--quiet"], check=False)
    from readie_worker.runsc import Runsc

    Runsc(root=first.state_dir).sweep()


def test_readie_pool_runs_its_jobs_through_the_router(cluster):
    project = cluster["base"] / "project"
    project.mkdir()
    with PoolProcess(
        ["--router", f"127.0.0.1:{cluster['port']}", "--workers=2", "--checkpoints", str(CHECKPOINTS)],
        cwd=project,
        stderr_path=cluster["base"] / "pool.err",
    ) as pool:
        ready = pool.ready()
        assert ready["event"] == "ready" and ready["workers"] == 2
        pool.send(
            {"id": "r1", "code": "print('via the router')"},
            {"id": "r2", "code": "raise KeyError('k')"},
            {"id": "r3", "session": "nb", "code": "x = 1"},
            {"id": "r4", "functions": ["search"], "code": "from readie_host import search"},
        )
        results = {result["id"]: result for result in pool.results(4)}
        assert pool.close() == 0
    # A session cannot be pinned to one of the router's workers: refused, naming the field.
    assert (results["r3"]["exit"], results["r3"]["session"], results["r3"]["error"]["type"]) == (-1, "nb", "RequestError")
    assert results["r3"]["error"]["message"].startswith("session: sessions are not supported through a router")
    # Nor can a host call travel back through the worker API: refused, naming the field.
    assert (results["r4"]["exit"], results["r4"]["policy"], results["r4"]["error"]["type"]) == (-1, None, "RequestError")
    assert results["r4"]["error"]["message"].startswith("functions: host functions are not supported through a router")
    assert (results["r1"]["exit"], results["r1"]["stdout"]) == (0, "via the router\n")
    assert results["r1"]["policy"]["backend"] == "gvisor:runsc-restore"
    assert results["r2"]["error"]["type"] == "KeyError"


def test_the_pool_protocol_streams_over_grpc(cluster):
    import json

    from readie_worker._proto.readie.v1 import pool_pb2, pool_pb2_grpc

    lines = [
        {"id": "slow", "code": "import time\ntime.sleep(2)\nprint('slow')"},
        {"id": "fast", "code": "print('fast')"},
        {"id": "bad", "code": "pass", "script": "x.py"},
        {"id": "nb", "session": "nb", "code": "x = 1"},
        {"id": "fn", "functions": ["search"], "code": "pass"},
        {"id": "s", "stats": True},
    ]
    data = "".join(json.dumps(line) + "\n" for line in lines).encode()
    # Split mid-line on purpose: the stream carries bytes, not messages per line.
    chunks = [pool_pb2.PoolInput(data=data[:25]), pool_pb2.PoolInput(data=data[25:])]
    stream = pool_pb2_grpc.PoolStub(cluster["channel"]).Session(iter(chunks), timeout=60)
    answers = [json.loads(message.line) for message in stream]
    assert answers[0]["event"] == "ready" and answers[0]["runtime"] == "readie"
    by_id = {answer["id"]: answer for answer in answers[1:]}
    assert by_id["fast"]["stdout"] == "fast\n" and by_id["slow"]["stdout"] == "slow\n"
    order = [answer["id"] for answer in answers[1:]]
    assert order.index("fast") < order.index("slow"), "results come in completion order"
    assert by_id["bad"]["error"]["type"] == "RequestError"
    assert by_id["nb"]["error"]["message"].startswith("session: sessions are not supported through a router")
    assert by_id["fn"]["error"]["message"].startswith("functions: host functions are not supported through a router")
    assert by_id["s"]["event"] == "stats" and by_id["s"]["request_errors"] == 3
