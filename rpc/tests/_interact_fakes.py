"""The fake runner and stream helpers the ``test_interact_streams_*`` modules share.

A fake runner (jobs and session steps that block on an Event, raise, end
the session or make host calls) stands in for the worker behind the real
``serve()`` on loopback; ``serve_fake`` starts one per call and stops them
all at the end. ``hang_ups`` spies on ``Interaction._hang_up`` (the RPC's
end callback), for tests that must know the server has seen a cancellation.
Each test module imports the fixtures it uses.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable, Iterator

import grpc
import pytest

from readie_executor.jobs import bounds

from readie_worker.testing import wait_until as wait_for
from readie_rpc._interact import Interaction
from readie_rpc._proto.readie.v1 import worker_pb2 as pb
from readie_rpc._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from readie_rpc.client import WorkerClient
from readie_policy.jobs import Capacity
from readie_worker.errors import PoolWorkerError, RequestError
from readie_protocol.errors import StepLost
from readie_protocol.events import Value
from readie_protocol.workspace import Collected, FileChunk, FileEntry, FileListing
from readie_rpc.grpc_service import WorkerServer, serve
from readie_worker.jobs import CodeJob, HostCall, HostReply, JobOutcome
from readie_worker.sessions import StepOutcome

WAIT_S = 5.0  # the most any bounded wait below takes when things go right


# --------------------------------------------------------------------------- the fake runner


def _ok(text: str) -> JobOutcome:
    return JobOutcome(0, text, "", False, False, None, 1, "", (), None, "fake")


class MemoryWorkspace:
    """A session's workspace as a dict of path to bytes, with ``SessionHandle``'s file methods
    (runner.py) and the refusals a worker makes; ``gate``, when set, holds every file request
    until it is set (a transfer that takes long)."""

    def __init__(self, transfer_bytes: int = 64 * 1024 * 1024) -> None:
        self.files: dict[str, bytearray] = {}
        self.transfer_bytes = transfer_bytes
        self.gate: threading.Event | None = None
        self.waiting = threading.Event()  # a file request waits at the gate
        self.failure: Exception | None = None  # what every file request raises, when set

    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel=None) -> int:
        self._wait()
        if size > self.transfer_bytes:
            raise RequestError(f"{size} bytes; at most {self.transfer_bytes} move", field="upload.size")
        if offset == 0:
            self.files[path] = bytearray()
        held = self.files.get(path, bytearray())
        if offset != len(held):
            raise RequestError(f"{offset} is not where {path!r} ends ({len(held)})", field="upload.offset")
        held += data
        return len(held)

    def download_chunk(self, path: str, offset: int, length: int, *, cancel=None) -> FileChunk:
        self._wait()
        if path not in self.files:
            raise RequestError(f"no file {path!r} in the workspace", field="download.path")
        data = self.files[path]
        return FileChunk(path, offset, len(data), 1_000, bytes(data[offset : offset + length]))

    def list_files(self, path: str, *, cancel=None) -> FileListing:
        self._wait()
        prefix = "" if path == "." else path + "/"
        names = {name[len(prefix):].split("/")[0] for name in self.files if name.startswith(prefix)}
        entries = tuple(
            FileEntry(name, len(self.files.get(prefix + name, b"")), "file" if prefix + name in self.files else "dir")
            for name in sorted(names)
        )
        return FileListing(path, entries)

    def _wait(self) -> None:
        if self.gate is not None:
            self.waiting.set()
            self.gate.wait(30)
        if self.failure is not None:
            raise self.failure


class FakeSession(MemoryWorkspace):
    """Steps by code: ``block`` waits for the runner's release, ``exit`` ends the session,
    ``call N`` makes N host calls (5 s deadline each); anything else returns at once."""

    def __init__(self, runner: FakeRunner, number: int) -> None:
        super().__init__()
        self._runner = runner
        self.id = f"fs-{number}"
        self.steps: list[str] = []  # codes, recorded as each step starts
        self.replies: list[HostReply] = []
        self.ended = False
        self.closed = threading.Event()

    def run_step(self, step, *, job_id=None, host=None, cancel=None, output=None):
        code = step.code
        self.steps.append(code)
        if code == "block":
            self._runner.release.wait(30)
        if code.startswith("call"):
            for call_id in range(1, int(code.split()[1]) + 1):
                self.replies.append(host(HostCall(call_id, "f", (), {}, time.monotonic() + 5)))
        if code == "exit":
            self.ended = True
        return StepOutcome(_ok(code), len(self.steps) + 1, code == "exit")

    def close(self) -> None:
        self.ended = True
        self.closed.set()


class FakeRunner:
    """The runner shape (runner.JobRunner) plus capacity/drain/close; jobs and openings by code.

    ``block`` waits for ``release``; ``raise`` is a bug; ``fail`` a PoolWorkerError;
    ``call N DEADLINE_S [ARG_BYTES]`` makes N host calls sharing one deadline. A job that asks
    to collect gets its own ``files`` back (``big N``: and one of N bytes).
    """

    hands_sessions_over = False  # sessions of its own: they end with its drain

    def __init__(self) -> None:
        self.release = threading.Event()
        self.lock = threading.Lock()
        self.running = 0
        self.finished = 0
        self.sessions: list[FakeSession] = []
        self.replies: list[tuple[HostReply, float]] = []  # a job's host replies, seconds after the job began
        # Replies handed to a job's calls' reply_now, as a worker's sandbox would take them early:
        # (call id, the thread that sent it, the reply).
        self.early: list[tuple[int, str, HostReply]] = []
        self.job_done = threading.Event()

    def capacity(self) -> Capacity:
        return Capacity(2, self.running, False, {}, True, sum(not s.closed.is_set() for s in self.sessions), 4)

    def run_job(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None) -> JobOutcome:
        with self.lock:
            self.running += 1
        try:
            started = time.monotonic()
            word, *rest = job.code.split()
            if word == "block":
                self.release.wait(30)
            elif word == "raise":
                raise RuntimeError("a bug in the fake runner")
            elif word == "fail":
                raise PoolWorkerError("the fake worker failed the job")
            elif word == "call":
                calls, deadline = int(rest[0]), started + float(rest[1])
                payload = "x" * int(rest[2]) if len(rest) > 2 else None
                for call_id in range(1, calls + 1):
                    def reply_now(reply: HostReply, call_id: int = call_id) -> bool:
                        self.early.append((call_id, threading.current_thread().name, reply))
                        return True

                    call = HostCall(call_id, "f", (payload,) if payload else (), {}, deadline, reply_now=reply_now)
                    reply = host(call)
                    self.replies.append((reply, time.monotonic() - started))
                self.job_done.set()
            if job.collect:  # the job's own files come back, and ``big N`` adds one of N bytes
                files = dict(job.files)
                if word == "big":  # and as much output as a sandbox writes
                    files["big.bin"] = b"\xa5" * int(rest[0])
                    out = "o" * bounds.MAX_OUTPUT_LIMIT
                    value = Value("v" * bounds.MAX_VALUE_TEXT, False, {"text/html": "h" * bounds.MAX_DISPLAY_BYTES}, ())
                    return dataclasses.replace(_ok(out), stderr=out, value=value, collected=Collected(files))
                return dataclasses.replace(_ok(job.code), collected=Collected(files))
            return _ok(job.code)
        finally:
            with self.lock:
                self.running -= 1
                self.finished += 1

    def open_session(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None):
        with self.lock:
            session = FakeSession(self, len(self.sessions) + 1)
            self.sessions.append(session)
        session.job = job  # the opening, as a worker keeps it
        if job.code == "block":
            self.release.wait(30)
        return session, StepOutcome(_ok(job.code), 1, job.code == "exit")

    def drain(self, grace_s: float) -> None:
        pass

    def close(self) -> None:
        pass


# --------------------------------------------------------------------------- durable sessions (decision 32)


class FakeStore:
    """Detached sessions by key, shared by the fake runners that stand for workers sharing a store."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.detached: dict[str, DurableSession] = {}
        self.attaches: list[tuple[str, bool]] = []  # (runner name, take_over), in order


