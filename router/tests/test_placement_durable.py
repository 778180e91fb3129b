"""Durable sessions through a router (decision 32): two fake workers sharing a fake store.

No runsc: each worker is a :class:`DurableRunner` (sessions with keys, detached into a
store both share) behind the real ``serve()``; the router is the real ``Placement``, and
for the client's side the real ``serve()`` over it, as ``readie router`` runs. Covered:

* the worker holding a session drains: the session's next step is placed on the other
  worker (attached without take_over), the session places move with it, nothing is lost;
* the worker's stream breaks under a step: StepLost (the session goes on), the worker is
  evicted, the next step takes the session over on the other;
* ``Placement.attach_session`` by key, and an unknown key refused as RequestError;
* a client's stream to the router cancelled: the session is detached on its worker, not
  closed, and a new stream attaches to it by key through the router and sees its state;
* the router drains: its client's stream ends with ``handed_over`` and the session is in
  the store; new calls are refused as not started;
* a ``Pool.Session`` stream that breaks detaches its pool sessions (a new stream attaches
  one by key and goes on); one the client half-closes closes them, as ever.
"""

from __future__ import annotations

import json
import queue
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import pytest

from readie_policy.jobs import CodeJob, HostReply, Step
from readie_protocol.errors import PoolWorkerError, RequestError, StepLost
from readie_router._placement import Placement
from readie_pool import PoolSetup
from readie_protocol.results import RuntimeInfo
from readie_router._pool_service import POOL_SERVICE, PoolServicer
from readie_rpc.stubs import pool_pb2, pool_pb2_grpc
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.stubs import worker_pb2_grpc as pb_grpc
from readie_rpc.client import WorkerClient
from readie_rpc.grpc_service import WorkerServer, serve
from rpc.tests._interact_fakes import DurableRunner, FakeStore, RawStream, open_message, step_message, wait_until

JOB = CodeJob("base", "open", timeout_ms=5000)


@dataclass
class Cluster:
    store: FakeStore
    workers: list[DurableRunner]
    servers: list[WorkerServer]
    placement: Placement

    def counts(self) -> list[tuple[int, int]]:
        with self.placement._roster.lock:
            return [(m.in_flight, m.sessions) for m in self.placement._roster.members]


@pytest.fixture
def cluster() -> Iterator[Cluster]:
    store = FakeStore()
    workers = [DurableRunner(store, f"w{i}") for i in range(2)]
    servers = [serve(worker, "127.0.0.1:0", name=worker.name) for worker in workers]  # type: ignore[arg-type]
    placement = Placement([server.address for server in servers], probe_interval_s=30, wait_s=5).start()
    yield Cluster(store, workers, servers, placement)
    for worker in workers:
        worker.release.set()
    placement.close()
    for server in servers:
        server.server.stop(0).wait()


def blocked_step(session) -> tuple[threading.Thread, list[BaseException]]:
    """A step that blocks in its fake worker, run on a thread; what it raised lands in the list."""
    raised: list[BaseException] = []

    def step() -> None:
        try:
            session.run_step(Step("block"))
        except BaseException as exc:  # noqa: BLE001 - the test inspects whatever it was
            raised.append(exc)

    thread = threading.Thread(target=step)
    thread.start()
    return thread, raised


def test_a_session_whose_worker_drains_goes_on_on_the_other(cluster):
    session, _ = cluster.placement.open_session(JOB)
    session.run_step(Step("a"))
    held = cluster.workers[0].sessions[0]
    cluster.servers[0].servicer.hand_over(5)
    outcome = session.run_step(Step("b"))
    assert not outcome.session_ended and outcome.step == 3
    assert held.steps == ["a", "b"] and held._runner is cluster.workers[1]
    assert cluster.store.attaches == [("w1", False)]
    assert cluster.counts() == [(0, 0), (0, 1)]  # the session's place moved with it
    session.close()
    assert cluster.counts() == [(0, 0), (0, 0)] and cluster.store.detached == {}


def test_a_step_lost_with_its_worker_is_lost_and_the_next_takes_the_session_over(cluster):
    session, _ = cluster.placement.open_session(JOB)
    thread, raised = blocked_step(session)
    assert wait_until(lambda: cluster.workers[0].sessions[0].steps == ["block"])
    cluster.servers[0].server.stop(0).wait()
    thread.join(10)
    assert isinstance(raised[0], StepLost) and not session.ended
    assert not cluster.placement._roster.members[0].healthy
    cluster.workers[0].release.set()  # the fake's driver lets go: the store has it (a checkpoint)
    assert wait_until(lambda: cluster.workers[0].sessions[0].key in cluster.store.detached)
    assert not session.run_step(Step("c")).session_ended
    assert cluster.store.attaches == [("w1", True)]
    assert cluster.counts() == [(0, 0), (0, 1)]


