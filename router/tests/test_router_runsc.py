"""`readie router` placing jobs, sessions and host-function calls on two real `readie worker` processes on loopback."""

from __future__ import annotations

import shutil
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from readie_rpc.stubs import worker_pb2 as pb
from readie_pool.testing import PoolProcess
from readie_rpc.testing import Cluster, not_a_subreaper, start_cluster
from readie_worker.testing import wait_until

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    base = Path(tempfile.mkdtemp(prefix="rr-", dir="/tmp"))
    with not_a_subreaper():  # some tests here kill a worker: its sandboxes must go to init, who reaps
        made = start_cluster(base, CHECKPOINTS / "manifest.json", router_args=["--session-workers=2"])
        yield made
        made.stop()
    shutil.rmtree(base, ignore_errors=True)


def routed_pool(cluster: Cluster, workers: int) -> PoolProcess:
    """``readie pool --router`` in front of ``cluster``, in a fresh project dir."""
    project = cluster.base / "project"
    project.mkdir()
    return PoolProcess(
        ["--router", cluster.address, f"--workers={workers}", "--checkpoints", str(CHECKPOINTS)],
        cwd=project,
        stderr_path=cluster.base / "pool.err",
    )


def run(stub, code: str, **fields) -> pb.RunJobResponse:
    return stub.RunJob(pb.RunJobRequest(checkpoint=fields.pop("checkpoint", "base"), code=code, **fields), timeout=60)


def test_jobs_through_the_router_spread_over_both_workers(cluster):
    stub = cluster.stub
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
        run(cluster.stub, "pass", checkpoint="nope")
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refused.value.trailing_metadata())["readie-field"] == "checkpoint"


def test_killing_a_worker_mid_job_fails_that_job_and_the_other_keeps_serving(cluster):
    stub, (first, second) = cluster.stub, cluster.workers
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


def test_readie_pool_runs_jobs_sessions_and_host_functions_through_the_router(cluster):
    with routed_pool(cluster, workers=2) as pool:
        ready = pool.ready()
        assert ready["event"] == "ready" and ready["workers"] == 2
        pool.send(
            {"id": "r1", "code": "print('via the router')"},
            {"id": "r2", "code": "raise KeyError('k')"},
            {"id": "r3", "session": "nb", "code": "x = 1"},
        )
        results = {result["id"]: result for result in pool.results(3)}
        pool.send({"id": "r4", "session": "nb", "code": "x += 1\nprint(x)"})
        results["r4"] = pool.read()
        pool.send({"id": "r5", "functions": ["search"], "code": "from readie_host import search\nprint(search('q', limit=2))"})
        call = pool.read()
        assert {k: call[k] for k in ("event", "id", "function", "args", "kwargs")} == {
            "event": "call", "id": "r5", "function": "search", "args": ["q"], "kwargs": {"limit": 2}
        }
        pool.send({"reply": {"call_id": call["call_id"], "result": [2**64, {"deep": [[["x"]]]}]}})
        results["r5"] = pool.read()
        pool.send({"id": "r6", "session": "nb", "close": True})
        assert pool.read() == {"id": "r6", "session": "nb", "closed": True}
        assert pool.close() == 0
    assert (results["r1"]["exit"], results["r1"]["stdout"]) == (0, "via the router\n")
    assert results["r1"]["policy"]["backend"] == "gvisor:runsc-restore"
    assert results["r2"]["error"]["type"] == "KeyError"
    # The session's second step ran in the first one's sandbox: pinned to its worker.
    assert (results["r3"]["step"], results["r4"]["step"], results["r4"]["stdout"]) == (1, 2, "2\n")
    assert results["r5"]["stdout"] == f"[{2**64}, {{'deep': [[['x']]]}}]\n", results["r5"]


def _worker_sessions(cluster: Cluster) -> list[int]:
    return [w.stub.Capacity(pb.CapacityRequest(), timeout=5).sessions for w in cluster.workers]


def test_sessions_are_spread_over_the_workers_and_pinned_to_theirs(cluster):
    with routed_pool(cluster, workers=4) as pool:
        pool.ready()
        names = [f"s{i}" for i in range(4)]
        pool.send(*({"id": f"{name}-1", "session": name, "code": f"name = {name!r}; count = 0"} for name in names))
        assert all(r["exit"] == 0 for r in pool.results(4))
        assert _worker_sessions(cluster) == [2, 2]
        for step in range(2, 5):
            pool.send(*({"id": f"{name}-{step}", "session": name, "code": "count += 1\nprint(name, count)"} for name in names))
            by_id = {r["id"]: r for r in pool.results(4)}
            for name in names:
                assert by_id[f"{name}-{step}"]["stdout"] == f"{name} {step - 1}\n", by_id
        pool.send(*({"id": f"close-{name}", "session": name, "close": True} for name in names))
        assert all(r["closed"] for r in pool.results(4))
        assert _worker_sessions(cluster) == [0, 0]
        assert pool.close() == 0


