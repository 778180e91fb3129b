"""The pool protocol's sans-IO pieces (docs/pool.md), for clients that check themselves against it.

Lines in (``LineSplitter``), requests parsed (``parse_request``), events and
results out (``ready_event``, ``result_line``), and the error families the
result lines name. The engine that drives them is ``readie pool``.
"""

from readie_worker.errors import PoolWorkerError, RequestError
from ._events import ErrorInfo, JobResult, Outcome, RuntimeInfo, ready_event, result_line
from readie_protocol.lines import MAX_LINE_BYTES, Line, LineSplitter, OversizeLine
from readie_protocol.requests import JobRequest, Refused, StatsRequest, parse_request

__all__ = [
    "MAX_LINE_BYTES",
    "ErrorInfo",
    "JobRequest",
    "JobResult",
    "Line",
    "LineSplitter",
    "Outcome",
    "OversizeLine",
    "PoolWorkerError",
    "Refused",
    "RequestError",
    "RuntimeInfo",
    "StatsRequest",
    "parse_request",
    "ready_event",
    "result_line",
]