def test_work_sent_to_a_worker_gone_before_a_probe_noticed_goes_to_the_other(cluster):
    """A rolling restart: the worker's port refuses connections before the router's prober has
    seen it go. gRPC fails those calls at the connect, so nothing of them was sent: they are
    placed on the other worker, not answered as lost (the fault suite's "rolling restart")."""
    cluster.servers[0].server.stop(0).wait()
    assert cluster.placement._roster.members[0].healthy  # no probe yet: the router would choose it
    for _ in range(2):
        outcome = cluster.placement.run_job(JOB)
        assert outcome.error is None and outcome.stdout == "open", outcome
    session, first = cluster.placement.open_session(JOB)
    assert first.outcome.error is None and session.member is cluster.placement._roster.members[1]
    assert [len(w.sessions) for w in cluster.workers] == [0, 1]
    session.close()


def test_attach_by_key_places_the_session_and_an_unknown_key_is_refused(cluster):
    session, _ = cluster.placement.open_session(JOB)
    session.run_step(Step("a"))
    key = session.key
    session.detach()
    assert cluster.counts() == [(0, 0), (0, 0)]
    attached, step = cluster.placement.attach_session(key)
    assert step == 2 and attached.key == key
    assert attached.run_step(Step("b")).step == 3
    with pytest.raises(RequestError) as refused:
        cluster.placement.attach_session("k9-" + "z" * 40)
    assert refused.value.field == "attach"
    assert sum(sessions for _, sessions in cluster.counts()) == 1



def test_an_attach_that_met_a_lost_worker_asks_the_next_as_the_caller_asked_not_with_take_over(cluster):
    """The worker asked first is gone (a rolling restart): nothing says it held the session, whose
    live holder may be another worker still writing its newest state. A take-over would throw
    that away; the next worker is asked as the caller asked."""
    session, _ = cluster.placement.open_session(JOB)
    session.run_step(Step("a"))
    key = session.key
    session.detach()
    cluster.servers[0].server.stop(0).wait()  # chosen first (no load anywhere), and unreachable
    attached, step = cluster.placement.attach_session(key)
    assert step == 2 and cluster.store.attaches == [("w1", False)]
    attached.close()


def test_an_image_one_worker_refused_is_that_refusal_not_the_next_workers_unknown_key(cluster):
    """The first worker asked finds the stored image damaged and removes it: the caller hears that
    (SandboxSetupError), not the second worker's "no session under this key"."""
    from readie_protocol.errors import SandboxSetupError

    session, _ = cluster.placement.open_session(JOB)
    key = session.key
    session.detach()

    asked: list[str] = []

    def first_asked_refuses(worker):
        attach = worker.attach_session

        def attach_session(key: str, **fields: object):
            asked.append(worker.name)
            if len(asked) > 1:
                return attach(key, **fields)  # the entry is gone by now: "no session under this key"
            with cluster.store.lock:
                cluster.store.detached.pop(key, None)  # a refused entry is removed
            raise SandboxSetupError("the stored session failed verification and was removed")

        return attach_session

    for worker in cluster.workers:
        worker.attach_session = first_asked_refuses(worker)  # type: ignore[method-assign]
    with pytest.raises(SandboxSetupError, match="failed verification"):
        cluster.placement.attach_session(key)
    assert len(asked) == 2 and cluster.counts() == [(0, 0), (0, 0)]

@pytest.fixture
def router(cluster) -> Iterator[tuple[WorkerServer, pb_grpc.WorkerStub]]:
    """The router's own gRPC face over the cluster's placement, as ``readie router`` serves it."""
    server = serve(cluster.placement, "127.0.0.1:0", name="router")  # type: ignore[arg-type]
    channel = grpc.insecure_channel(server.address)
    yield server, pb_grpc.WorkerStub(channel)
    channel.close()
    server.server.stop(0).wait()


