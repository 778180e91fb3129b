"""A client of one ``readie worker``, shaped like the in-process :class:`~readie_worker.core.Worker`.

Routers and ``readie pool --router`` use it; the worker's gRPC statuses come
back as readie's own errors (``_status.error_from_status``), so callers handle
a remote worker and a local one alike.
"""

from __future__ import annotations

import grpc

from ._convert import job_outcome, run_job_request
from ._proto.readie.v1 import worker_pb2 as pb
from ._proto.readie.v1 import worker_pb2_grpc as pb_grpc
from ._status import error_from_status
from .core import Capacity
from .grpc_service import MAX_MESSAGE_BYTES
from .jobs import CodeJob, JobOutcome

# Above a job's own timeout: the worker enforces the timeout, this only keeps
# a lost connection from hanging the caller forever.
DEADLINE_MARGIN_S = 30.0
# Capacity answers from memory; a second means the worker is in trouble.
CAPACITY_TIMEOUT_S = 1.0


class WorkerClient:
    def __init__(self, address: str) -> None:
        self.address = address
        self._channel = grpc.insecure_channel(
            address,
            options=[
                ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
                ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ],
        )
        self._stub = pb_grpc.WorkerStub(self._channel)

    def run_job(self, job: CodeJob, job_id: str | None = None) -> JobOutcome:
        metadata = (("x-request-id", job_id),) if job_id else ()
        try:
            response = self._stub.RunJob(
                run_job_request(job), timeout=job.timeout_ms / 1000 + DEADLINE_MARGIN_S, metadata=metadata
            )
        except grpc.RpcError as error:
            raise error_from_status(error) from None
        return job_outcome(response)

    def execute_call(self, checkpoint: str, payload: bytes, timeout_s: float, max_response: int | None = None) -> bytes:
        request = pb.ExecuteRequest(checkpoint=checkpoint, payload=payload, timeout_ms=max(1, int(timeout_s * 1000)))
        try:
            return self._stub.Execute(request, timeout=timeout_s + DEADLINE_MARGIN_S).envelope
        except grpc.RpcError as error:
            raise error_from_status(error) from None

    def capacity(self, timeout_s: float = CAPACITY_TIMEOUT_S) -> tuple[Capacity, str]:
        """The worker's capacity and its name."""
        try:
            reply = self._stub.Capacity(pb.CapacityRequest(), timeout=timeout_s)
        except grpc.RpcError as error:
            raise error_from_status(error) from None
        pools = {name: {"ready": state.ready, "target": state.target} for name, state in reply.pools.items()}
        return Capacity(reply.slots, reply.busy, reply.draining, pools, reply.isolated), reply.worker_name

    def close(self) -> None:
        self._channel.close()
