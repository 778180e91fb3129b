"""What both ends of the pool protocol share: ``readie pool`` and its clients.

Both ends drive one sans-IO :class:`~readie_protocol.connection.PoolConnection`
(the pool as ``Role.POOL``, a client as ``Role.CLIENT``) over the same
modules: readie's error families and the error types results name
(:mod:`readie_protocol.errors`), the protocol version, request ids and the
line encoder (:mod:`readie_protocol.wire`), the line limit and the splitter
that enforces it (:mod:`readie_protocol.lines`), what a request line may say
and its parser (:mod:`readie_protocol.requests`, a job's fields in
:mod:`readie_protocol.job_requests`, sizes and durations in :mod:`readie_protocol.units`),
files in a job's workspace and a session's transfers (:mod:`readie_protocol.workspace`,
:mod:`readie_protocol.transfers`), and the events a pool writes
(:mod:`readie_protocol.events`; a result and the outcome it counts as in
:mod:`readie_protocol.results`), and a caller's :class:`~readie_protocol.cancel.Cancellation`.
Standard library only, beside the executor's host-function codec and job
bounds (``readie_executor.hostwire``, ``readie_executor.jobs``, themselves
standard library only), whose rules requests share with the sandbox.
This package exports the requests, the events and the errors by name, so a
client writes ``from readie_protocol import JobRequest, Result, RequestError``.
"""

from .connection import ENDED, NEED_DATA, PoolConnection, Role
from .errors import (
    ConfigError,
    ErrorType,
    ExecutorTimeout,
    PoolError,
    PoolWorkerError,
    ReadieError,
    RequestError,
    SandboxSetupError,
    UnitError,
    VersionMismatch,
)
from .events import (
    AttachedEvent,
    CallEvent,
    CancelledEvent,
    ClosedEvent,
    ErrorInfo,
    FileInfo,
    ForkedEvent,
    HibernatedEvent,
    NetworkReport,
    OutputEvent,
    PolicyInfo,
    ReadyEvent,
    RefusedConnection,
    Result,
    RuntimeInfo,
    StatsEvent,
    Value,
)
from .lines import MAX_LINE_BYTES, Line, LineEvent, LineSplitter, OversizeLine, recover_id
from .requests import (
    AttachSession,
    CancelJob,
    CloseSession,
    ForkSession,
    HibernateSession,
    JobRequest,
    Refused,
    ReplyRequest,
    Request,
    StatsRequest,
    build_job,
    parse_request,
)
from .results import JobError
from .transfers import (
    ChunkEvent,
    DownloadChunk,
    ListFiles,
    ListingEvent,
    UploadChunk,
    UploadedEvent,
    build_transfer,
)
from .wire import PROTOCOL_VERSION, RequestId, encode_line, id_problem, json_type
from .workspace import (
    DOWNLOAD_CHUNK_BYTES,
    MAX_TRANSFER_BYTES,
    UPLOAD_CHUNK_BYTES,
    Collected,
    FileChunk,
    FileEntry,
    FileListing,
    LeftOut,
)

__all__ = [
    "DOWNLOAD_CHUNK_BYTES",
    "ENDED",
    "MAX_LINE_BYTES",
    "MAX_TRANSFER_BYTES",
    "NEED_DATA",
    "PROTOCOL_VERSION",
    "CallEvent",
    "AttachSession",
    "AttachedEvent",
    "CancelJob",
    "CancelledEvent",
    "ChunkEvent",
    "Collected",
    "CloseSession",
    "ClosedEvent",
    "ConfigError",
    "DownloadChunk",
    "ErrorInfo",
    "ErrorType",
    "ExecutorTimeout",
    "FileChunk",
    "FileEntry",
    "FileInfo",
    "FileListing",
    "ForkSession",
    "ForkedEvent",
    "HibernateSession",
    "HibernatedEvent",
    "JobError",
    "JobRequest",
    "LeftOut",
    "Line",
    "LineEvent",
    "LineSplitter",
    "ListFiles",
    "ListingEvent",
    "NetworkReport",
    "OutputEvent",
    "OversizeLine",
    "PolicyInfo",
    "PoolConnection",
    "PoolError",
    "PoolWorkerError",
    "ReadieError",
    "ReadyEvent",
    "Refused",
    "RefusedConnection",
    "ReplyRequest",
    "Request",
    "RequestError",
    "RequestId",
    "Result",
    "Role",
    "RuntimeInfo",
    "SandboxSetupError",
    "StatsEvent",
    "StatsRequest",
    "UPLOAD_CHUNK_BYTES",
    "UnitError",
    "UploadChunk",
    "UploadedEvent",
    "Value",
    "VersionMismatch",
    "build_job",
    "build_transfer",
    "encode_line",
    "id_problem",
    "json_type",
    "parse_request",
    "recover_id",
]