def test_a_lost_worker_ends_its_sessions_with_a_clear_error_never_a_fresh_start(cluster):
    with routed_pool(cluster, workers=2) as pool:
        pool.ready()
        assert pool.run({"id": 1, "session": "nb", "code": "x = 41"})["exit"] == 0
        hosting = [w for w, count in zip(cluster.workers, _worker_sessions(cluster)) if count == 1]
        assert len(hosting) == 1
        hosting[0].process.kill()
        hosting[0].process.wait(10)
        lost = pool.run({"id": 2, "session": "nb", "code": "x += 1\nprint(x)"})
        assert (lost["exit"], lost["session"], lost["session_ended"], lost["error"]["type"]) == (-1, "nb", True, "PoolWorkerError")
        assert "session" in lost["error"]["message"] and "ended" in lost["error"]["message"], lost
        # Told it ended, the client's next request under the name opens a new session on the worker left.
        fresh = pool.run({"id": 3, "session": "nb", "code": "print('x' in dir())"})
        assert (fresh["exit"], fresh["step"], fresh["stdout"]) == (0, 1, "False\n"), fresh
        assert pool.close() == 0


def test_the_pool_protocol_streams_over_grpc_with_sessions_and_host_functions(cluster):
    import json
    import queue

    from readie_rpc.stubs import pool_pb2, pool_pb2_grpc

    inbox: queue.SimpleQueue = queue.SimpleQueue()

    def send(*lines):
        inbox.put(pool_pb2.PoolInput(data="".join(json.dumps(line) + "\n" for line in lines).encode()))

    stream = pool_pb2_grpc.PoolStub(cluster.channel).Session(iter(inbox.get, None), timeout=60)
    read = lambda: json.loads(next(stream).line)  # noqa: E731
    send(
        {"id": "slow", "code": "import time\ntime.sleep(2)\nprint('slow')"},
        {"id": "fast", "code": "print('fast')"},
        {"id": "bad", "code": "pass", "script": "x.py"},
    )
    assert read()["event"] == "ready"
    answers = [read() for _ in range(3)]
    by_id = {answer["id"]: answer for answer in answers}
    assert by_id["fast"]["stdout"] == "fast\n" and by_id["slow"]["stdout"] == "slow\n"
    order = [answer["id"] for answer in answers]
    assert order.index("fast") < order.index("slow"), "results come in completion order"
    assert by_id["bad"]["error"]["type"] == "RequestError"
    send({"id": "nb1", "session": "nb", "functions": ["lookup"], "code": "x = 1"})
    assert read()["step"] == 1
    send({"id": "nb2", "session": "nb", "code": "from readie_host import lookup\nprint(lookup(x))"})
    call = read()
    assert (call["event"], call["id"], call["function"], call["args"]) == ("call", "nb2", "lookup", [1])
    send({"reply": {"call_id": call["call_id"], "error": "not found"}})
    failed = read()
    assert (failed["id"], failed["step"], failed["error"]["type"]) == ("nb2", 2, "HostError")
    assert "not found" in failed["error"]["message"]
    send({"id": "s", "stats": True})
    stats = read()
    assert stats["event"] == "stats" and stats["request_errors"] == 1 and stats["sessions_active"] == 1
    assert stats["host"]["calls"] == 1
    inbox.put(None)
    assert list(stream) == []  # EOF: the session is closed, the stream ends


def test_a_router_drain_tells_its_balancers_first_and_ends_open_pool_sessions_as_its_failure(short_tmp):
    """SIGTERM: health NOT_SERVING while the port is still open; an open pool session's next step is
    PoolWorkerError with session_ended (the router's doing, not the client's)."""
    import json
    import queue
    import signal

    from grpc_health.v1 import health_pb2, health_pb2_grpc
    from readie_rpc.stubs import pool_pb2, pool_pb2_grpc

    cluster = start_cluster(short_tmp, CHECKPOINTS / "manifest.json", workers=1, router_args=["--drain-notice=3"])
    try:
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        stream = pool_pb2_grpc.PoolStub(cluster.channel).Session(iter(inbox.get, None), timeout=60)
        read = lambda: json.loads(next(stream).line)  # noqa: E731
        assert read()["event"] == "ready"
        inbox.put(pool_pb2.PoolInput(data=b'{"id": 1, "session": "nb", "code": "x = 1"}\n'))
        assert read()["step"] == 1
        cluster.router.send_signal(signal.SIGTERM)
        health = health_pb2_grpc.HealthStub(grpc.insecure_channel(cluster.address))
        assert wait_until(lambda: _status(health) == health_pb2.HealthCheckResponse.NOT_SERVING, 2)
        inbox.put(pool_pb2.PoolInput(data=b'{"id": 2, "session": "nb", "code": "print(x)"}\n'))
        late = read()
        assert (late["id"], late["error"]["type"], late["session_ended"]) == (2, "PoolWorkerError", True), late
        assert "ws-" not in late["error"]["message"]  # the client knows its session as "nb"
        inbox.put(None)
    finally:
        cluster.stop()


def _status(health) -> int | None:
    from grpc_health.v1 import health_pb2

    try:
        return health.Check(health_pb2.HealthCheckRequest(), timeout=1).status
    except grpc.RpcError:
        return None
