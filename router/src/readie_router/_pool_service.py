"""The pool protocol over a gRPC stream: one :class:`PoolEngine` per ``Pool.Session`` call.

The engine is the one ``readie pool`` runs on stdin/stdout; here its bytes
come from the request stream and its lines go out on the response stream.
Jobs go to the router's placement, shared by every session; a session's end
(the client closing its side) drains that session's jobs only. (A "session"
here is one stream. The pool protocol's own sessions, ``"session": NAME``,
are pinned by the placement to one worker each, and host functions'
calls come back from the worker on the job's own Interact stream.)

A stream that ends by the client's half-close closes its pool sessions, as
a pool's stdin ending does; one that breaks (cancelled, the client gone)
detaches them instead (decision 32): each stays in the session store, and
a new stream attaches it by its key.
"""

from __future__ import annotations

import asyncio
import queue
import threading
import time
from collections.abc import Iterator

import grpc
import structlog
from readie_protocol.cancel import NEVER, Cancellation

from readie_protocol.errors import SandboxSetupError
from readie_rpc.grpc_service import CallLog, grpc_errors
from readie_rpc.stubs import pool_pb2 as pb
from readie_rpc.stubs import pool_pb2_grpc as pb_grpc
from readie_worker.jobs import CodeJob, HostFunction, JobOutcome, OutputSink
from readie_worker.metrics import Metrics
from readie_policy.runner import JobRunner, SessionHandle
from readie_worker.sessions import StepOutcome

from readie_pool import PoolEngine, PoolSetup, ThreadedBackend

log = structlog.get_logger("readie.router.pool")

POOL_SERVICE = pb.DESCRIPTOR.services_by_name["Pool"].full_name
# Answers a session may have written but the client not yet read; past this
# the engine's writer waits, which holds its permits and so stops its intake:
# the stream's own backpressure, like a full stdout pipe.
MAX_UNREAD_LINES = 64
# grpc may end a cancelled call's request stream a moment before its termination callback
# runs; a stream's end waits this long for that callback before it counts as a half-close.
# Short: a client that half-closes waits this much longer for its stream to end.
BREAK_NOTICE_S = 0.2
# Session streams served at once: each a client's whole `readie pool --router`, holding a server
# thread (the router's pool is sized for them) and its engine's threads while the client is
# connected, idle or not, as a pool's stdin may idle. One past it is refused at once.
MAX_POOL_STREAMS = 16
# How long the engine, done, lets its handler send the lines left to a client that reads slowly;
# then it ends the RPC: a client that stopped reading holds grpc's send, and with it the thread.
LAST_LINES_SEND_S = 60.0
_END = None