class DurableSession(FakeSession):
    """A FakeSession with a key: ``detach`` puts it in the store, and an attach (on any runner
    sharing the store) continues it, its steps (its "state") and all. ``lose`` raises StepLost."""

    def __init__(self, runner: DurableRunner, number: int) -> None:
        super().__init__(runner, number)
        self.key = f"k{number}-" + "x" * 40
        self.detaches = 0
        self.taken_over_at: int | None = None  # the stored step a take-over resumed it from

    def run_step(self, step, *, job_id=None, host=None, cancel=None, output=None):
        if step.code == "lose":
            raise StepLost("the worker running the step was lost")
        outcome = super().run_step(step, job_id=job_id, host=host, cancel=cancel, output=output)
        resumed_from, self.taken_over_at = self.taken_over_at, None
        return dataclasses.replace(outcome, resumed_from_step=resumed_from)

    def detach(self, cancel=None) -> None:
        store = self._runner.store
        with store.lock:
            self.detaches += 1
            self.ended = True
            store.detached[self.key] = self
        self.closed.set()

    def close(self) -> None:
        with self._runner.store.lock:
            self._runner.store.detached.pop(self.key, None)
        super().close()


class DurableRunner(FakeRunner):
    """A FakeRunner whose sessions have keys and live on in ``store`` when detached."""

    def __init__(self, store: FakeStore | None = None, name: str = "fake") -> None:
        super().__init__()
        self.store = store or FakeStore()
        self.name = name
        self.hands_sessions_over = True  # as a worker with a shared store: each stream detaches its own

    def open_session(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None):
        with self.lock:
            session = DurableSession(self, len(self.sessions) + 1)
            self.sessions.append(session)
        session.job = job  # the opening, as a worker keeps it (a pool reports its policy from it)
        return session, StepOutcome(_ok(job.code), 1, job.code == "exit")

    def attach_session(self, key: str, *, take_over: bool = False, cancel=None):
        with self.store.lock:
            session = self.store.detached.pop(key, None)
            self.store.attaches.append((self.name, take_over))
        if session is None:
            raise RequestError("no session is stored under this key", field="attach")
        session._runner = self  # held here now
        session.ended = False
        session.closed.clear()
        session.taken_over_at = len(session.steps) + 1 if take_over else None  # a worker says it on every take-over
        return session, len(session.steps) + 1


