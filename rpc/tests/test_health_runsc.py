"""Health that tells the truth, and sessions that survive an aggressive client keepalive:
real ``readie worker`` and ``readie router`` processes."""

from __future__ import annotations

import json
import queue
import subprocess
import time
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.testing import NOT_SERVING, SERVING, start_cluster
from readie_worker.testing import free_port, readie_command, wait_until

pytestmark = pytest.mark.runsc

# What a Node client with keepalive_time_ms=10000 does: ping every 10 s, idle or not.
AGGRESSIVE_KEEPALIVE = [
    ("grpc.keepalive_time_ms", 10_000),
    ("grpc.keepalive_timeout_ms", 5_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
]
IDLE_S = 60


def health(channel: grpc.Channel) -> int | None:
    try:
        return health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=2).status
    except grpc.RpcError:
        return None


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    with open(log, "wb") as out:
        return subprocess.Popen([*readie_command(), *args], stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT)


def stop(process: subprocess.Popen[bytes]) -> int:
    process.terminate()
    try:
        return process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()


def test_a_worker_with_no_usable_checkpoint_is_not_serving_and_says_why(checkpoints, checkpoint_dir, short_tmp):
    manifest = json.loads((checkpoint_dir / "manifest.json").read_text())
    manifest["runsc_version"] = "runsc version 0.0~19990101.0"  # dropped: another runsc made them
    for entry in manifest["checkpoints"]:
        entry["image_path"] = str(checkpoint_dir / entry["image_path"])
    (short_tmp / "manifest.json").write_text(json.dumps(manifest))
    port = free_port()
    log = short_tmp / "worker.log"
    worker = spawn(
        ["worker", f"--listen=127.0.0.1:{port}", f"--manifest={short_tmp / 'manifest.json'}",
         f"--state-dir={short_tmp / 'state'}", "--log=json"],
        log,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    try:
        assert wait_until(lambda: health(channel) == NOT_SERVING, 30), log.read_text()
        capacity = pb_grpc.WorkerStub(channel).Capacity(pb.CapacityRequest(), timeout=5)
        assert capacity.problem.startswith("no usable checkpoint") and "runsc version" in capacity.problem
        logged = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        assert any(line.get("event") == "health" and line.get("status") == "NOT_SERVING" for line in logged)
    finally:
        channel.close()
        assert stop(worker) == 0


def test_a_router_is_not_serving_until_a_worker_answers(checkpoints, checkpoint_dir, short_tmp):
    worker_port, router_port = free_port(), free_port()
    log = short_tmp / "router.log"
    router = spawn(
        ["router", f"--listen=127.0.0.1:{router_port}", f"--worker=127.0.0.1:{worker_port}",
         "--probe-interval=0.2", f"--checkpoints={checkpoint_dir}"],
        log,
    )
    channel = grpc.insecure_channel(f"127.0.0.1:{router_port}")
    worker = None
    try:
        assert wait_until(lambda: health(channel) == NOT_SERVING, 30), log.read_text()
        assert "worker unreachable" in log.read_text()  # a mistyped --worker shows at once
        worker = spawn(
            ["worker", f"--listen=127.0.0.1:{worker_port}", f"--manifest={checkpoint_dir / 'manifest.json'}",
             f"--state-dir={short_tmp / 'state'}", "--warm=base=0"],
            short_tmp / "worker.log",
        )
        assert wait_until(lambda: health(channel) == SERVING, 30), log.read_text()
        # Failed probes are logged with backoff, not once per probe.
        assert log.read_text().count("worker unreachable") < 10
    finally:
        channel.close()
        if worker is not None:
            assert stop(worker) == 0
        assert stop(router) == 0


def test_a_session_survives_a_minute_idle_under_an_aggressive_client_keepalive(checkpoints, checkpoint_dir, short_tmp):
    cluster = start_cluster(short_tmp, checkpoint_dir / "manifest.json", workers=1, warm="base=0")
    channel = grpc.insecure_channel(cluster.address, options=AGGRESSIVE_KEEPALIVE)
    requests: queue.Queue[pb.InteractRequest | None] = queue.Queue()
    try:
        requests.put(pb.InteractRequest(open_session=pb.RunJobRequest(checkpoint="base", code="kept = 'still here'")))
        events = pb_grpc.WorkerStub(channel).Interact(iter(requests.get, None), timeout=IDLE_S + 60)
        assert next(events).result.step == 1
        time.sleep(IDLE_S)  # the client pings every 10 s meanwhile
        requests.put(pb.InteractRequest(step=pb.SessionStep(code="print(kept)")))
        second = next(events).result
        assert (second.step, second.stdout) == (2, "still here\n"), second
        requests.put(None)
        assert list(events) == []
    finally:
        channel.close()
        cluster.stop()