def test_a_cancelled_client_stream_detaches_and_a_new_one_attaches_by_key(cluster, router):
    _, stub = router
    stream = RawStream(stub, open_message("open"))
    key = stream.next().result.session_key
    assert key == cluster.workers[0].sessions[0].key or key == cluster.workers[1].sessions[0].key
    stream.send(step_message("a"))
    stream.next()
    stream.cancel()
    assert wait_until(lambda: key in cluster.store.detached)  # detached on its worker, not closed
    held = cluster.store.detached[key]
    assert held.detaches == 1

    again = RawStream(stub, pb.InteractRequest(attach=pb.AttachSession(key=key)))
    assert again.next().attached.step == 2
    again.send(step_message("b"))
    assert again.next().result.step == 3
    assert held.steps == ["a", "b"]
    wrong = RawStream(stub, pb.InteractRequest(attach=pb.AttachSession(key="k9-" + "z" * 40)))
    with pytest.raises(grpc.RpcError) as refused:
        wrong.next()
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    again.cancel()
    wrong.cancel()


def test_a_draining_router_hands_its_clients_sessions_over_and_refuses_new_work(cluster, router):
    server, stub = router
    stream = RawStream(stub, open_message("open"))
    key = stream.next().result.session_key
    server.servicer.hand_over(5)
    assert stream.next().handed_over.step == 1
    assert list(stream.call) == []
    assert key in cluster.store.detached  # its worker's stream ended without close: in the store
    with pytest.raises(grpc.RpcError) as refused:
        RawStream(stub, open_message("open")).next()
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert dict(refused.value.trailing_metadata()).get("readie-unstarted") == "1"


class PoolStream:
    """One Pool.Session call: JSON lines in when sent, lines out when read."""

    def __init__(self, stub: pool_pb2_grpc.PoolStub) -> None:
        self._lines: queue.SimpleQueue[pool_pb2.PoolInput | None] = queue.SimpleQueue()
        self.call = stub.Session(iter(self._lines.get, None), timeout=30)
        assert json.loads(next(self.call).line)["event"] == "ready"

    def ask(self, request: dict) -> dict:
        self._lines.put(pool_pb2.PoolInput(data=json.dumps(request).encode() + b"\n"))
        return json.loads(next(self.call).line)


def pool_service(cluster: Cluster, runner: object, name: str, **options: int) -> WorkerServer:
    """A Pool service over ``runner`` (the placement, or a WorkerClient of the router) on loopback."""
    setup = PoolSetup(workers=2, checkpoint="base", runtime=RuntimeInfo.pool("3.11.2"), cwd=Path("/tmp"))
    servicer = PoolServicer(setup, runner, **options)  # type: ignore[arg-type]
    return serve(
        cluster.placement, "127.0.0.1:0", name=name,  # type: ignore[arg-type]
        extra_services=[(POOL_SERVICE, lambda grpc_server: pool_pb2_grpc.add_PoolServicer_to_server(servicer, grpc_server))],
    )


def test_a_broken_pool_stream_detaches_its_sessions_and_a_half_closed_one_closes_them(cluster):
    server = pool_service(cluster, cluster.placement, "router")
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pool_pb2_grpc.PoolStub(channel)
        first = PoolStream(stub)
        key = first.ask({"id": 1, "session": "nb", "code": "a"})["session_key"]
        first.call.cancel()  # the client's connection breaks
        assert wait_until(lambda: key in cluster.store.detached)
        held = cluster.store.detached[key]
        assert held.detaches == 1 and held.steps == []

        second = PoolStream(stub)
        assert second.ask({"id": 2, "session": "nb", "attach": key})["attached"] is True
        assert second.ask({"id": 3, "session": "nb", "code": "b"})["exit"] == 0
        assert held.steps == ["b"]  # the same session went on
        second._lines.put(None)  # a half-close: the pool's sessions end with it
        assert list(second.call) == []
        assert wait_until(lambda: held.closed.is_set()) and key not in cluster.store.detached
        assert held.detaches == 1
    finally:
        channel.close()
        server.server.stop(0).wait()


def test_pool_streams_past_the_bound_are_refused_at_once_and_one_ending_gives_its_place_back(cluster):
    """Each Pool.Session stream holds a server thread while its client is connected, idle or not:
    past the bound a stream is refused, so the router's other calls keep their threads."""
    server = pool_service(cluster, cluster.placement, "router", max_streams=1)
    channel = grpc.insecure_channel(server.address)
    try:
        stub = pool_pb2_grpc.PoolStub(channel)
        first = PoolStream(stub)
        with pytest.raises(grpc.RpcError) as refused:
            PoolStream(stub)
        assert refused.value.code() == grpc.StatusCode.UNAVAILABLE and "pool streams open" in refused.value.details()
        assert first.ask({"id": 1, "code": "a"})["exit"] == 0  # the first is served meanwhile
        first._lines.put(None)
        assert list(first.call) == []
        assert wait_until(lambda: _served(stub))  # its engine done, its place is free again
    finally:
        channel.close()
        server.server.stop(0).wait()


