"""The pool protocol's wire, shared by both ends: ``readie pool`` and its clients.

What both sides must agree on byte for byte lives here once: the protocol
version, the line limit and the splitter that enforces it without I/O
(:mod:`readie_protocol.lines`), request ids and the one line encoder
(:mod:`readie_protocol.wire`). Standard library only, so any client can
depend on it. What a line means (requests, results, events) is parsed by
each end into its own types; those are not here yet.
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
