"""The worker as a gRPC service: readie.v1.Worker, standard health, reflection, graceful drain.

A thin adapter. Requests become readie values in :mod:`._convert`, the
runner it serves (a :class:`~readie_policy.runner.ServedRunner`: the
worker, or a router's placement) does the work, failures become status
codes in :mod:`._status`; this module only wires them to grpc and logs one
line per call (ids, status, timings; never the job's output). The worker
logs each job's own line under the same id (the caller's x-request-id when
it sends a usable one).

    server = serve(worker, "127.0.0.1:50061", name="worker-1")
    ...
    server.drain(grace_s=30)   # on SIGTERM: NOT_SERVING, finish jobs, destroy sandboxes, stop
"""

from __future__ import annotations

import functools
import re
import secrets
import socket
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import Any, TypeVar

import grpc
import structlog
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2

from ._convert import (
    MAX_CALL_PAYLOAD_BYTES,
    Ceiling,
    call_payload,
    capacity_response,
    checkpoint_name,
    code_job,
    run_job_response,
    timeout_ms,
)
from readie_executor.jobs import bounds
from readie_protocol.requests import MAX_LISTED_FILES, MAX_PATH_CHARS
from readie_protocol.workspace import MAX_COLLECTED_BYTES, MAX_COLLECTED_FILES, MAX_LEFT_OUT

from ._forks import WaitingForks
from ._interact import Interaction
from ._proto.readie.v1 import worker_pb2 as pb
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from ._status import ERROR_METADATA_KEY, FIELD_METADATA_KEY, NotStarted, ResponseTooLarge, grpc_errors, status_for
from readie_protocol.cancel import Cancellation
from readie_policy.config import Config
from readie_policy.runner import CallCounter, ServedRunner
from readie_protocol.errors import RequestError, SandboxSetupError
from .security import ServerSecurity

log = structlog.get_logger("readie.grpc")

# Additions to readie.v1 this worker understands (CapacityResponse.protocol).
# Bump when a field or RPC is added; a new package (readie.v2) for anything else.
# 2: Interact (host functions, sessions), RunJobRequest.functions, sessions in Capacity.
# 3: RunJobRequest.profile, CapacityResponse.problem.
# 4: files in the workspace: a job's and a step's files and collect, a response's
#    collected; upload, download and list_files on Interact (decision 31).
# 5: durable sessions (decision 32): attach by key (take_over), close, handed_over;
#    a result's session_key, resumed_from_step and lost.
# 6: the egress policy (decision 35): RunJobRequest.network_destinations, a result's network.
WORKER_PROTOCOL = 6
# The first protocol with files in the workspace: an older worker drops a request's files and
# collect unread, and ends a session's stream at an upload, so its clients do not send them.
FILES_PROTOCOL = 4
WORKER_SERVICE = pb.DESCRIPTOR.services_by_name["Worker"].full_name
REFLECTION_V1 = "grpc.reflection.v1.ServerReflection"
# A call's answer may be as large as its question: a data frame in, one out.
MAX_ENVELOPE_BYTES = MAX_CALL_PAYLOAD_BYTES
# Room for everything in a message besides the payload or envelope: the other
# fields and protobuf's tags and lengths, a few hundred bytes in practice.
MESSAGE_OVERHEAD_BYTES = 64 * 1024
# A path in an answer (written, collected or left out) with its tags and size.
_PATH_ENTRY_BYTES = 4 * MAX_PATH_CHARS + 32  # UTF-8: at most 4 bytes a character
# The largest RunJobResponse: a result at the sandbox's own budget for the
# largest max_output (stdout and stderr 16 MiB each, a value, the rest), the
# files it collected (32 MiB) and every path it names (decision 31).
MAX_JOB_RESPONSE_BYTES = (
    bounds.result_budget(bounds.MAX_OUTPUT_LIMIT)
    + MAX_COLLECTED_BYTES
    + (MAX_COLLECTED_FILES + MAX_LEFT_OUT + MAX_LISTED_FILES) * _PATH_ENTRY_BYTES
)
# The largest message either way: an Execute payload or envelope, or a job's
# response. The rest are far smaller (a request's fields are capped in _convert,
# its files at 768 KiB; a file chunk is 1 MiB at most), but grpc has one limit
# per server, not per method, so this is the hard bound and the fields do the rest.
MAX_MESSAGE_BYTES = max(MAX_ENVELOPE_BYTES, MAX_JOB_RESPONSE_BYTES) + MESSAGE_OVERHEAD_BYTES
# Threads beyond the job slots, so Capacity and health checks answer while
# every slot is busy and a few jobs wait for one. Calls beyond that wait in
# grpc's own queue; a router that respects Capacity never sends them.
RPC_HEADROOM_THREADS = 8
# Health answers on threads of its own: a probe never queues behind the service's calls, and
# callers that need no token (health is open: security.OPEN_METHODS) can hold only these. A
# unary call's thread waits for its request as long as its caller keeps the call open.
HEALTH_THREADS = 4
_HEALTH_POOL = futures.ThreadPoolExecutor(max_workers=HEALTH_THREADS, thread_name_prefix="rpc_health")
# A drain keeps the port open, answering NOT_SERVING, at least this long: the
# interval of a balancer's or an orchestrator's readiness probe, so that it
# moves its traffic before connections are refused.
DRAIN_NOTICE_S = 2.0
# A drain's wait for sessions to be handed over looks again this often: a stream that turns
# out to serve a session without a key (which runs on) stops counting without a notice.
HAND_OVER_POLL_S = 0.05
# Health follows Capacity's problem within this long (a Capacity call is answered from memory).
HEALTH_POLL_S = 1.0
# After the worker drained, running calls have returned; this only lets
# their responses reach the wire.
STOP_GRACE_S = 5.0
# A caller's x-request-id is logged as given only if it looks like an id.
_REQUEST_ID = re.compile(r"[A-Za-z0-9._:/-]{1,64}")
# Keepalive, so that an idle session (10 minutes by default) survives what
# clients and the networks between do. Clients may ping every 10 s, with or
# without calls in flight (grpc's default server answers a Node client that
# pings every 10 s with GOAWAY too_many_pings after ~40 s); the server pings
# idle connections itself every 30 s, so NATs and proxies keep them open,
# and gives up on a peer that does not answer within 10 s.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 5_000),
    ("grpc.http2.max_ping_strikes", 0),
    ("grpc.http2.max_pings_without_data", 0),
)

