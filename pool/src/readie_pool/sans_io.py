"""The pool protocol's sans-IO pieces (docs/pool.md), for clients that check themselves against it.

They live in :mod:`readie_protocol`: the :class:`~readie_protocol.connection.PoolConnection`
both ends drive, lines (``LineSplitter``), requests (``parse_request``), the
events and result lines, and the error families they name. This module adds
the engine's account of a job (``JobResult``, its ``Outcome``); the engine
that drives them is ``readie pool``.
"""

from readie_protocol.connection import PoolConnection, Role
from readie_protocol.errors import PoolWorkerError, RequestError
from readie_protocol.events import ErrorInfo, ReadyEvent, Result, RuntimeInfo
from readie_protocol.lines import MAX_LINE_BYTES, Line, LineSplitter, OversizeLine
from readie_protocol.requests import JobRequest, Refused, StatsRequest, parse_request

from ._events import JobResult, Outcome

__all__ = [
    "MAX_LINE_BYTES",
    "ErrorInfo",
    "JobRequest",
    "JobResult",
    "Line",
    "LineSplitter",
    "Outcome",
    "OversizeLine",
    "PoolConnection",
    "PoolWorkerError",
    "ReadyEvent",
    "Refused",
    "RequestError",
    "Result",
    "Role",
    "RuntimeInfo",
    "StatsRequest",
    "parse_request",
]
