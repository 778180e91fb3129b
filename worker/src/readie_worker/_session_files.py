"""Files in a session's workspace (decision 31), as methods of ``sessions.SandboxSession``.

Each call holds the session as a step does (``SandboxSession._with_workspace``:
refused while a step runs, a hibernated session resumed first); what is
refused, and why, is ``_workspace``'s.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from readie_protocol.cancel import NEVER, Cancellation
from readie_protocol.workspace import FileChunk, FileListing

from . import _workspace as workspace
from .errors import logged_under_its_id
from .jobs import CodeJob
from .sandbox import Sandbox

__all__ = ["SessionFiles"]

_R = TypeVar("_R")


class SessionFiles:
    """Upload, download and list a session's files; the session supplies ``job`` and ``_with_workspace``."""

    id: str
    job: CodeJob

    def _with_workspace(self, operation: Callable[[Sandbox], _R], cancel: Cancellation) -> _R:
        raise NotImplementedError

    @logged_under_its_id
    def upload_chunk(self, path: str, offset: int, data: bytes, size: int, *, cancel: Cancellation = NEVER) -> int:
        """Write ``data`` at ``offset`` of the ``size``-byte upload of ``path``; the bytes it holds now
        (``_workspace.upload_chunk``: what is refused, and why)."""
        return self._with_workspace(lambda sandbox: workspace.upload_chunk(sandbox, self.job, path, offset, data, size, cancel), cancel)

    @logged_under_its_id
    def download_chunk(self, path: str, offset: int, length: int, *, cancel: Cancellation = NEVER) -> FileChunk:
        """At most ``length`` bytes of ``path`` from ``offset`` (``_workspace.download_chunk``)."""
        return self._with_workspace(lambda sandbox: workspace.download_chunk(sandbox, self.job, path, offset, length, cancel), cancel)

    @logged_under_its_id
    def list_files(self, path: str, *, cancel: Cancellation = NEVER) -> FileListing:
        """The entries of directory ``path`` of the workspace (``_workspace.list_files``)."""
        return self._with_workspace(lambda sandbox: workspace.list_files(sandbox, self.job, path, cancel), cancel)