_Response = TypeVar("_Response")


class CallLog:
    """One log line per call: bound fields gathered while it runs, written when it ends."""

    def __init__(self, rpc: str, context: grpc.ServicerContext, level: str = "info", metrics: CallCounter | None = None) -> None:
        self.request_id = _request_id(context)
        self._rpc = rpc
        self._metrics = metrics  # counts each call by its status, where the log line is written
        self._context = context
        self.fields: dict[str, Any] = {"rpc": rpc, "request_id": self.request_id, "peer": context.peer()}
        self._level = level
        self._started = time.monotonic()

    def bind(self, **fields: Any) -> None:
        self.fields.update(fields)

    def __enter__(self) -> CallLog:
        return self

    def __exit__(self, exc_type: object, error: BaseException | None, tb: object) -> None:
        self.fields["wall_ms"] = round((time.monotonic() - self._started) * 1000, 1)
        if error is None:
            if not self._context.is_active():  # it ended before its answer: the work was stopped
                remaining = self._context.time_remaining()
                status = "DEADLINE_EXCEEDED" if remaining is not None and remaining <= 0 else "CANCELLED"
                log.info("call", status=status, **self.fields)
            else:
                status = "OK"
                getattr(log, self._level)("call", status=status, **self.fields)
        elif isinstance(error, GeneratorExit):  # grpc dropped a stream: the client went away
            status = "CANCELLED"
            log.info("call", status=status, **self.fields)
        else:
            mapped = status_for(error)
            refused = dict(mapped.metadata)
            status = mapped.code.name
            log.info("call", status=status, error=refused.get(ERROR_METADATA_KEY), field=refused.get(FIELD_METADATA_KEY), **self.fields)
        if self._metrics is not None:
            self._metrics.rpc_handled(self._rpc, status)


def _rpc(level: str = "info") -> Callable[[Callable[..., _Response]], Callable[..., _Response]]:
    """Run a servicer method under the one error mapping, with its call logged."""

    def decorate(method: Callable[..., _Response]) -> Callable[..., _Response]:
        @functools.wraps(method)
        def handler(self: WorkerServicer, request: Any, context: grpc.ServicerContext) -> _Response:
            with grpc_errors(context), CallLog(method.__name__, context, level, self.metrics) as call:
                return method(self, request, context, call)
            raise AssertionError("unreachable: grpc_errors aborts the call")

        return handler

    return decorate


