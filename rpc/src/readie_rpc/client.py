"""A client of one ``readie worker``, shaped like the in-process :class:`~readie_worker.core.Worker`.

Routers and ``readie pool --router`` use it; the worker's gRPC statuses come
back as readie's own errors (``_status.readie_errors``), so callers handle
a remote worker and a local one alike. A call's :class:`Cancellation` (and
``NEVER``, none) is part of this API, so a caller such as the client's
remote path needs nothing of the worker's to cancel one.
"""

from __future__ import annotations

from typing import Any

import grpc

from ._client_wire import job_outcome, run_job_request, step_outcome
from ._proto.readie.v1 import worker_pb2 as pb
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from ._status import readie_errors
from .grpc_service import MAX_MESSAGE_BYTES
from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.errors import Cancelled, PoolWorkerError
from readie_policy.jobs import Capacity, CodeJob, HostFunction, JobOutcome, OutputSink, StepOutcome
from .remote_session import DEADLINE_MARGIN_S, InteractStream, RemoteSession
from .security import ClientSecurity

__all__ = ["NEVER", "Cancellation", "WorkerClient"]

# Capacity answers from memory; a second means the worker is in trouble.
CAPACITY_TIMEOUT_S = 1.0
# A session's stream may idle for its whole session_idle: ping every 30 s, with
# or without calls (the server allows every 5 s), so that NATs and proxies keep
# the connection, and notice within 10 s more when the worker is gone.
KEEPALIVE_OPTIONS = (
    ("grpc.keepalive_time_ms", 30_000),
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.max_pings_without_data", 0),
)


class WorkerClient:
    def __init__(self, address: str, security: ClientSecurity = ClientSecurity()) -> None:
        self.address = address
        self._channel = security.channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
                *KEEPALIVE_OPTIONS,
            ],
        )
        self._stub = pb_grpc.WorkerStub(self._channel)

    def run_job(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> JobOutcome:
        """Run ``job`` on the worker; ``host`` answers its calls to its declared ``functions``,
        ``output`` takes its output as it is written.

        ``cancel`` cancels the call to the worker, which stops the job there.
        """
        timeout_s = job.timeout_ms / 1000 + DEADLINE_MARGIN_S
        if job.functions or output is not None:  # calls and output come back on an Interact stream
            request = run_job_request(job, stream_output=output is not None)
            stream = self._interact(pb.InteractRequest(job=request), job, job_id, timeout_s)
            with cancel.stopping(stream.cancel):
                response = stream.result(host, job.timeout_ms / 1000, output=output, max_output=job.max_output)
            stream.close()
            return job_outcome(response, job)
        call = self._stub.RunJob.future(run_job_request(job), timeout=timeout_s, metadata=_request_id(job_id))
        with cancel.stopping(call.cancel):
            response = _answer(call)
        return job_outcome(response, job)

    def open_session(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> tuple[RemoteSession, StepOutcome]:
        """Open a session on the worker whose setup and first step are ``job`` (``Worker.open_session``'s shape)."""
        request = run_job_request(job, stream_output=output is not None)
        stream = self._interact(pb.InteractRequest(open_session=request), job, job_id, None)
        with cancel.stopping(stream.cancel):
            response = stream.result(
                host, job.timeout_ms / 1000, job.timeout_ms / 1000 + DEADLINE_MARGIN_S,
                output=output, max_output=job.max_output,
            )
        if not response.HasField("session_id") or response.step != 1:
            stream.cancel()
            raise PoolWorkerError("the worker answered a session's opening without a session id or as another step")
        try:
            first = step_outcome(response, job)
        except PoolWorkerError:  # an answer out of bounds: the session is not trusted with more
            stream.cancel()
            raise
        session = RemoteSession(stream, job, response.session_id, self.address)
        if first.session_ended:
            session.close()
        return session, first

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
        call = self._stub.Execute.future(request, timeout=timeout_s + DEADLINE_MARGIN_S)
        with cancel.stopping(call.cancel):
            return _answer(call).envelope

    def capacity(self, timeout_s: float = CAPACITY_TIMEOUT_S) -> tuple[Capacity, str]:
        """The worker's capacity and its name."""
        with readie_errors():
            reply = self._stub.Capacity(pb.CapacityRequest(), timeout=timeout_s)
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
        self._channel.close()


def _answer(call: grpc.Future) -> Any:
    """The response of a unary call made with ``.future``; its failure as readie's error."""
    with readie_errors():
        return call.result()


def _request_id(job_id: str | None) -> tuple[tuple[str, str], ...]:
    return (("x-request-id", job_id),) if job_id else ()
