"""A client of one ``readie worker`` (or of routers), shaped like the in-process :class:`~readie_worker.core.Worker`.

Routers and ``readie pool --router`` use it; the worker's gRPC statuses come
back as readie's own errors (``_status.readie_errors``), so callers handle
a remote worker and a local one alike. A call's :class:`Cancellation` (and
``NEVER``, none) is part of this API, so a caller such as the client's
remote path needs nothing of the worker's to cancel one.

Given several addresses (routers in front of the same workers) and a
``retry_s``, a call that provably never started (refused as not started by
a draining server, or a connection that never opened) is sent again to the
next address, after a short backoff, until ``retry_s`` has passed; a call
that may have run is answered as lost, never sent twice (decision 32).
Sessions it opens carry their key and re-attach through it (``reconnect``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc
import structlog

from ._client_wire import attached_setup, job_outcome, run_job_request, step_outcome
from ._proto.readie.v1 import worker_pb2 as pb
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from ._session_wire import session_key
from ._status import NotStarted, Unreachable, WorkerLost, readie_errors
from .grpc_service import FILES_PROTOCOL, MAX_MESSAGE_BYTES
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import Cancelled, PoolWorkerError, SandboxSetupError
from readie_policy.jobs import Capacity, CodeJob, HostFunction, JobOutcome, OutputSink, StepOutcome
from .remote_session import DEADLINE_MARGIN_S, SESSION_IMAGE_WAIT_S, InteractStream, Reconnect, RemoteSession
from .security import ClientSecurity

__all__ = ["NEVER", "Cancellation", "NotStarted", "Unreachable", "WorkerClient", "WorkerLost"]

log = structlog.get_logger("readie.grpc")
_T = TypeVar("_T")

# Capacity answers from memory; a second means the worker is in trouble.
CAPACITY_TIMEOUT_S = 1.0
# A client of routers waits this long for a connection before it counts the call as never
# started and tries the next address: on a LAN one opens in milliseconds, and a router that is
# gone refuses at once or never answers.
CONNECT_WAIT_S = 2.0
# A client of routers (``readie pool --router A,B``) sends a never-started call again for this
# long: a router's rolling restart is its drain notice and a restart, a few seconds; a minute
# without any router means the operator has a problem no retry hides.
ROUTER_RETRY_S = 60.0
# grpc polls a watched channel's connectivity on a thread of its own this often, and that thread
# fails if the channel is closed under it before it sees nobody watches any more.
CONNECTIVITY_POLL_S = 0.25
# The first pause before sending a never-started call again, doubled up to the second: a
# draining router refuses at once, so back-to-back retries would only spin.
RETRY_BACKOFF_S = 0.1
RETRY_BACKOFF_MAX_S = 2.0
# A session's stream may idle for its whole session_idle: ping every 30 s, with
# or without calls (the server allows every 5 s), so that NATs and proxies keep
# the connection, and notice within 10 s more when the worker is gone.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)
# A peer that went away and came back (a worker or router restarted on its port, a rolling
# deploy) is reached again within a second: gRPC's default reconnect backoff grows to 120 s,
# and while it waits every call and probe fails at once, so a router kept a restarted worker
# evicted for seconds after it served (the fault suite's rolling restart lost work to it).
RECONNECT_OPTIONS = (
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 1_000),
)


class WorkerClient:
    """A worker's (or routers') client; see the module docstring. ``address`` is one address or
    several; ``retry_s`` is how long a never-started call is sent again (0: never; by default
    :data:`ROUTER_RETRY_S` for several addresses, which are routers, and 0 for one)."""

    def __init__(
        self, address: str | Sequence[str], security: ClientSecurity = ClientSecurity(), *, retry_s: float | None = None,
    ) -> None:
        self.addresses = (address,) if isinstance(address, str) else tuple(address)
        if not self.addresses:
            raise ValueError("a WorkerClient needs an address")
        self.retry_s = retry_s if retry_s is not None else (ROUTER_RETRY_S if len(self.addresses) > 1 else 0.0)
        self._security = security
        self._at = 0  # the address calls go to, until one is refused as not started
        self._channels: dict[str, grpc.Channel] = {}
        self._watched = False  # a channel's readiness was waited for (_connected)
        # The worker's protocol as its last Capacity answer said; None until one did.
        self.protocol: int | None = None

    @property
    def address(self) -> str:
        return self.addresses[self._at]

    @property
    def _stub(self) -> pb_grpc.WorkerStub:
        return pb_grpc.WorkerStub(self._channel(self.address))

    def _channel(self, address: str) -> grpc.Channel:
        if address not in self._channels:
            self._channels[address] = self._security.channel(
                address,
                options=[
                    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                    *KEEPALIVE_OPTIONS,
                    *RECONNECT_OPTIONS,
                ],
            )
        return self._channels[address]

    def _unstarted_retried(self, call: Callable[[], _T]) -> _T:
        """``call()``, sent again to the next address while it is refused as never started, for up
        to ``retry_s``; everything else (a call that may have run above all) is raised as it is."""
        deadline = time.monotonic() + self.retry_s
        backoff = RETRY_BACKOFF_S
        while True:
            try:
                if self.retry_s > 0:
                    self._connected(self.address)
                return call()
            except NotStarted as exc:
                if time.monotonic() + backoff > deadline:
                    raise
                log.info("call not started; sending it again", address=self.address, error=str(exc), backoff_s=backoff)
                self._at = (self._at + 1) % len(self.addresses)
                time.sleep(backoff)
                backoff = min(2 * backoff, RETRY_BACKOFF_MAX_S)

    def _connected(self, address: str) -> None:
        """Wait (up to CONNECT_WAIT_S) for a connection to ``address``; NotStarted if none opens."""
        ready = grpc.channel_ready_future(self._channel(address))
        self._watched = True
        try:
            ready.result(timeout=CONNECT_WAIT_S)
        except grpc.FutureTimeoutError:
            raise NotStarted(f"no connection to {address} opened within {CONNECT_WAIT_S:.0f} s") from None
        finally:
            ready.cancel()

    def run_job(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> JobOutcome:
        """Run ``job`` on the worker; ``host`` answers its calls to its declared ``functions``,
        ``output`` takes its output as it is written.

        ``cancel`` cancels the call to the worker, which stops the job there.
        """
        self._check_files(job.files or job.collect)
        timeout_s = job.timeout_ms / 1000 + DEADLINE_MARGIN_S

        def run() -> pb.RunJobResponse:
            if job.functions or output is not None:  # calls and output come back on an Interact stream
                request = run_job_request(job, stream_output=output is not None)
                stream = self._interact(pb.InteractRequest(job=request), job, job_id, timeout_s)
                with cancel.stopping(stream.cancel):
                    response = stream.result(host, job.timeout_ms / 1000, output=output, max_output=job.max_output)
                stream.close()
                return response
            call = self._stub.RunJob.future(run_job_request(job), timeout=timeout_s, metadata=_request_id(job_id))
            with cancel.stopping(call.cancel):
                return _answer(call)

        return job_outcome(self._unstarted_retried(run), job)

    def open_session(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> tuple[RemoteSession, StepOutcome]:
        """Open a session on the worker whose setup and first step are ``job`` (``Worker.open_session``'s shape)."""
        self._check_files(job.files or job.collect)
        request = run_job_request(job, stream_output=output is not None)

        def open_it() -> tuple[InteractStream, pb.RunJobResponse]:
            stream = self._interact(pb.InteractRequest(open_session=request), job, job_id, None)
            with cancel.stopping(stream.cancel):
                return stream, stream.result(
                    host, job.timeout_ms / 1000, job.timeout_ms / 1000 + DEADLINE_MARGIN_S,
                    output=output, max_output=job.max_output,
                )

        stream, response = self._unstarted_retried(open_it)
        if not response.HasField("session_id") or response.step != 1:
            stream.cancel()
            raise PoolWorkerError("the worker answered a session's opening without a session id or as another step")
        try:
            first = step_outcome(response, job)
            key = session_key(response, "session_key")
        except PoolWorkerError:  # an answer out of bounds: the session is not trusted with more
            stream.cancel()
            raise
        session = RemoteSession(
            stream, job, response.session_id, self.address, files=self.files, key=key, reconnect=self._reconnect(job), step=1,
        )
        if first.session_ended:
            session.close()
        return session, first

    def attach_session(
        self, key: str, *, take_over: bool = False, cancel: Cancellation = NEVER, job: CodeJob | None = None,
    ) -> tuple[RemoteSession, int]:
        """The session stored under ``key``, on a stream of its own, and the number of its last step
        (``JobRunner.attach_session``'s shape, decision 32). ``job`` is its opening when this side
        knows it (its steps' bounds and host functions); else the setup its worker answers with."""

        def attach() -> tuple[RemoteSession, int]:
            first = pb.InteractRequest(attach=pb.AttachSession(key=key, take_over=take_over))
            stream = InteractStream(self._stub, first, job.functions if job is not None else (), timeout_s=None)
            with cancel.stopping(stream.cancel):
                attached = stream.answer("attached", SESSION_IMAGE_WAIT_S)
            try:
                setup = job if job is not None else attached_setup(attached)
            except PoolWorkerError:
                stream.cancel()
                raise
            stream.declare(setup.functions)
            session = RemoteSession(
                stream, setup, attached.session_id, self.address, files=self.files, key=key,
                reconnect=self._reconnect(setup), step=attached.step,
            )
            session.hibernated = True  # in the store: its next step resumes it
            return session, attached.step

        return self._unstarted_retried(attach)

    def _reconnect(self, job: CodeJob) -> Reconnect:
        """How a session this client opened continues on a new stream (RemoteSession's ``reconnect``)."""
        return lambda key, take_over: self.attach_session(key, take_over=take_over, job=job)

    @property
    def files(self) -> bool:
        """Whether the worker takes files (decision 31): it said a protocol that has them, or
        has not said yet (it then refuses what it does not know, as any request of its)."""
        return self.protocol is None or self.protocol >= FILES_PROTOCOL

    def _check_files(self, asked: object) -> None:
        if asked and not self.files:
            raise SandboxSetupError(
                f"the worker at {self.address} speaks protocol {self.protocol}; files need {FILES_PROTOCOL}"
            )

    def _interact(self, first: pb.InteractRequest, job: CodeJob, job_id: str | None, timeout_s: float | None) -> InteractStream:
        return InteractStream(self._stub, first, job.functions, timeout_s=timeout_s, metadata=_request_id(job_id))

    def execute_call(
        self,
        checkpoint: str,
        payload: bytes,
        timeout_s: float,
        max_response: int | None = None,
        *,
        cancel: Cancellation = NEVER,
    ) -> bytes:
        request = pb.ExecuteRequest(checkpoint=checkpoint, payload=payload, timeout_ms=max(1, int(timeout_s * 1000)))

        def execute() -> bytes:
            call = self._stub.Execute.future(request, timeout=timeout_s + DEADLINE_MARGIN_S)
            with cancel.stopping(call.cancel):
                return _answer(call).envelope

        return self._unstarted_retried(execute)

    def capacity(self, timeout_s: float = CAPACITY_TIMEOUT_S) -> tuple[Capacity, str]:
        """The worker's capacity and its name."""
        with readie_errors():
            reply = self._stub.Capacity(pb.CapacityRequest(), timeout=timeout_s)
        self.protocol = reply.protocol
        warm = {name: {"ready": state.ready, "target": state.target} for name, state in reply.pools.items()}
        capacity = Capacity(
            reply.slots,
            reply.busy,
            reply.draining,
            warm,
            reply.isolated,
            reply.sessions,
            reply.max_sessions,
            reply.problem if reply.HasField("problem") else None,
        )
        return capacity, reply.worker_name

    def close(self) -> None:
        if self._watched:  # grpc's poller of a channel watched for readiness must see it unwatched first
            time.sleep(CONNECTIVITY_POLL_S)
        for channel in self._channels.values():
            channel.close()


def _answer(call: grpc.Future) -> Any:
    """The response of a unary call made with ``.future``; its failure as readie's error."""
    with readie_errors():
        return call.result()


def _request_id(job_id: str | None) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", job_id),) if job_id else ()
