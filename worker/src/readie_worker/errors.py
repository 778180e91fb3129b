"""readie's error hierarchy: one base, a few families.

Mapped to pool error types and gRPC status codes in exactly one place each
(the router's boundary), never ad hoc.
"""

from __future__ import annotations


class ReadieError(Exception):
    """Base of every error readie raises on purpose."""


class RequestError(ReadieError):
    """A request was refused before anything ran.

    ``field`` names the request field at fault when there is one (dotted for
    nested values, e.g. ``reply.call_id``); the message then starts with it,
    so a client that only shows the message still learns which field.
    """

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(f"{field}: {message}" if field else message)
        self.field = field
        self.reason = message


class SandboxSetupError(ReadieError):
    """A sandbox could not be made ready: restore, cold start, mounts, socket."""


class PoolWorkerError(ReadieError):
    """The worker (or the sandbox under a job) failed in a way that is not the job's doing."""


class Cancelled(PoolWorkerError):
    """The caller gave up (a cancelled call, a passed deadline) before the work could start."""


class ManifestError(SandboxSetupError):
    """The checkpoint manifest cannot be trusted as a whole."""


class CheckpointUnusable(SandboxSetupError):
    """One checkpoint of an otherwise good manifest cannot be used (missing or corrupt image)."""


class UnitError(ReadieError, ValueError):
    """A size or duration could not be parsed; callers re-raise it naming the field or key."""


class ConfigError(ReadieError):
    """A TOML configuration (``readie.toml``) is unusable; names the file, the key and the reason."""

    def __init__(self, path: str, key: str | None, reason: str) -> None:
        where = f"{path}: {key}" if key else path
        super().__init__(f"{where}: {reason}")
        self.path = path
        self.key = key
        self.reason = reason


#: Error messages quote the value at fault, cut to this many characters: a
#: megabyte-long "timeout" must not come back as a megabyte-long error.
MAX_SHOWN_CHARS = 64


def shown(text: str) -> str:
    """``text`` quoted for an error message, cut to :data:`MAX_SHOWN_CHARS`."""
    if len(text) <= MAX_SHOWN_CHARS:
        return repr(text)
    return repr(text[:MAX_SHOWN_CHARS]) + f"... ({len(text)} characters)"