class WorkerServicer(pb_grpc.WorkerServicer):
    def __init__(self, worker: ServedRunner, name: str, max_streams: int, config: Config, metrics: CallCounter | None = None) -> None:
        self.worker = worker
        self.metrics = metrics
        self.name = name
        # The operator's ceiling for what arrives over the network (nothing granted without one).
        self.ceiling = Ceiling(config.network_limits, config.profile_map)
        # Interact streams hold a server thread each for their whole life; past
        # this many, new ones are refused at once so unary calls, Capacity and
        # health always have threads left (serve sizes the pool above it).
        self._stream_places = threading.BoundedSemaphore(max_streams)
        self._max_streams = max_streams
        self.forks = WaitingForks()  # forks of sessions, until their streams attach (_forks)
        # Set by a drain: every new call is refused as not started (NotStarted).
        self._draining = False
        self._streams: set[Interaction] = set()  # open Interact streams, for a drain's hand-over
        self._streams_changed = threading.Condition()

    @property
    def hands_sessions_over(self) -> bool:
        return self.worker.hands_sessions_over

    def refuse_if_draining(self) -> None:
        if self._draining:
            raise NotStarted(f"{self.name} is draining and takes no new work; nothing of this call ran")

    def hand_over(self, grace_s: float) -> None:
        """A drain's first half (decision 32): refuse every new call as not started, ask each
        open Interact stream to hand its session over (after its running step), and wait up to
        ``grace_s`` for them to end; jobs, and sessions without a key, run on meanwhile, and
        the runner's own drain takes them after this."""
        deadline = time.monotonic() + grace_s
        with self._streams_changed:
            self._draining = True
            streams = list(self._streams)
        for stream in streams:
            stream.hand_over(self.hands_sessions_over)
        with self._streams_changed:
            while any(stream.hands_over for stream in self._streams) and (left := deadline - time.monotonic()) > 0:
                self._streams_changed.wait(min(left, HAND_OVER_POLL_S))

    def _stream_done(self, interaction: Interaction) -> None:
        with self._streams_changed:
            self._streams.discard(interaction)
            self._streams_changed.notify_all()
        self._stream_places.release()

    @_rpc()
    def RunJob(self, request: pb.RunJobRequest, context: grpc.ServicerContext, call: CallLog) -> pb.RunJobResponse:
        self.refuse_if_draining()
        job = code_job(request, context.time_remaining(), *self.ceiling)
        if job.functions:
            raise RequestError("host functions need the Interact stream: RunJob carries no calls back", field="functions")
        call.bind(checkpoint=job.checkpoint, timeout_ms=job.timeout_ms)
        # The worker logs the job itself (sandbox, outcome, timings) under this id.
        outcome = self.worker.run_job(job, job_id=call.request_id, cancel=_cancellation(context))
        call.bind(sandbox=outcome.sandbox_id)
        return run_job_response(outcome)

    @_rpc()
    def Execute(self, request: pb.ExecuteRequest, context: grpc.ServicerContext, call: CallLog) -> pb.ExecuteResponse:
        self.refuse_if_draining()
        checkpoint = checkpoint_name(request.checkpoint)
        payload = call_payload(request)
        timeout = timeout_ms(request, context.time_remaining(), self.ceiling.limits)
        call.bind(checkpoint=checkpoint, timeout_ms=timeout, payload_bytes=len(payload))
        started = time.monotonic()
        envelope = self.worker.execute_call(
            checkpoint, payload, timeout / 1000, max_response=MAX_ENVELOPE_BYTES, cancel=_cancellation(context)
        )
        duration_us = int((time.monotonic() - started) * 1_000_000)
        call.bind(envelope_bytes=len(envelope), call_us=duration_us)
        if len(envelope) > MAX_ENVELOPE_BYTES:
            raise ResponseTooLarge(f"the call's envelope is {len(envelope)} bytes; at most {MAX_ENVELOPE_BYTES} can be sent")
        return pb.ExecuteResponse(envelope=envelope, duration_us=duration_us)

    def Interact(self, requests: Iterator[pb.InteractRequest], context: grpc.ServicerContext) -> Iterator[pb.InteractEvent]:
        # A generator: the error mapping and the log line wrap its whole life, not its creation.
        with grpc_errors(context), CallLog("Interact", context, metrics=self.metrics) as call:
            self.refuse_if_draining()
            if not self._stream_places.acquire(blocking=False):
                raise SandboxSetupError(f"this server has its {self._max_streams} Interact streams open")
            try:
                # The place is given back when the stream's work is done, not when the client leaves.
                interaction = Interaction(
                    self.worker, requests, context, call.request_id, self.ceiling, call.bind,
                    lambda: self._stream_done(interaction), forks=self.forks,
                )
                with self._streams_changed:
                    self._streams.add(interaction)
                    if self._draining:  # a drain began since the check above: this one is handed over too
                        interaction.hand_over(self.hands_sessions_over)
                interaction.start()
            except BaseException:
                self._stream_places.release()
                raise
            yield from interaction.events()

    @_rpc(level="debug")  # polled by placement: a line per poll would drown the job lines
    def Capacity(self, request: pb.CapacityRequest, context: grpc.ServicerContext, call: CallLog) -> pb.CapacityResponse:
        return capacity_response(self.worker.capacity(), self.name, WORKER_PROTOCOL)


