"""The host directory of one sandbox: the only host storage it can reach besides its grants.

An isolated sandbox's directory is a tmpfs of its own, bounded in bytes and
inodes, holding:

* ``config.json``, the OCI bundle (written by the worker before start);
* ``run/``, the sandbox's ``/readie/run``, where the executor binds its
  socket: writable, so what a job can put there is bounded by the tmpfs.
  (Remounting it read-only once the socket answers would not help: runsc's
  gofer works in a mount namespace copied at start, which a remount in ours
  does not reach.)
* ``unused/``, an empty read-only directory: the source of every package
  slot the job was granted nothing for;
* ``slots/<slot>``, the source of each read and write slot: a read-only
  mount of an empty ``grant`` directory, made shared before runsc starts, so
  that the copies runsc's gofer makes of it (slaves, in its own mount
  namespace) receive what is later mounted on ``grant``. That is how a
  grant reaches a sandbox restored before its job came (:meth:`SandboxDir.attach`,
  decision 0034). An unfilled write slot stays read-only at the host (EROFS);
* ``grants/<slot>``, where each held grant is mounted first (``grants.HeldGrant``):
  read-only if it is, and cut from every peer group, before it is moved onto
  its slot's ``grant`` point, since the copies a move propagates are made of the
  mount as it is then (a later remount would not reach them). A package dir
  stays here, as its slot's source.

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

from ._mounts import bind_descriptor, bind_self, make_private, make_shared, mount_tmpfs, mounts_beneath, move_mount
from .bundle import GRANT_POINT
from .errors import SandboxSetupError
from .grants import HeldGrant
from .paths import remove_tree

__all__ = ["SANDBOX_DIR_BYTES", "SANDBOX_DIR_INODES", "SandboxDir"]

log = structlog.get_logger("readie.sandbox")

# A sandbox id becomes part of the socket path, which may not exceed 107 bytes.
SANDBOX_ID_BYTES = 6
# The bundle's config.json (a few KB) is the only file with contents; the
# socket, the directories and the mount points are inodes with no data.
SANDBOX_DIR_BYTES = 256 * 1024
# The root, run/, unused/, slots/, grants/, two per read or write slot and one
# per package slot (at most 3 x 16, bundle.MAX_SLOTS), a file placeholder per
# file grant (up to 32), the socket, the pid file and config.json: under 128.
SANDBOX_DIR_INODES = 128


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
    def create(
        cls, run_dir: Path, grants: Sequence[HeldGrant] = (), *, private: bool, grant_slots: Sequence[PurePosixPath] = ()
    ) -> SandboxDir:
        """A new directory under ``run_dir``; with ``private``, its tmpfs, a source for each of
        ``grant_slots`` (a grant may be attached there later) and the mounts of ``grants``."""
        sandbox_id = "rd-" + secrets.token_hex(SANDBOX_ID_BYTES)
        path = run_dir / sandbox_id
        path.mkdir(mode=0o700)
        try:
            sources = _populate(path, grants, grant_slots) if private else _plain(path)
        except BaseException:
            remove_tree(path)
            raise
        return cls(sandbox_id, path, private, sources)

    def attach(self, grants: Sequence[HeldGrant]) -> None:
        """Mount each grant at its slot's ``grant`` point, whether runsc runs yet or not.

        SandboxSetupError for a slot this directory has no source for (a package
        slot, one not planned) or one already filled; what was attached before
        stays, for :meth:`remove` to unmount.
        """
        if not self.private:
            raise SandboxSetupError(f"sandbox {self.id}: an unisolated sandbox mounts no grants")
        for grant in grants:
            _attach(self.path, grant)

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


def _populate(path: Path, grants: Sequence[HeldGrant], grant_slots: Sequence[PurePosixPath]) -> dict[PurePosixPath, Path]:
    mount_tmpfs(path, size_bytes=SANDBOX_DIR_BYTES, inodes=SANDBOX_DIR_INODES)
    for directory in ("run", "unused", "grants", "slots"):
        (path / directory).mkdir(mode=0o700)
    # Before runsc starts: its gofer sees our mounts as they are then, and only
    # what lands on a shared mount's grant point reaches it after.
    bind_self(path / "unused", writable=False)
    sources: dict[PurePosixPath, Path] = {}
    for slot in grant_slots:
        source = path / "slots" / _slot_name(slot)
        source.mkdir(mode=0o700)
        (source / GRANT_POINT).mkdir(mode=0o700)
        bind_self(source, writable=False)
        make_shared(source)
        sources[slot] = source
    for grant in grants:
        if grant.is_package:
            sources[grant.slot] = _sealed(_mount_grant(path, grant), grant)
        else:
            _attach(path, grant)
    return sources


def _attach(path: Path, grant: HeldGrant) -> None:
    point = path / "slots" / _slot_name(grant.slot) / GRANT_POINT
    if grant.is_package or not point.is_dir():
        raise SandboxSetupError(f"sandbox {path.name}: no slot {grant.slot} to attach a grant to")
    if (path / "grants" / _slot_name(grant.slot)).exists():  # where each grant is made, once
        raise SandboxSetupError(f"sandbox {path.name}: slot {grant.slot} already holds a grant")
    # Moved whole once sealed: its flags travel with it.
    move_mount(_sealed(_mount_grant(path, grant), grant), point)


def _sealed(staged: Path, grant: HeldGrant) -> Path:
    """``staged``, cut from the host's peer groups, so that a mount made later beneath the
    granted directory is no part of the grant; refused if one arrived before the cut (in the
    instant between bind and cut the grant still received them), which could be writable."""
    make_private(staged)
    points = mounts_beneath(staged)  # deepest first, as the kernel names them: the last is ``staged``
    top = points[-1] if points else staged
    arrived = set(points) - ({top, top / grant.name} if grant.is_file else {top})
    if arrived or not points:
        raise SandboxSetupError(
            f"sandbox {staged.parent.parent.name}: a mount appeared beneath grant {grant.slot} while it was made"
        )
    return staged


def _mount_grant(path: Path, grant: HeldGrant) -> Path:
    """Mount ``grant`` at a place of its own under ``grants/`` (not yet seen by any sandbox)."""
    mount_point = path / "grants" / _slot_name(grant.slot)
    mount_point.mkdir(mode=0o700)
    if grant.is_file:
        # A file cannot fill a directory: it goes in a read-only directory of its own.
        placeholder = mount_point / grant.name
        os.close(os.open(placeholder, os.O_CREAT | os.O_EXCL | os.O_WRONLY | os.O_CLOEXEC, 0o600))
        bind_self(mount_point, writable=False)
        bind_descriptor(grant.opened.fd, placeholder, writable=grant.writable)
    else:
        bind_descriptor(grant.opened.fd, mount_point, writable=grant.writable)
    return mount_point


def _slot_name(slot: PurePosixPath) -> str:
    return f"{slot.parent.name}-{slot.name}"