def _served(stub: pool_pb2_grpc.PoolStub) -> bool:
    try:
        stream = PoolStream(stub)
    except grpc.RpcError:
        return False
    stream._lines.put(None)
    list(stream.call)
    return True


@pytest.mark.parametrize("through", ["router", "pool --router"])
def test_a_session_attached_by_key_keeps_its_host_functions_and_reports_its_policy(cluster, router, through):
    """``readie router``'s Pool service over its placement, or ``readie pool --router``'s engine
    over a WorkerClient of the router: an attached session's job is the one it opened with."""
    server, _ = router
    client = WorkerClient(server.address)
    runner = cluster.placement if through == "router" else client
    pool = pool_service(cluster, runner, "pool")
    channel = grpc.insecure_channel(pool.address)
    try:
        stub = pool_pb2_grpc.PoolStub(channel)
        first = PoolStream(stub)
        opened = first.ask({"id": 1, "session": "nb", "code": "a", "functions": ["f"], "timeout": 7})
        assert "session_key" in opened, opened["error"]
        key, policy = opened["session_key"], opened["policy"]
        first.call.cancel()
        assert wait_until(lambda: key in cluster.store.detached)
        held = cluster.store.detached[key]

        second = PoolStream(stub)
        assert second.ask({"id": 2, "session": "nb", "attach": key})["attached"] is True
        call = second.ask({"id": 3, "session": "nb", "code": "call 1"})
        assert (call["event"], call["function"]) == ("call", "f"), call
        result = second.ask({"reply": {"call_id": call["call_id"], "result": 7}})
        assert result["exit"] == 0 and result["policy"] == policy and policy["timeout_ms"] == 7000
        assert held.replies == [HostReply(result=7)]
        assert held.job.functions == ("f",)
    finally:
        channel.close()
        pool.server.stop(0).wait()
        client.close()


def test_a_re_attach_to_state_older_than_the_last_answered_step_is_refused_as_a_rollback(cluster):
    session, _ = cluster.placement.open_session(JOB)
    session.run_step(Step("a"))
    assert session.run_step(Step("b")).step == 3
    held = cluster.workers[0].sessions[0]
    cluster.servers[0].servicer.hand_over(5)
    assert wait_until(lambda: held.key in cluster.store.detached)
    held.steps.pop()  # the store's entry is an older generation put back (a rollback): step 2's state
    with pytest.raises(PoolWorkerError, match=r"stored state is from step 2, older than its last answered step 3"):
        session.run_step(Step("c"))
    assert session.ended and held.steps == ["a"]  # nothing ran on the old state
    assert cluster.store.attaches == [("w1", False)]
    assert wait_until(lambda: held.key in cluster.store.detached)  # its worker keeps the entry
    assert wait_until(lambda: cluster.counts() == [(0, 0), (0, 0)])


def test_a_take_over_from_older_state_runs_and_its_result_says_the_step_it_resumed_from(cluster, router):
    """Through the router's gRPC face, as ``readie pool --router`` reaches it: a crash loses the
    step that ran since the last checkpoint; the next step says which state it resumed from."""
    server, _ = router
    client = WorkerClient(server.address)
    try:
        session, _ = client.open_session(JOB)
        assert session.run_step(Step("a")).step == 2
        thread, raised = blocked_step(session)
        held = cluster.workers[0].sessions[0]
        assert wait_until(lambda: held.steps == ["a", "block"])
        cluster.servers[0].server.stop(0).wait()
        thread.join(10)
        assert isinstance(raised[0], StepLost) and not session.ended
        cluster.workers[0].release.set()
        assert wait_until(lambda: held.key in cluster.store.detached)
        held.steps.pop()  # its last checkpoint is from before the lost step
        after = session.run_step(Step("c"))
        assert (after.step, after.resumed_from_step, after.outcome.error) == (3, 2, None)
        assert cluster.store.attaches == [("w1", True)]
        session.close()
    finally:
        client.close()
