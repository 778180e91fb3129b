"""The worker's errors: readie's families (``readie_protocol.errors``) and the worker's own subclasses.

The families, the error types results name and the table between them are
``readie_protocol``'s, re-exported here so worker code has one place to
import from. The gRPC status mapping is the other edge, in ``_status``.
"""

from __future__ import annotations

from readie_protocol.errors import (
    MAX_SHOWN_CHARS,
    ConfigError,
    ErrorType,
    ExecutorTimeout,
    PoolWorkerError,
    ReadieError,
    RequestError,
    SandboxSetupError,
    UnitError,
    error_type,
    family_of,
    shown,
)

__all__ = [
    "MAX_SHOWN_CHARS",
    "Cancelled",
    "CheckpointUnusable",
    "ConfigError",
    "ErrorType",
    "ExecutorTimeout",
    "ManifestError",
    "PoolWorkerError",
    "ReadieError",
    "RequestError",
    "SandboxSetupError",
    "UnitError",
    "error_type",
    "family_of",
    "shown",
]



class Cancelled(PoolWorkerError):
    """The caller gave up (a cancelled call, a passed deadline) before the work could start."""


class ManifestError(SandboxSetupError):
    """The checkpoint manifest cannot be trusted as a whole."""


class CheckpointUnusable(SandboxSetupError):
    """One checkpoint of an otherwise good manifest cannot be used (missing or corrupt image)."""
