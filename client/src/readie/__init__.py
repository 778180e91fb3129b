"""readie: run untrusted Python in gVisor sandboxes restored from checkpoints.

Two ways in:

* :class:`Pool` runs code (text or a script) as jobs in a ``readie pool``
  process, one fresh sandbox per job, with per-job grants and limits; a
  job's outcome is a :class:`Result`. :class:`AsyncPool` is the same on
  asyncio. :meth:`Pool.session` gives a
  :class:`Session`, one sandbox whose variables survive between steps, and
  :func:`tool` wraps either as a tool a model can call.
* :class:`Client` and :func:`remote` run Python functions in sandboxes
  behind a ``readie router``; the value comes back, an exception comes back
  as :class:`RemoteError`.

See client/README.md for the decisions behind the API.
"""

from readie_protocol.events import (
    ErrorInfo, FileInfo, NetworkReport, OutputEvent, PolicyInfo, ReadyEvent, RefusedConnection, Result, RuntimeInfo, Value,
)
from readie_protocol.workspace import FileEntry, LeftOut

from ._async_pool import AsyncPool
from ._async_session import AsyncSession
from ._envelope import SANDBOX_PYTHON, RemoteResult
from ._errors import (
    CallTimeout,
    EnvelopeError,
    FileChanged,
    JobError,
    PoolError,
    PoolWorkerError,
    ReadieError,
    RemoteError,
    RequestError,
    SandboxSetupError,
    VersionMismatch,
    WaitTimeout,
)
from ._pool import MAX_EVENT_LINE_BYTES, Pool
from ._remote import Client, RemoteFunction, remote
from ._requests import MAX_LINE_BYTES
from ._session import Session
from ._transfers import FileList
from ._tool import Tool, describe_functions, format_result, tool

__all__ = [
    "MAX_EVENT_LINE_BYTES",
    "MAX_LINE_BYTES",
    "SANDBOX_PYTHON",
    "AsyncPool",
    "AsyncSession",
    "CallTimeout",
    "Client",
    "EnvelopeError",
    "ErrorInfo",
    "FileChanged",
    "FileEntry",
    "FileInfo",
    "FileList",
    "JobError",
    "LeftOut",
    "NetworkReport",
    "OutputEvent",
    "PolicyInfo",
    "Pool",
    "PoolError",
    "PoolWorkerError",
    "ReadieError",
    "ReadyEvent",
    "RefusedConnection",
    "RemoteError",
    "RemoteFunction",
    "RemoteResult",
    "RequestError",
    "Result",
    "RuntimeInfo",
    "Value",
    "SandboxSetupError",
    "Session",
    "Tool",
    "VersionMismatch",
    "WaitTimeout",
    "describe_functions",
    "format_result",
    "remote",
    "tool",
]