class _Shared:
    """The placement, lent to a session: a session's close must not close it."""

    def __init__(self, runner: JobRunner) -> None:
        self._runner = runner

    def run_job(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> JobOutcome:
        return self._runner.run_job(job, job_id, host, cancel=cancel, output=output)

    def open_session(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> tuple[SessionHandle, StepOutcome]:
        return self._runner.open_session(job, job_id, host, cancel=cancel, output=output)

    def attach_session(self, key: str, *, take_over: bool = False, cancel: Cancellation = NEVER) -> tuple[SessionHandle, int]:
        return self._runner.attach_session(key, take_over=take_over, cancel=cancel)

    def close(self) -> None:
        pass


class _RequestSource:
    """The request stream as the engine's ByteSource; each read pulls one message on a thread.

    At its end it tells a half-close (the pool's sessions close, as at stdin's end) from a
    break: the RPC terminated (``broken`` set by its callback) by then, or within
    :data:`BREAK_NOTICE_S`; after a break the engine detaches its sessions instead.
    """

    def __init__(self, requests: Iterator[pb.PoolInput], broken: threading.Event, engine: PoolEngine) -> None:
        self._requests = requests
        self._broken = broken
        self._engine = engine

    async def read(self) -> bytes:
        data = await asyncio.to_thread(self._next)
        if not data and await asyncio.to_thread(self._broken.wait, BREAK_NOTICE_S):
            log.info("the client's stream broke; its sessions are detached, not closed")
            self._engine.detach_sessions()
        return data

    def _next(self) -> bytes:
        try:
            for message in self._requests:
                if message.data:
                    return bytes(message.data)
        except grpc.RpcError:  # cancelled under the read: a break
            self._broken.set()
        return b""


class _ResponseSink:
    """The engine's lines, for the handler to yield. A full queue is waited on while the client is
    there (its backpressure, MAX_UNREAD_LINES); once the RPC has ended, a line that finds it full
    is dropped: the handler is gone from its reads, and nothing would ever take it."""

    def __init__(self, lines: queue.Queue[bytes | None], broken: threading.Event) -> None:
        self._lines = lines
        self._broken = broken

    async def write(self, data: bytes) -> None:
        await asyncio.to_thread(self.put, data)

    def put(self, line: bytes | None) -> None:
        while True:
            try:
                self._lines.put(line, timeout=BREAK_NOTICE_S)
                return
            except queue.Full:
                if self._broken.is_set():
                    return


class PoolServicer(pb_grpc.PoolServicer):
    """``max_streams``: the Session streams served at once (:data:`MAX_POOL_STREAMS`)."""

    def __init__(self, setup: PoolSetup, runner: JobRunner, metrics: Metrics | None = None, *,
                 max_streams: int = MAX_POOL_STREAMS) -> None:
        self._setup = setup
        self._runner = runner
        self._metrics = metrics  # the session stream counted with the Worker service's calls
        self._places = threading.BoundedSemaphore(max_streams)
        self._max_streams = max_streams

    def Session(self, request_iterator: Iterator[pb.PoolInput], context: grpc.ServicerContext) -> Iterator[pb.PoolOutput]:
        # A generator: the error mapping and the log line wrap its whole life, not its creation.
        with grpc_errors(context), CallLog("Session", context, metrics=self._metrics):
            if not self._places.acquire(blocking=False):
                raise SandboxSetupError(f"this router has its {self._max_streams} pool streams open")
            # Held by this handler's thread and by its engine's: given back once both are done.
            place = _Place(self._places, holders=2)
            try:
                yield from self._serve(request_iterator, context, place)
            finally:
                place.leave()

    def _serve(self, request_iterator: Iterator[pb.PoolInput], context: grpc.ServicerContext,
               place: _Place) -> Iterator[pb.PoolOutput]:
        lines: queue.Queue[bytes | None] = queue.Queue(MAX_UNREAD_LINES)
        taken = threading.Event()  # the handler took the last line (the end): nothing more to send

        broken = threading.Event()  # the RPC terminated before the engine was done: a break, not a close
        if not context.add_callback(broken.set):
            broken.set()

        sink = _ResponseSink(lines, broken)

        def serve() -> None:
            try:
                backend = ThreadedBackend(_Shared(self._runner), self._setup.workers)
                engine = PoolEngine(self._setup, backend)
                asyncio.run(engine.serve(_RequestSource(request_iterator, broken, engine), sink))
            except Exception:
                log.exception("pool session failed")
            finally:
                sink.put(_END)
                deadline = time.monotonic() + LAST_LINES_SEND_S
                while not taken.wait(BREAK_NOTICE_S) and not broken.is_set():
                    if time.monotonic() >= deadline:
                        context.cancel()  # the client stopped reading: its lines never go, its thread comes back
                        break
                place.leave()

        thread = threading.Thread(target=serve, name="pool-session", daemon=True)
        try:
            thread.start()
        except BaseException:
            place.leave()  # the engine's share: it never ran
            raise
        while (line := lines.get()) is not _END:
            yield pb.PoolOutput(line=line)
        taken.set()
        thread.join()


class _Place:
    """A stream's place, given back to ``places`` once each of its ``holders`` has left."""

    def __init__(self, places: threading.BoundedSemaphore, holders: int) -> None:
        self._places = places
        self._holders = holders
        self._lock = threading.Lock()

    def leave(self) -> None:
        with self._lock:
            self._holders -= 1
            last = self._holders == 0
        if last:
            self._places.release()
