"""The host directory of one sandbox: the only host storage it can reach besides its grants.

An isolated sandbox's directory is a tmpfs of its own, bounded in bytes and
inodes, holding:

* ``config.json``, the OCI bundle (written by the worker before start);
* ``run/``, the sandbox's ``/readie/run``, where the executor binds its
  socket: writable, so what a job can put there is bounded by the tmpfs.
  (Remounting it read-only once the socket answers would not help: runsc's
  gofer works in a mount namespace copied at start, which a remount in ours
  does not reach.)
* ``unused/``, an empty read-only directory: the source of every slot the
  job was granted nothing for (a write slot included: writes there fail
  with EROFS at the host, whatever the sandbox's own mount table says);
* ``grants/<slot>``, a bind mount of each held grant (``grants.HeldGrant``).

Removal unmounts the lot, which frees whatever was written without walking
it. An unisolated (development) sandbox gets a plain directory instead: its
executor is a host process that could write anywhere anyway.
"""

from __future__ import annotations

import os
import secrets
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

import structlog

from readie_executor.sockets import SOCKET_NAME

from ._mounts import bind_descriptor, bind_self, mount_tmpfs
from .grants import HeldGrant
from .paths import remove_tree

__all__ = ["SANDBOX_DIR_BYTES", "SANDBOX_DIR_INODES", "SandboxDir"]

log = structlog.get_logger("readie.sandbox")

# A sandbox id becomes part of the socket path, which may not exceed 107 bytes.
SANDBOX_ID_BYTES = 6
# The bundle's config.json (a few KB) is the only file with contents; the
# socket, the directories and the mount points are inodes with no data.
SANDBOX_DIR_BYTES = 256 * 1024
# The root, run/, unused/, grants/, a mount point per slot (10 planned) and a
# file placeholder per file grant, the socket and config.json: under 30.
SANDBOX_DIR_INODES = 64


@dataclass(frozen=True)
class SandboxDir:
    """One sandbox's host directory; make it with :meth:`create`, end it with :meth:`remove`."""

    id: str
    path: Path
    private: bool  # a tmpfs with mounts (isolated), or a plain directory
    # Slot destination -> the mount point of its grant in this directory.
    sources: Mapping[PurePosixPath, Path] = field(default_factory=dict)

    @property
    def executor_dir(self) -> Path:
        return self.path / "run"

    @property
    def socket_path(self) -> Path:
        return self.executor_dir / SOCKET_NAME

    @staticmethod
    def socket_path_in(run_dir: Path) -> Path:
        """The socket path of a sandbox under ``run_dir`` (all have the same length)."""
        return run_dir / ("rd-" + "0" * 2 * SANDBOX_ID_BYTES) / "run" / SOCKET_NAME

    @property
    def unused_slots(self) -> Path:
        return self.path / "unused"

    @property
    def pid_file(self) -> Path:
        """Where runsc writes the sandbox process's pid (beside the bundle, out of the sandbox's sight)."""
        return self.path / "sandbox.pid"

    @classmethod
    def create(cls, run_dir: Path, grants: Sequence[HeldGrant] = (), *, private: bool) -> SandboxDir:
        """A new directory under ``run_dir``; with ``private``, its tmpfs and the mounts of ``grants``."""
        sandbox_id = "rd-" + secrets.token_hex(SANDBOX_ID_BYTES)
        path = run_dir / sandbox_id
        path.mkdir(mode=0o700)
        try:
            sources = _populate(path, grants) if private else _plain(path)
        except BaseException:
            remove_tree(path)
            raise
        return cls(sandbox_id, path, private, sources)

    def remove(self) -> bool:
        """Unmount and remove everything; whether it is gone (a failure is logged). Never raises."""
        gone = remove_tree(self.path)
        if not gone:
            log.error("sandbox directory left behind", sandbox=self.id, path=str(self.path))
        return gone


def _plain(path: Path) -> dict[PurePosixPath, Path]:
    (path / "run").mkdir()
    (path / "unused").mkdir()
    return {}


def _populate(path: Path, grants: Sequence[HeldGrant]) -> dict[PurePosixPath, Path]:
    mount_tmpfs(path, size_bytes=SANDBOX_DIR_BYTES, inodes=SANDBOX_DIR_INODES)
    for directory in ("run", "unused", "grants"):
        (path / directory).mkdir(mode=0o700)
    # Before runsc starts: its gofer sees our mounts as they are then.
    bind_self(path / "unused", writable=False)
    sources: dict[PurePosixPath, Path] = {}
    for grant in grants:
        mount_point = path / "grants" / f"{grant.slot.parent.name}-{grant.slot.name}"
        mount_point.mkdir(mode=0o700)
        if grant.is_file:
            # A file cannot fill a directory slot: it goes in a read-only directory of its own.
            placeholder = mount_point / grant.name
            os.close(os.open(placeholder, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600))
            bind_self(mount_point, writable=False)
            bind_descriptor(grant.opened.fd, placeholder, writable=grant.writable)
        else:
            bind_descriptor(grant.opened.fd, mount_point, writable=grant.writable)
        sources[grant.slot] = mount_point
    return sources
