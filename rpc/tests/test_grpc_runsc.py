"""`readie worker` as a real process: gRPC on loopback, gVisor sandboxes from the real checkpoints.

The tests play the client: they send jobs and cloudpickled calls, check
health, reflection and capacity, and end the process with SIGTERM, after which
its runsc state dir must list no containers. A second process proves that two
workers on one host keep to their own ports and state dirs.
"""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import cloudpickle
import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.grpc_service import WORKER_PROTOCOL

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

from readie_rpc.testing import EXIT_TIMEOUT_S, NOT_SERVING, SERVING, WorkerProcess, stop_worker  # noqa: E402
from readie_worker.testing import free_port  # noqa: E402
from readie_rpc.testing import ceiling_file  # noqa: E402
from readie_rpc.testing import start_worker as _start_worker  # noqa: E402


def start_worker(base: Path, name: str, warm: str = "base=1") -> WorkerProcess:
    # Under a ceiling that grants the tests' temp dirs: without one a network worker grants nothing.
    return _start_worker(base, name, CHECKPOINTS / "manifest.json", warm, args=[f"--config={CEILING}"])


CEILING = Path("/nonexistent")  # the module fixture's file while the module runs


@pytest.fixture(scope="module", autouse=True)
def _ceiling():
    """Made when the module runs (not when it is collected), and removed after it."""
    global CEILING
    CEILING = ceiling_file()
    yield
    shutil.rmtree(CEILING.parent, ignore_errors=True)


@pytest.fixture(scope="module")
def worker_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="rg-", dir="/tmp"))  # short: sandbox socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def worker(worker_dir: Path) -> Iterator[WorkerProcess]:
    process = start_worker(worker_dir, "worker-a")
    yield process
    assert stop_worker(process) == 0, process.log_path.read_text()[-3000:]
    assert process.containers() == []


def run(worker: WorkerProcess, code: str, timeout: float = 30, **fields) -> pb.RunJobResponse:
    return worker.stub.RunJob(pb.RunJobRequest(checkpoint=fields.pop("checkpoint", "base"), code=code, **fields), timeout=timeout)


def refusal(call) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as refused:
        call()
    return refused.value


def test_health_is_serving_and_reflection_lists_the_services(worker):
    assert worker.health_status() == SERVING
    assert worker.health_status("readie.v1.Worker") == SERVING
    reflection = reflection_pb2_grpc.ServerReflectionStub(worker.channel)
    requests = [
        reflection_pb2.ServerReflectionRequest(list_services=""),
        reflection_pb2.ServerReflectionRequest(file_containing_symbol="readie.v1.Worker"),
    ]
    listed, symbol = list(reflection.ServerReflectionInfo(iter(requests), timeout=10))
    services = {service.name for service in listed.list_services_response.service}
    assert {"readie.v1.Worker", "grpc.health.v1.Health"} <= services
    assert b"readie/v1/worker.proto" in symbol.file_descriptor_response.file_descriptor_proto[0]


def test_capacity_reports_slots_pools_and_the_protocol(worker):
    reply = worker.stub.Capacity(pb.CapacityRequest(), timeout=5)
    assert (reply.slots, reply.draining, reply.isolated, reply.worker_name) == (2, False, True, "worker-a")
    assert reply.protocol == WORKER_PROTOCOL
    assert reply.pools["base"].target == 1
    assert set(reply.pools) == {checkpoint["name"] for checkpoint in json.loads((CHECKPOINTS / "manifest.json").read_text())["checkpoints"]}


def test_a_job_prints_in_a_restored_gvisor_sandbox(worker):
    reply = run(worker, "import sys\nprint('hello over grpc', sys.argv[1:])", args=["a", "b"])
    assert (reply.exit, reply.stdout, reply.HasField("error")) == (0, "hello over grpc ['a', 'b']\n", False)
    assert reply.backend == "gvisor:runsc-restore" and reply.sandbox_id.startswith("rd-")
    assert reply.python.startswith("3.11") and reply.duration_us > 0


def test_a_failing_job_is_ok_at_the_rpc_level_with_its_error(worker):
    reply = run(worker, "x = 1\nraise ValueError('bad value')\n", name="step.py")
    assert reply.exit == 1
    assert (reply.error.type, reply.error.message, reply.error.file, reply.error.line) == ("ValueError", "bad value", "step.py", 2)


def test_request_errors_are_invalid_argument_naming_the_field(worker, tmp_path):
    unknown = refusal(lambda: run(worker, "pass", checkpoint="no-such-checkpoint"))
    assert unknown.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(unknown.trailing_metadata())["readie-field"] == "checkpoint"
    assert "no-such-checkpoint" in unknown.details()

    manifest = json.loads((CHECKPOINTS / "manifest.json").read_text())
    too_many = [str(tmp_path / f"d{i}") for i in range(manifest["mount_plan"]["read"] + 1)]  # distinct: repeats merge
    for path in too_many:
        Path(path).mkdir()
    grants = refusal(lambda: run(worker, "pass", allow_read=too_many))
    assert grants.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert dict(grants.trailing_metadata()) == {"readie-error": "RequestError", "readie-field": "allow_read"}
    assert "slots" in grants.details()

    negative = refusal(lambda: run(worker, "pass", timeout_ms=-5))
    assert (negative.code(), dict(negative.trailing_metadata())["readie-field"]) == (grpc.StatusCode.INVALID_ARGUMENT, "timeout_ms")


def _square_and_shout(x: int) -> dict:
    import sys

    print("computing in the sandbox")
    return {"square": x * x, "python": sys.version_info[:2]}


def _raise_lookup() -> None:
    raise LookupError("not in the sandbox either")


def _sleep(seconds: float) -> None:
    import time

    time.sleep(seconds)


