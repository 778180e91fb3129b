"""The pool protocol's sans-IO pieces (docs/pool.md), for clients that check themselves against it.

They live in :mod:`readie_protocol`: the :class:`~readie_protocol.connection.PoolConnection`
both ends drive, lines (``LineSplitter``), requests (``parse_request``), the
events and result lines (a :class:`Result` with the :class:`Outcome` it
counts as), and the error families they name. This module adds how the
engine builds a refusal's result (``error_result``) and a result's policy
(``policy_info``); the engine that drives them is ``readie pool``.
"""

from readie_protocol.connection import PoolConnection, Role
from readie_protocol.errors import PoolWorkerError, RequestError
from readie_protocol.events import ErrorInfo, ReadyEvent, Result, RuntimeInfo
from readie_protocol.lines import MAX_LINE_BYTES, Line, LineSplitter, OversizeLine
from readie_protocol.requests import JobRequest, Refused, StatsRequest, parse_request
from readie_protocol.results import Outcome

from ._events import policy_info
from ._results import error_result

__all__ = [
    "MAX_LINE_BYTES",
    "ErrorInfo",
    "JobRequest",
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
    "error_result",
    "parse_request",
    "policy_info",
]
