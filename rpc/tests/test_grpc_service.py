"""The gRPC wiring over a fake worker, on loopback: deadlines, limits, bugs, drain.

The fake stands in only for the worker's lifecycle; what these tests prove is
the service around it (grpc's own deadline and size handling, health, the
status on the wire). Real sandboxes behind a real process: test_grpc_runsc.py.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_policy.jobs import Capacity
from readie_worker.errors import SandboxSetupError
from readie_rpc.grpc_service import WORKER_PROTOCOL, WorkerServer, serve
from readie_worker.jobs import CodeJob, JobOutcome


@dataclass
class _Config:
    slots: int = 2


@dataclass
class FakeWorker:
    config: _Config = field(default_factory=_Config)
    jobs: list[CodeJob] = field(default_factory=list)
    calls: list[tuple[str, bytes, float]] = field(default_factory=list)
    envelope: bytes = b"envelope"
    fail_with: BaseException | None = None
    draining: bool = False
    closed: int = 0
    release: threading.Event = field(default_factory=threading.Event)
    hold: bool = False
    hands_sessions_over: bool = False  # no store: its sessions end with its drain

    def run_job(self, job: CodeJob, job_id: str | None = None, cancel=None, output=None) -> JobOutcome:
        if self.draining:
            raise SandboxSetupError("the worker is draining and takes no new work")
        if self.fail_with is not None:
            raise self.fail_with
        self.jobs.append(job)
        if self.hold:
            self.release.wait(10)
        return JobOutcome(0, "out", "", False, False, None, 10, "3.11.2", (), "rd-fake", "fake")

    def execute_call(self, checkpoint: str, payload: bytes, timeout_s: float, max_response: int | None = None, cancel=None) -> bytes:
        self.calls.append((checkpoint, payload, timeout_s))
        return self.envelope

    def capacity(self) -> Capacity:
        return Capacity(slots=2, busy=len(self.jobs), draining=self.draining, warm={"base": {"ready": 1, "target": 1}}, isolated=False)

    def drain(self, grace_s: float) -> None:
        self.draining = True
        self.release.set()

    def close(self) -> None:
        self.closed += 1


@pytest.fixture
def served():
    worker = FakeWorker()
    server = serve(worker, "127.0.0.1:0", name="fake", max_message_bytes=64 * 1024)  # type: ignore[arg-type]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    yield worker, server, pb_grpc.WorkerStub(channel), channel
    channel.close()
    server.server.stop(0).wait()


def test_capacity_reports_name_protocol_and_pools(served):
    worker, _, stub, _ = served
    reply = stub.Capacity(pb.CapacityRequest(), timeout=5)
    assert (reply.worker_name, reply.protocol, reply.slots) == ("fake", WORKER_PROTOCOL, 2)
    assert reply.pools["base"] == pb.PoolState(ready=1, target=1)


def test_the_callers_deadline_shortens_the_job_timeout(served):
    worker, _, stub, _ = served
    stub.RunJob(pb.RunJobRequest(checkpoint="base", code="pass", timeout_ms=600_000), timeout=4)
    # grpc rounds the deadline on the wire up a little: allow 100 ms of slack.
    assert 2000 < worker.jobs[-1].timeout_ms <= 4100
    stub.RunJob(pb.RunJobRequest(checkpoint="base", code="pass", timeout_ms=1500), timeout=60)
    assert worker.jobs[-1].timeout_ms == 1500
    stub.Execute(pb.ExecuteRequest(checkpoint="base", payload=b"p"), timeout=3)
    assert 1.0 < worker.calls[-1][2] <= 3.1


def test_an_invalid_request_is_refused_before_the_worker_sees_it(served):
    worker, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as refused:
        stub.RunJob(pb.RunJobRequest(checkpoint="base", code="pass", env={"A=B": "x"}), timeout=5)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(refused.value.trailing_metadata())["readie-field"] == "env"
    assert worker.jobs == []


def test_a_message_over_the_limit_is_refused_by_grpc(served):
    _, _, stub, _ = served
    with pytest.raises(grpc.RpcError) as refused:
        stub.Execute(pb.ExecuteRequest(checkpoint="base", payload=b"x" * (128 * 1024)), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED


def test_an_envelope_over_the_limit_is_resource_exhausted(served, monkeypatch):
    worker, _, stub, _ = served
    from readie_rpc import grpc_service

    monkeypatch.setattr(grpc_service, "MAX_ENVELOPE_BYTES", 4)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Execute(pb.ExecuteRequest(checkpoint="base", payload=b"p"), timeout=5)
    assert refused.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert dict(refused.value.trailing_metadata())["readie-error"] == "ResponseTooLarge"


def test_a_bug_is_internal_without_its_message(served):
    worker, _, stub, _ = served
    worker.fail_with = KeyError("secret-token")
    with pytest.raises(grpc.RpcError) as failed:
        stub.RunJob(pb.RunJobRequest(checkpoint="base", code="pass"), timeout=5)
    assert failed.value.code() == grpc.StatusCode.INTERNAL
    assert "secret-token" not in failed.value.details()


def test_drain_turns_health_not_serving_finishes_the_running_job_and_stops(served):
    worker, server, stub, channel = served
    health = health_pb2_grpc.HealthStub(channel)
    assert health.Check(health_pb2.HealthCheckRequest(service="readie.v1.Worker"), timeout=5).status == health_pb2.HealthCheckResponse.SERVING
    worker.hold = True
    running = stub.RunJob.future(pb.RunJobRequest(checkpoint="base", code="pass"), timeout=10)
    while not worker.jobs:
        threading.Event().wait(0.01)
    statuses = []
    original_drain = worker.drain

    def drain_and_look(grace_s: float) -> None:
        # While the worker drains, health already says NOT_SERVING.
        statuses.append(health.Check(health_pb2.HealthCheckRequest(service=""), timeout=5).status)
        original_drain(grace_s)

    worker.drain = drain_and_look  # type: ignore[method-assign]
    server.drain(grace_s=5)
    assert statuses == [health_pb2.HealthCheckResponse.NOT_SERVING]
    assert running.result().stdout == "out"
    assert worker.closed == 1
    with pytest.raises(grpc.RpcError) as after:
        stub.Capacity(pb.CapacityRequest(), timeout=2)
    assert after.value.code() == grpc.StatusCode.UNAVAILABLE
    assert isinstance(server, WorkerServer)


@pytest.mark.parametrize("version", ["v1", "v1alpha"])
def test_reflection_answers_as_v1_and_v1alpha(served, version):
    """Tools (grpcurl, grpc-requests, Postman) ask grpc.reflection.v1 first now; older ones v1alpha."""
    from grpc_reflection.v1alpha import reflection_pb2

    _, _, _, channel = served
    method = channel.stream_stream(
        f"/grpc.reflection.{version}.ServerReflection/ServerReflectionInfo",
        request_serializer=reflection_pb2.ServerReflectionRequest.SerializeToString,
        response_deserializer=reflection_pb2.ServerReflectionResponse.FromString,
    )
    [answer] = list(method(iter([reflection_pb2.ServerReflectionRequest(list_services="")]), timeout=5))
    names = {service.name for service in answer.list_services_response.service}
    assert {"readie.v1.Worker", "grpc.health.v1.Health", "grpc.reflection.v1.ServerReflection"} <= names



def test_callers_without_the_token_that_never_send_their_request_hold_no_service_thread():
    """A unary call's thread waits for its request as long as its caller keeps the call open.
    Callers without the token that send only headers, to the service and to health (open), must
    leave the service's threads to the token's holder, and health a thread of its own."""
    from readie_rpc.grpc_service import HEALTH_THREADS
    from readie_rpc.security import ServerSecurity

    token = "t" * 32
    server = serve(FakeWorker(), "127.0.0.1:0", name="fake", threads=3, security=ServerSecurity(token=token))  # type: ignore[arg-type]
    channel = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    stop = threading.Event()

    def headers_only() -> Iterator[bytes]:  # grpc sends the call's headers, then waits here for a request
        stop.wait()
        yield from ()

    try:
        refused = [channel.stream_unary("/readie.v1.Worker/Capacity").future(headers_only(), timeout=30) for _ in range(6)]
        held = [channel.stream_unary("/grpc.health.v1.Health/Check").future(headers_only(), timeout=30)
                for _ in range(HEALTH_THREADS - 1)]
        for call in refused:  # at once, nothing read
            assert call.exception(timeout=5).code() == grpc.StatusCode.UNAUTHENTICATED
        authorized = pb_grpc.WorkerStub(channel).Capacity(pb.CapacityRequest(), timeout=5,
                                                            metadata=[("authorization", f"Bearer {token}")])
        assert authorized.worker_name == "fake"
        probe = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=""), timeout=5)
        assert probe.status == health_pb2.HealthCheckResponse.SERVING
        assert not any(call.done() for call in held)  # they do hold health's threads, all but one
    finally:
        stop.set()
        channel.close()
        server.server.stop(0).wait()
