"""The host mounts a worker makes for its sandboxes, and their removal.

Each sandbox's directory is a small tmpfs of its own, and each grant is a
bind mount of a descriptor the worker opened without following symlinks
(``paths.open_no_follow``): runsc is handed a mount point inside that tmpfs,
which nothing but the worker can change. Unmounting the tmpfs frees
whatever a sandbox left in its executor dir, however deep, without walking
it.

The mounts live in a mount namespace of the worker's own
(:func:`enter_mount_namespace`), a slave of the host's so that host mounts
still arrive: a worker killed with its mounts in place takes them with it
when its last process (a sandbox it started) ends, instead of leaving a bind
mount of someone's write grant under ``/tmp`` for a tmp cleaner to walk into.

Everything here needs CAP_SYS_ADMIN (a worker runs as root, as runsc does).
"""

from __future__ import annotations

import ctypes
import errno
import os
import re
from collections.abc import Iterable
from pathlib import Path

import structlog

from .errors import SandboxSetupError

__all__ = [
    "bind_descriptor",
    "bind_self",
    "enter_mount_namespace",
    "make_private",
    "make_shared",
    "move_mount",
    "in_mount_namespace",
    "mount_tmpfs",
    "unmount_beneath",
]

log = structlog.get_logger("readie.mounts")

# <sys/mount.h>, <sched.h>
MS_RDONLY = 0x1
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_NOEXEC = 0x8
MS_REMOUNT = 0x20
MS_BIND = 0x1000
MS_MOVE = 0x2000
MS_REC = 0x4000
MS_PRIVATE = 0x40000
MS_SLAVE = 0x80000
MS_SHARED = 0x100000
MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
CLONE_NEWNS = 0x00020000
# Flags every mount we make carries: nothing on them is a device or setuid.
SAFE_FLAGS = MS_NOSUID | MS_NODEV

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
_libc.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
_libc.unshare.argtypes = [ctypes.c_int]

_entered = False
# /proc/self/mountinfo escapes space, tab, newline and backslash in octal.
_MOUNTINFO_ESCAPE = re.compile(rb"\\([0-7]{3})")


def enter_mount_namespace() -> None:
    """Move this process into a mount namespace of its own (once); sandboxes it starts share it.

    Only a single-threaded process can do it for all of itself: a thread
    that unshares its namespace leaves the others in the old one. So this
    runs first thing in ``readie worker``, ``readie pool`` and ``readie
    capture``, and a program embedding a worker calls it before it starts
    threads; :class:`~readie_worker.core.Worker` refuses to start otherwise.
    Not root, it does nothing: such a process runs no gVisor sandbox.
    """
    global _entered
    if _entered or os.geteuid() != 0:
        return
    threads = len(os.listdir("/proc/self/task"))
    if threads > 1:
        raise SandboxSetupError(
            f"cannot give the worker a mount namespace of its own: the process already runs "
            f"{threads} threads (call readie_worker.enter_mount_namespace() before starting any)"
        )
    if _libc.unshare(CLONE_NEWNS) != 0:
        raise SandboxSetupError(f"cannot give the worker a mount namespace of its own: {_strerror()}")
    # A slave receives the host's mount events and sends none back.
    _mount(None, "/", None, MS_REC | MS_SLAVE)
    _entered = True


def in_mount_namespace() -> bool:
    return _entered


def mount_tmpfs(target: Path, *, size_bytes: int, inodes: int) -> None:
    _mount("tmpfs", target, "tmpfs", SAFE_FLAGS | MS_NOEXEC, f"size={size_bytes},nr_inodes={inodes},mode=0700")


def bind_descriptor(fd: int, target: Path, *, writable: bool) -> None:
    """Mount the directory or file held open as ``fd`` at ``target``: not a path, so nothing
    that happens to the path the descriptor was opened by can change what is mounted.

    Not recursive: mounts beneath the granted directory (another sandbox's,
    for one) are not part of the grant.
    """
    # The kernel follows /proc/self/fd/N to the open file itself, not to a name.
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND)
    _remount(target, writable=writable)


def bind_self(path: Path, *, writable: bool) -> None:
    """Make ``path`` a mount of itself, so that it can be made read-only on its own."""
    _mount(path, path, None, MS_BIND)
    _remount(path, writable=writable)


def make_shared(path: Path) -> None:
    """Make the mount at ``path`` a peer group's first member: a mount placed beneath it later
    reaches every copy made of it since (runsc's gofer's, as slaves), and none comes back."""
    _mount(None, path, None, MS_SHARED)