class _Health:
    """Health that tells the truth: NOT_SERVING while the worker (or router) can serve nothing.

    Polled from Capacity, whose ``problem`` says why: a worker whose
    checkpoints were all dropped, a router with no healthy worker. Each
    change is logged once.
    """

    def __init__(self, servicer: health.HealthServicer, worker: ServedRunner, services: Sequence[str]) -> None:
        self._servicer = servicer
        self._worker = worker
        self._services = ("", *services)  # "" is the whole server, as health clients ask by default
        self._problem: str | None | object = object()  # nothing set yet
        self._stop = threading.Event()
        self.check()
        self._thread = threading.Thread(target=self._watch, name="health", daemon=True)
        self._thread.start()

    def check(self) -> None:
        problem = self._worker.capacity().problem
        if problem == self._problem:
            return
        status = health_pb2.HealthCheckResponse.SERVING if problem is None else health_pb2.HealthCheckResponse.NOT_SERVING
        for service in self._services:
            self._servicer.set(service, status)
        if problem is None:
            log.info("health", status="SERVING")
        else:
            log.warning("health", status="NOT_SERVING", problem=problem)
        self._problem = problem

    def stop(self) -> None:
        """Before a drain takes health over: no SERVING after it."""
        self._stop.set()
        self._thread.join()

    def _watch(self) -> None:
        while not self._stop.wait(HEALTH_POLL_S):
            try:
                self.check()
            except Exception:  # noqa: BLE001 - a bad poll must not end the watch
                log.exception("health check failed")


@dataclass
class WorkerServer:
    """A started server; :meth:`drain` is the one way to stop it."""

    server: grpc.Server
    health: health.HealthServicer
    worker: ServedRunner
    address: str
    port: int
    watch: _Health
    servicer: WorkerServicer

    def drain(self, grace_s: float, notice_s: float = DRAIN_NOTICE_S) -> None:
        """Stop taking work, let running jobs finish (up to ``grace_s``), hand sessions over,
        destroy sandboxes, stop.

        Health turns NOT_SERVING first, and the port stays open for at least
        ``notice_s``, so balancers polling health stop routing here before
        connections are refused, while the jobs already running complete.
        New calls are refused as not started (a client sends them again
        elsewhere); each session with a key is detached into the store after
        its running step and its stream ends with ``handed_over`` (decision 32).
        """
        started = time.monotonic()
        log.info("draining", grace_s=grace_s, busy=self.worker.capacity().busy)
        self.watch.stop()
        self.health.enter_graceful_shutdown()
        self.servicer.hand_over(grace_s)  # new calls get UNAVAILABLE, marked not started, from here on
        self.worker.drain(max(0.0, grace_s - (time.monotonic() - started)))
        time.sleep(max(0.0, notice_s - (time.monotonic() - started)))
        self.server.stop(STOP_GRACE_S).wait()
        # Once more now that no handler runs: a job cut off at the grace could
        # have been restoring a sandbox when drain swept.
        self.worker.close()
        log.info("drained", wall_ms=round((time.monotonic() - started) * 1000, 1))



