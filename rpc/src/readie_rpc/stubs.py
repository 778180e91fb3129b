"""The gRPC contract's generated code and bounds, for the router and clients.

``readie.v1.Worker`` and ``readie.v1.Pool`` (``proto/``), generated into
``readie_rpc._proto``; import them from here, never from there.
"""

from ._convert import MAX_CALL_PAYLOAD_BYTES
from ._proto.readie.v1 import pool_pb2, pool_pb2_grpc, worker_pb2, worker_pb2_grpc

__all__ = ["MAX_CALL_PAYLOAD_BYTES", "pool_pb2", "pool_pb2_grpc", "worker_pb2", "worker_pb2_grpc"]
