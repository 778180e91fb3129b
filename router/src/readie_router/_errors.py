"""readie's own errors: one base, a few families, mapped to pool error types once.

Job outcomes that belong to the code being run (a Python exception, a
timeout, a signal) are not exceptions here: they are values in a job result
(see ``_events.Outcome``). What lives here is what readie itself refuses or
fails at. Each family is turned into the pool protocol's ``error.type`` by
:func:`pool_error_type` and nowhere else; the gRPC front end will get its own
single mapping next to its servicer.
"""

from __future__ import annotations

# The families are the worker's: one hierarchy for all of readie.
from readie_worker.errors import ConfigError, PoolWorkerError, ReadieError, RequestError, SandboxSetupError, UnitError

__all__ = [
    "POOL_WORKER_ERROR",
    "REQUEST_ERROR",
    "SANDBOX_SETUP_ERROR",
    "SIGNAL_ERROR",
    "TIMEOUT_ERROR",
    "ConfigError",
    "PoolWorkerError",
    "ReadieError",
    "RequestError",
    "SandboxSetupError",
    "UnitError",
    "pool_error_type",
]

# The error types the pool protocol names besides Python exception classes.
REQUEST_ERROR = "RequestError"
TIMEOUT_ERROR = "TimeoutError"
SIGNAL_ERROR = "SignalError"
SANDBOX_SETUP_ERROR = "SandboxSetupError"
POOL_WORKER_ERROR = "PoolWorkerError"


# Most specific first; the first isinstance match wins.
_POOL_TYPES: tuple[tuple[type[BaseException], str], ...] = (
    (RequestError, REQUEST_ERROR),
    (UnitError, REQUEST_ERROR),
    (SandboxSetupError, SANDBOX_SETUP_ERROR),
    (PoolWorkerError, POOL_WORKER_ERROR),
)


def pool_error_type(exc: BaseException) -> str:
    """The pool protocol's ``error.type`` for an error readie raised.

    Anything not in the table (``ConfigError`` at run time, an unexpected bug)
    is reported as ``PoolWorkerError``: the job failed because of the pool,
    not because of the request or the job's own code.
    """
    for cls, name in _POOL_TYPES:
        if isinstance(exc, cls):
            return name
    return POOL_WORKER_ERROR