# --------------------------------------------------------------------------- helpers


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    return wait_for(predicate, timeout)


def job_message(code: str, functions: tuple[str, ...] = (), timeout_ms: int = 5000) -> pb.InteractRequest:
    return pb.InteractRequest(job=pb.RunJobRequest(checkpoint="base", code=code, timeout_ms=timeout_ms, functions=functions))


def open_message(code: str, functions: tuple[str, ...] = ()) -> pb.InteractRequest:
    return pb.InteractRequest(open_session=pb.RunJobRequest(checkpoint="base", code=code, timeout_ms=5000, functions=functions))


def step_message(code: str) -> pb.InteractRequest:
    return pb.InteractRequest(step=pb.SessionStep(code=code))


def reply_message(call_id: int, result_json: bytes = b"1") -> pb.InteractRequest:
    return pb.InteractRequest(reply=pb.HostReply(call_id=call_id, result_json=result_json))


class RawStream:
    """An Interact call driven by hand: messages queued, events read only when asked."""

    def __init__(self, stub: pb_grpc.WorkerStub, *first: pb.InteractRequest, timeout: float | None = None) -> None:
        self.requests: queue.SimpleQueue[pb.InteractRequest | None] = queue.SimpleQueue()
        for message in first:
            self.requests.put(message)
        self.call = stub.Interact(iter(self.requests.get, None), timeout=timeout)

    def send(self, *messages: pb.InteractRequest) -> None:
        for message in messages:
            self.requests.put(message)

    def next(self) -> pb.InteractEvent:
        return next(self.call)

    def cancel(self) -> None:
        self.requests.put(None)  # grpc's writer thread ends with the iterator
        self.call.cancel()


class Served:
    def __init__(self, runner: FakeRunner, server: WorkerServer) -> None:
        self.runner = runner
        self.server = server
        self.address = server.address
        self._channel = grpc.insecure_channel(server.address)
        self.stub = pb_grpc.WorkerStub(self._channel)
        self._cleanups: list[Callable[[], None]] = []

    def client(self) -> WorkerClient:
        client = WorkerClient(self.address)
        self._cleanups.append(client.close)
        return client

    def stream(self, *first: pb.InteractRequest, timeout: float | None = None) -> RawStream:
        stream = RawStream(self.stub, *first, timeout=timeout)
        self._cleanups.append(stream.cancel)
        return stream

    def stop(self) -> None:
        self.runner.release.set()
        for cleanup in reversed(self._cleanups):
            cleanup()
        self._channel.close()
        self.server.server.stop(0).wait()


@pytest.fixture
def serve_fake() -> Iterator[Callable[..., Served]]:
    started: list[Served] = []

    def start(max_streams: int | None = None) -> Served:
        runner = FakeRunner()
        served = Served(runner, serve(runner, "127.0.0.1:0", max_streams=max_streams))  # type: ignore[arg-type]
        started.append(served)
        return served

    yield start
    for served in started:
        served.stop()


@pytest.fixture
def hang_ups(monkeypatch: pytest.MonkeyPatch) -> list[Interaction]:
    """Interactions whose RPC has ended on the server (its hang-up callback ran), in order."""
    ended: list[Interaction] = []
    original = Interaction._hang_up

    def spy(self: Interaction) -> None:
        original(self)
        ended.append(self)

    monkeypatch.setattr(Interaction, "_hang_up", spy)
    return ended