class _HealthServicer(health.HealthServicer):
    """grpc's health service, its calls on ``_HEALTH_POOL`` (grpc's hook: a behaviour's
    ``experimental_thread_pool``), one pool for every server of the process."""

    def __init__(self) -> None:
        super().__init__(experimental_thread_pool=_HEALTH_POOL)  # Watch's

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        return super().Check(request, context)

    Check.experimental_thread_pool = _HEALTH_POOL  # type: ignore[attr-defined]


def serve(
    worker: ServedRunner,
    address: str,
    *,
    name: str | None = None,
    max_message_bytes: int = MAX_MESSAGE_BYTES,
    threads: int | None = None,
    max_streams: int | None = None,
    extra_services: Sequence[tuple[str, Callable[[grpc.Server], None]]] = (),
    security: ServerSecurity = ServerSecurity(),
    config: Config = Config(),
    metrics: CallCounter | None = None,
) -> WorkerServer:
    """Serve a started ``worker`` on ``address`` ("host:port"; port 0 picks a free one).

    ``name`` is what Capacity reports; by default the host name and the bound port.
    ``max_streams`` bounds the Interact streams open at once (by default one per
    job slot and per session); ``threads`` is the server's pool, by default
    those plus a thread per slot for unary jobs and headroom for Capacity and health.
    ``security`` is checked against ``address`` first (SecurityError: refused).
    ``config`` holds the operator's ceiling and profiles for every job and
    session that arrives (without ``[pool.limits]`` nothing is granted).
    ``metrics``, when given, counts every call by method and status code.
    """
    security.check(address)
    capacity = worker.capacity()
    max_streams = max_streams if max_streams is not None else capacity.slots + capacity.max_sessions
    threads = threads or max_streams + capacity.slots + RPC_HEADROOM_THREADS
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rpc"),
        options=[
            ("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes),
            # grpc sets SO_REUSEPORT by default, so a second worker on a taken
            # port would share it silently; a worker owns its port alone.
            ("grpc.so_reuseport", 0),
            *KEEPALIVE_OPTIONS,
        ],
        interceptors=security.interceptors(),
    )
    port = security.add_port(server, address)  # raises RuntimeError when it cannot bind
    bound = f"{address.rsplit(':', 1)[0]}:{port}"
    name = name or f"{socket.gethostname()}:{port}"
    servicer = WorkerServicer(worker, name, max_streams, config, metrics)
    pb_grpc.add_WorkerServicer_to_server(servicer, server)
    health_servicer = _HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    for _, register in extra_services:  # e.g. the router's Pool service
        register(server)
    services = (WORKER_SERVICE, *(name for name, _ in extra_services))
    _serve_reflection((*services, health.SERVICE_NAME), server)
    watch = _Health(health_servicer, worker, services)
    server.start()
    log.info(
        "serving", address=bound, name=name, protocol=WORKER_PROTOCOL, max_message_bytes=max_message_bytes, **security.describe()
    )
    return WorkerServer(server, health_servicer, worker, bound, port, watch, servicer)


def _serve_reflection(services: Sequence[str], server: grpc.Server) -> None:
    """Reflection as ``grpc.reflection.v1`` (what tools ask first now) and ``v1alpha``.

    grpcio's package serves only v1alpha; v1 carries the same messages, field
    for field, under a new name, so the same servicer answers both.
    """
    names = (*services, reflection.SERVICE_NAME, REFLECTION_V1)
    reflection.enable_server_reflection(names, server)
    servicer = reflection.ReflectionServicer(names)
    method = grpc.stream_stream_rpc_method_handler(
        servicer.ServerReflectionInfo,
        request_deserializer=reflection_pb2.ServerReflectionRequest.FromString,
        response_serializer=reflection_pb2.ServerReflectionResponse.SerializeToString,
    )
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(REFLECTION_V1, {"ServerReflectionInfo": method}),))


def _cancellation(context: grpc.ServicerContext) -> Cancellation:
    """Set when the call ends for any reason: after its answer that changes nothing; before it
    (cancelled, deadline passed, client gone) the work stops and its sandbox is freed."""
    cancel = Cancellation()
    if not context.add_callback(cancel.cancel):
        cancel.cancel()  # it has ended already
    return cancel


def _request_id(context: grpc.ServicerContext) -> str:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id" and isinstance(value, str) and _REQUEST_ID.fullmatch(value):
            return value
    return secrets.token_hex(8)