def _call(func, *args) -> bytes:
    module = sys.modules[__name__]
    cloudpickle.register_pickle_by_value(module)  # the sandbox cannot import this test module
    try:
        return cloudpickle.dumps({"func": func, "args": args, "kwargs": {}})
    finally:
        cloudpickle.unregister_pickle_by_value(module)


def test_execute_runs_a_cloudpickled_function_and_returns_its_envelope(worker):
    reply = worker.stub.Execute(pb.ExecuteRequest(checkpoint="base", payload=_call(_square_and_shout, 12)), timeout=30)
    envelope = cloudpickle.loads(reply.envelope)  # we are the client: it is our own function's answer
    assert envelope == {"ok": True, "value": {"square": 144, "python": (3, 11)}, "output": ["computing in the sandbox\n"]}
    assert reply.duration_us > 0

    failed = cloudpickle.loads(worker.stub.Execute(pb.ExecuteRequest(checkpoint="base", payload=_call(_raise_lookup)), timeout=30).envelope)
    assert (failed["ok"], failed["exc_type"], failed["message"]) == (False, "LookupError", "not in the sandbox either")


def test_an_execute_past_its_timeout_is_deadline_exceeded(worker):
    late = refusal(lambda: worker.stub.Execute(pb.ExecuteRequest(checkpoint="base", payload=_call(_sleep, 30), timeout_ms=1000), timeout=30))
    assert late.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert dict(late.trailing_metadata())["readie-error"] == "ExecutorTimeout"


def test_the_callers_deadline_ends_a_job_that_asked_for_longer(worker):
    started = time.monotonic()
    code = "print('partial', flush=True)\nwhile True:\n    pass\n"
    late = run(worker, code, timeout=3, timeout_ms=600_000)
    # The job's timeout became the deadline less the answer's margin: the caller
    # gets the job's own TimeoutError, with what it printed, before its deadline.
    assert (late.error.type, late.stdout) == ("TimeoutError", "partial\n"), late
    assert time.monotonic() - started < 3
    # The sandbox is killed at the caller's deadline, not after ten minutes: the slot frees up.
    while worker.stub.Capacity(pb.CapacityRequest(), timeout=5).busy:
        assert time.monotonic() - started < 15, "the job outlived its caller's deadline"
        time.sleep(0.1)


def test_two_workers_serve_at_once_each_in_its_own_state_dir(worker):
    second_dir = Path(tempfile.mkdtemp(prefix="rg-", dir="/tmp"))
    second = start_worker(second_dir, "worker-b")
    try:
        assert second.port != worker.port and second.state_dir != worker.state_dir
        assert second.stub.Capacity(pb.CapacityRequest(), timeout=5).worker_name == "worker-b"
        replies: dict[str, pb.RunJobResponse] = {}
        code = "import time\ntime.sleep(2)\nprint('done')"
        threads = [
            threading.Thread(target=lambda key=key, target=target: replies.__setitem__(key, run(target, code)))
            for key, target in (("a", worker), ("b", second))
        ]
        for thread in threads:
            thread.start()
        # While the jobs run, each state dir holds its own worker's sandboxes only: collect
        # what each lists until both are done (a single snapshot races the restore).
        seen_a: set[str] = set()
        seen_b: set[str] = set()
        both_busy = False
        deadline = time.monotonic() + 60
        while any(thread.is_alive() for thread in threads) and time.monotonic() < deadline:
            busy = [w.stub.Capacity(pb.CapacityRequest(), timeout=5).busy for w in (worker, second)]
            both_busy = both_busy or all(busy)
            seen_a |= set(worker.containers())
            seen_b |= set(second.containers())
            time.sleep(0.05)
        for thread in threads:
            thread.join(30)
        assert both_busy, "the two jobs never ran at the same time"
        assert all(reply.exit == 0 and reply.stdout == "done\n" for reply in replies.values()), replies
        assert replies["a"].sandbox_id != replies["b"].sandbox_id
        assert replies["a"].sandbox_id in seen_a and replies["a"].sandbox_id not in seen_b
        assert replies["b"].sandbox_id in seen_b and replies["b"].sandbox_id not in seen_a
    finally:
        code = stop_worker(second)
        leftovers = second.containers()
        shutil.rmtree(second_dir, ignore_errors=True)
    assert (code, leftovers) == (0, [])


def test_sigterm_finishes_the_running_job_refuses_new_work_and_exits_0(worker):
    marker = "CAPTURED-OUTPUT-NEVER-LOGGED"
    running = worker.stub.RunJob.future(
        pb.RunJobRequest(checkpoint="base", code=f"import time\ntime.sleep(3)\nprint({marker!r})"), timeout=60
    )
    deadline = time.monotonic() + 20
    while not worker.stub.Capacity(pb.CapacityRequest(), timeout=5).busy:
        assert time.monotonic() < deadline, "the job never started"
        time.sleep(0.05)

    worker.process.send_signal(signal.SIGTERM)
    while worker.health_status() != NOT_SERVING:
        assert time.monotonic() < deadline + 5, "health never turned NOT_SERVING"
        time.sleep(0.05)
    refused = refusal(lambda: run(worker, "print('too late')"))
    assert refused.code() == grpc.StatusCode.UNAVAILABLE

    reply = running.result()
    assert (reply.exit, reply.stdout) == (0, marker + "\n")
    assert worker.process.wait(EXIT_TIMEOUT_S) == 0
    assert worker.containers() == []

    lines = worker.log_lines()
    assert marker not in worker.log_path.read_text()
    jobs = [line for line in lines if line.get("event") == "job" and line.get("sandbox") == reply.sandbox_id]
    assert len(jobs) == 1 and jobs[0]["exit"] == 0 and jobs[0]["duration_us"] > 0
    assert any(line.get("event") == "drained" for line in lines)
