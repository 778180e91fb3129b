"""What both ends of the pool protocol share: ``readie pool`` and its clients.

Both ends drive one sans-IO :class:`~readie_protocol.connection.PoolConnection`
(the pool as ``Role.POOL``, a client as ``Role.CLIENT``) over the same
modules: readie's error families and the error types results name
(:mod:`readie_protocol.errors`), the protocol version, request ids and the
line encoder (:mod:`readie_protocol.wire`), the line limit and the splitter
that enforces it (:mod:`readie_protocol.lines`), what a request line may say
and its parser (:mod:`readie_protocol.requests`, sizes and durations in
:mod:`readie_protocol.units`), and the events a pool writes
(:mod:`readie_protocol.events`). Standard library only, beside the
executor's host-function codec (``readie_executor.hostwire``, itself
standard library only), whose rules requests share with the sandbox.
"""

from .connection import ENDED, NEED_DATA, PoolConnection, Role
from .lines import MAX_LINE_BYTES, Line, LineEvent, LineSplitter, OversizeLine, recover_id
from .wire import PROTOCOL_VERSION, RequestId, encode_line, id_problem, json_type

__all__ = [
    "ENDED",
    "MAX_LINE_BYTES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "Line",
    "LineEvent",
    "LineSplitter",
    "OversizeLine",
    "PoolConnection",
    "RequestId",
    "Role",
    "encode_line",
    "id_problem",
    "json_type",
    "recover_id",
]
