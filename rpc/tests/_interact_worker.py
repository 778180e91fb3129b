"""The real ``readie worker`` and raw Interact stream the ``test_interact_runsc_*`` modules share.

``worker`` is a module's ``readie worker`` process (one warm base sandbox),
checked at the module's end to have kept no sandbox beyond its warm pool
and to leave no runsc container; ``worker_dir`` is its short temp dir.
``Stream`` drives the raw generated stub, feeding its request stream from
a queue, so a test can send what no honest client would. Each test module
imports the fixtures it uses.
"""

from __future__ import annotations

import json
import queue
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc
import pytest

from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.testing import WorkerProcess, stop_worker
from readie_worker.testing import wait_until as wait_for
from readie_rpc.testing import start_worker as _start_worker

from conftest import CHECKPOINTS

WARM = 1  # base sandboxes the module's worker keeps ready
# gRPC deadline of every raw stream: far above any job here, so a hung worker fails the test.
STREAM_DEADLINE_S = 60
# How long a sandbox may take to be destroyed once its session ended.
GONE_WITHIN_S = 10
JOB_TIMEOUT_MS = 20_000


def start_worker(base: Path, name: str) -> WorkerProcess:
    return _start_worker(base, name, CHECKPOINTS / "manifest.json", f"base={WARM}")


@pytest.fixture(scope="module")
def worker_dir() -> Iterator[Path]:
    path = Path(tempfile.mkdtemp(prefix="ri-", dir="/tmp"))  # short: sandbox socket paths
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def worker(worker_dir: Path) -> Iterator[WorkerProcess]:
    process = start_worker(worker_dir / "a", "interact-a")
    yield process
    wait_until(lambda: only_warm(process), "the worker kept sandboxes beyond its warm pool")
    assert stop_worker(process) == 0, process.log_path.read_text()[-3000:]
    assert process.containers() == []


# --------------------------------------------------------------------------- helpers


class Stream:
    """One raw Interact call whose requests the test writes one by one; ``close`` half-closes."""

    def __init__(
        self, stub: pb_grpc.WorkerStub, *first: pb.InteractRequest, deadline_s: float = STREAM_DEADLINE_S
    ) -> None:
        self._requests: queue.SimpleQueue[pb.InteractRequest | None] = queue.SimpleQueue()
        for request in first:
            self._requests.put(request)
        self.call = stub.Interact(iter(self._requests.get, None), timeout=deadline_s)

    def send(self, **kind: object) -> None:
        self._requests.put(pb.InteractRequest(**kind))

    def reply(self, call_id: int, result: object = None, **outcome: object) -> None:
        if not outcome:
            outcome = {"result_json": json.dumps(result).encode()}
        self.send(reply=pb.HostReply(call_id=call_id, **outcome))

    def step(self, code: str, **fields: object) -> None:
        self.send(step=pb.SessionStep(code=code, **fields))

    def close(self) -> None:
        self._requests.put(None)

    def event(self, kind: str) -> pb.HostCall | pb.RunJobResponse:
        event = next(self.call)
        assert event.WhichOneof("kind") == kind, event
        return getattr(event, kind)

    def result(self) -> pb.RunJobResponse:
        return self.event("result")  # type: ignore[return-value]

    def host_call(self) -> pb.HostCall:
        return self.event("call")  # type: ignore[return-value]

    def ends_ok(self) -> None:
        assert list(self.call) == []
        assert self.call.code() == grpc.StatusCode.OK

    def refused(self) -> grpc.RpcError:
        """The status the stream ends with, after no further events."""
        with pytest.raises(grpc.RpcError) as ended:
            assert list(self.call) == []
        return ended.value


def job(code: str, functions: tuple[str, ...] = (), **fields: object) -> pb.RunJobRequest:
    fields.setdefault("timeout_ms", JOB_TIMEOUT_MS)
    return pb.RunJobRequest(checkpoint="base", code=code, name="cell.py", functions=functions, **fields)


def open_stream(
    stub: pb_grpc.WorkerStub, kind: str, code: str, functions: tuple[str, ...] = (), **fields: object
) -> Stream:
    return Stream(stub, pb.InteractRequest(**{kind: job(code, functions, **fields)}))


def invalid_argument(error: grpc.RpcError, field: str) -> None:
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, error
    assert dict(error.trailing_metadata()) == {"readie-error": "RequestError", "readie-field": field}
    assert error.details().startswith(f"{field}: ")


def capacity(worker: WorkerProcess) -> pb.CapacityResponse:
    return worker.stub.Capacity(pb.CapacityRequest(), timeout=5)


def wait_until(condition: Callable[[], bool], failure: str, within_s: float = GONE_WITHIN_S) -> None:
    assert wait_for(condition, within_s, poll_s=0.05), failure


def only_warm(worker: WorkerProcess) -> bool:
    """No job, no session, and no sandbox beyond the warm pool's (ready, or one being restored)."""
    reply = capacity(worker)
    targets = sum(pool.target for pool in reply.pools.values())
    return reply.busy == 0 and reply.sessions == 0 and len(worker.containers()) <= targets


def session_gone(worker: WorkerProcess, sandbox_id: str) -> None:
    wait_until(
        lambda: sandbox_id not in worker.containers() and only_warm(worker),
        f"session sandbox {sandbox_id} outlived its session",
    )


def unary_job(worker: WorkerProcess, code: str) -> pb.RunJobResponse:
    """A unary job: the worker still serves after whatever came before."""
    return worker.stub.RunJob(job(code), timeout=STREAM_DEADLINE_S)
