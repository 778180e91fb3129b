"""Grants that cannot move: host paths a job may read or write, held open from slot to sandbox end.

A grant is resolved once, when its job takes its worker slot: each path is
opened without following symlinks (``_grant_fs.open_no_follow``, the
worker's one way into paths under a grant) and the descriptor is what gets
mounted (``SandboxDir`` bind-mounts it into the sandbox's own directory, and
runsc mounts that; the mount holds it until the sandbox ends). A directory
renamed or replaced by a symlink after this moment changes nothing the
sandbox sees; one replaced before it is refused. Symlinks a job leaves in a
write grant are therefore never followed by readie, now or by a later job.
The sandbox keeps what each write grant was (:attr:`HeldGrants.write_grants`),
so that listing what a job wrote there can tell a grant swapped since.

A grant may name a directory or a single file (``package_dirs`` only
directories). Each takes one slot planned at capture, and is mounted at the
slot's ``grant`` point (a package dir: at the slot itself), which lets it
reach a sandbox restored before the job came (``_sandbox_dir``, decision
0034); a file is mounted inside a read-only directory of its own there, and
the job's link points at the file.

The worker's own paths are guarded: its sandboxes' and runsc's directories
can be granted neither way, and what every sandbox is made from (the rootfs,
checkpoint images, installed packages) can be read but never written: a
write grant over the rootfs would change every later sandbox.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from types import TracebackType

from ._grant_fs import OpenedPath, PathIdentity, PathKind, PathRefused, open_no_follow
from .bundle import GRANT_POINT, PACKAGE_SLOT_DIR, MountPlan
from .errors import RequestError

__all__ = ["HeldGrant", "HeldGrants", "hold_grants"]


@dataclass(frozen=True, slots=True)
class HeldGrant:
    """One opened grant and the slot it fills."""

    slot: PurePosixPath  # the mount point inside the sandbox
    opened: OpenedPath
    writable: bool

    @property
    def is_file(self) -> bool:
        return self.opened.kind is PathKind.FILE

    @property
    def name(self) -> str:
        """The granted file's own name, under which it appears in its slot."""
        return PurePosixPath(self.opened.path).name

    @property
    def is_package(self) -> bool:
        """A package dir fills its slot itself (the slot is on sys.path); a grant lies beneath its slot."""
        return self.slot.parent == PACKAGE_SLOT_DIR

    @property
    def mount_point(self) -> PurePosixPath:
        """Where this grant's mount appears inside the sandbox."""
        return self.slot if self.is_package else self.slot / GRANT_POINT

    @property
    def target(self) -> PurePosixPath:
        """Where the job's link to this grant points inside the sandbox."""
        return self.mount_point / self.name if self.is_file else self.mount_point


class HeldGrants:
    """A job's grants, open until :meth:`close` (a ``with`` block); made by :func:`hold_grants`."""

    def __init__(self, grants: Sequence[HeldGrant], links: Sequence[Mapping[str, object]]) -> None:
        self.grants = tuple(grants)
        # What the in-sandbox runner links: each granted host path -> its target.
        self.links = tuple(links)

    @property
    def write_grants(self) -> tuple[PathIdentity, ...]:
        """What each write grant led to when it was opened: a sandbox keeps these (no descriptor)
        to list what its jobs wrote there (``report_files``), and to tell a grant since swapped."""
        return tuple(grant.opened.identity for grant in self.grants if grant.writable)

    def close(self) -> None:
        for grant in self.grants:
            try:
                os.close(grant.opened.fd)
            except OSError:
                pass

    def __enter__(self) -> HeldGrants:
        return self

    def __exit__(self, kind: type[BaseException] | None, value: BaseException | None, tb: TracebackType | None) -> None:
        self.close()


NO_GRANTS = HeldGrants((), ())


def hold_grants(
    plan: MountPlan,
    *,
    allow_read: Iterable[str] = (),
    allow_write: Iterable[str] = (),
    package_dirs: Iterable[str] = (),
    private: Iterable[Path] = (),
    read_only: Iterable[Path] = (),
) -> HeldGrants:
    """Open every grant onto the slots planned at capture, or refuse naming the field.

    No grant may lie beneath or contain a ``private`` path, and no write
    grant a ``read_only`` one (both absolute and symlink-free). Nothing stays
    open when this raises.
    """
    private, read_only = tuple(private), tuple(read_only)
    held: list[HeldGrant] = []
    linked: list[HeldGrant] = []  # the grants that appear at their host paths
    links: list[Mapping[str, object]] = []
    try:
        for field_name, paths, slots, slot_of, writable in (
            ("allow_read", tuple(allow_read), plan.read_slots, plan.read_slot, False),
            ("allow_write", tuple(allow_write), plan.write_slots, plan.write_slot, True),
            ("package_dirs", tuple(package_dirs), plan.package_slots, plan.package_slot, False),
        ):
            if len(paths) > slots:
                raise RequestError(
                    f"{len(paths)} paths asked for, but sandboxes have {slots} such slots "
                    f"(planned at capture: [mounts] in checkpoints.toml)",
                    field=field_name,
                )
            for index, path in enumerate(paths):
                guarded = (*private, *read_only) if writable else private
                grant = HeldGrant(slot_of(index), _open(field_name, path, guarded), writable)
                held.append(grant)
                if field_name == "package_dirs":
                    if grant.is_file:
                        raise RequestError(f"{path!r} is not a directory", field=field_name)
                    continue  # on sys.path already; grants appear at their host path
                links.append({"path": path, "target": str(grant.target), "writable": writable})
                linked.append(grant)
        _refuse_nesting(linked)
    except BaseException:
        HeldGrants(held, ()).close()
        raise
    return HeldGrants(held, links)


def _refuse_nesting(linked: list[HeldGrant]) -> None:
    """Grants appear in the sandbox as links at their host paths, so one cannot lie in another
    (or be named twice): its link would have to be made inside the other's mount."""
    for grant in linked:
        for other in linked:
            if other is not grant and Path(grant.opened.path).is_relative_to(other.opened.path):
                field = "allow_write" if grant.writable else "allow_read"
                raise RequestError(
                    f"{grant.opened.path!r} lies in another grant, {other.opened.path!r}; "
                    "grants may not nest (grant the outer one, or each apart)",
                    field=field,
                )


def _open(field: str, path: str, guarded: tuple[Path, ...]) -> OpenedPath:
    try:
        opened = open_no_follow(path)
    except PathRefused as refused:
        raise RequestError(f"{path!r} {refused.reason}", field=field) from None
    granted = Path(path)
    for own in guarded:
        if granted.is_relative_to(own) or own.is_relative_to(granted):
            os.close(opened.fd)
            raise RequestError(f"{path!r} overlaps a directory the worker keeps for itself", field=field)
    return opened