def make_private(path: Path) -> None:
    """Cut the mount at ``path`` and those beneath it from every peer group and master: no
    mount made elsewhere (the host's, under a granted directory) reaches them after this."""
    _mount(None, path, None, MS_REC | MS_PRIVATE)


def move_mount(source: Path, target: Path) -> None:
    """Move the mount at ``source`` (whose parent must not be shared) to ``target``, flags and all:
    if ``target`` lies on a shared mount, the copies it propagates are made of the mount as it is."""
    _mount(source, target, None, MS_MOVE)


def unmount_beneath(path: Path) -> bool:
    """Detach every mount at or beneath ``path``; whether none is left. Never raises.

    A lazy unmount takes every mount beneath the one it detaches along with it,
    so only the topmost are unmounted: each unmount waits for the kernel's
    grace period (~1 ms here), and a sandbox dir holds a mount per slot. A
    sandbox dir is itself the topmost (its tmpfs), so ``path`` is tried first,
    before the table is read: each read of it costs ~0.3 ms of CPU with a busy
    worker's mounts (decision 33). Whatever is left then (a mount that arrived
    meanwhile) is tried deepest first.
    """
    if _libc.umount2(os.fsencode(path), MNT_DETACH | UMOUNT_NOFOLLOW) != 0:  # not a mount point itself
        found = [str(point) for point in mounts_beneath(path)]
        _detach(Path(point) for point in found if not any(point.startswith(other + "/") for other in found))
    left = mounts_beneath(path)
    if left:
        _detach(left)
        left = mounts_beneath(path)
    if left:
        log.error("mounts left beneath a directory being removed", path=str(path), mounts=[str(m) for m in left])
    return not left


# --------------------------------------------------------------------------- helpers


def _detach(mount_points: Iterable[Path]) -> None:
    for mount_point in mount_points:
        if _libc.umount2(os.fsencode(mount_point), MNT_DETACH) != 0:
            code = ctypes.get_errno()
            if code not in (errno.EINVAL, errno.ENOENT):  # not (or no longer) a mount point
                log.error("cannot unmount", path=str(mount_point), error=os.strerror(code))


def _mount(source: str | Path | None, target: str | Path, fstype: str | None, flags: int, data: str | None = None) -> None:
    encoded = None if source is None else os.fsencode(source)
    result = _libc.mount(
        encoded, os.fsencode(target), None if fstype is None else fstype.encode(), flags, None if data is None else data.encode()
    )
    if result != 0:
        raise SandboxSetupError(f"cannot mount {target}: {_strerror()}")


def _remount(target: Path, *, writable: bool) -> None:
    flags = MS_BIND | MS_REMOUNT | SAFE_FLAGS | (0 if writable else MS_RDONLY)
    _mount(None, target, None, flags)


def _strerror() -> str:
    return os.strerror(ctypes.get_errno())


def mounts_beneath(path: Path) -> list[Path]:
    """Mount points at or beneath ``path`` in this namespace (resolved, as the kernel reports them), deepest first.

    Only the lines that name ``path`` (as the kernel escapes it) are parsed: the table holds every
    live sandbox's mounts, and parsing each line took ~0.5 ms a call under load (decision 33).
    """
    top = os.fsencode(os.path.realpath(path))  # the kernel reports mount points resolved
    with open("/proc/self/mountinfo", "rb") as mountinfo:
        return _mount_points_beneath(mountinfo.read(), top)


def _mount_points_beneath(table: bytes, top: bytes) -> list[Path]:
    """The mount points at or beneath ``top`` in ``table`` (mountinfo's text), deepest first."""
    below = top + b"/"
    wanted = _mountinfo_escaped(top)
    found = []
    at = table.find(wanted)
    while at >= 0:
        start = table.rfind(b"\n", 0, at) + 1
        end = table.find(b"\n", at)
        end = len(table) if end < 0 else end
        fields = table[start:end].split(b" ", 5)  # the mount point is the fifth field
        if len(fields) >= 5:
            point = fields[4]
            if b"\\" in point:  # the kernel escapes space, tab, newline and backslash as \ooo
                point = _MOUNTINFO_ESCAPE.sub(lambda m: bytes([int(m.group(1), 8)]), point)
            if point == top or point.startswith(below):
                found.append(Path(os.fsdecode(point)))
        at = table.find(wanted, end)
    return sorted(found, key=lambda p: len(p.parts), reverse=True)


def _mountinfo_escaped(path: bytes) -> bytes:
    """``path`` as /proc/self/mountinfo writes it."""
    for char in b"\\ \t\n":  # the backslash first: the others' escapes hold one
        path = path.replace(bytes([char]), b"\\%03o" % char)
    return path
