"""What both ends of the pool protocol share: ``readie pool`` and its clients.

What both sides must agree on lives here once: readie's error families and
the error types results name (:mod:`readie_protocol.errors`), the protocol
version, request ids and the one line encoder (:mod:`readie_protocol.wire`),
the line limit and the splitter that enforces it without I/O
(:mod:`readie_protocol.lines`), and the ready event and result line as
values both ends build and parse (:mod:`readie_protocol.events`). Standard
library only, so any client can depend on it. Requests are still built by
the client and parsed by the engine, each into its own shape.
"""

from .lines import MAX_LINE_BYTES, Line, LineEvent, LineSplitter, OversizeLine, recover_id
from .wire import PROTOCOL_VERSION, RequestId, encode_line, id_problem, json_type

__all__ = [
    "MAX_LINE_BYTES",
    "PROTOCOL_VERSION",
    "Line",
    "LineEvent",
    "LineSplitter",
    "OversizeLine",
    "RequestId",
    "encode_line",
    "id_problem",
    "json_type",
    "recover_id",
]
