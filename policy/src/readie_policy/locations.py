"""Where the checkpoints are: one search order for every readie command and the client.

In order, the first that applies wins (decision 15):

1. ``--checkpoints PATH`` (a manifest, or the directory holding ``manifest.json``);
2. ``$READIE_CHECKPOINTS`` (the same);
3. ``./build/checkpoints``, if it holds a manifest (a checkout where ``make capture`` ran);
4. ``$READIE_CACHE/checkpoints`` (default ``~/.cache/readie/checkpoints``, beside
   the rootfs the manifests point into): ``make capture`` links it to the
   checkout it captured in, so every directory finds the last capture.

A flag or variable that names no manifest is an error, not a reason to look
further: a typo must not quietly run other checkpoints. Whatever is found is
then held to the same rule as the host paths of a grant: the manifest and
every directory above it are owned by root or by us, and none is writable by
anyone else (a sticky directory such as ``/tmp`` excepted above the
checkpoint directory itself), so nobody else can swap the manifest or a
path component between this check and the read. The manifest's own checks
(protocol, runsc, fingerprints, image hashes) stay ``manifest``'s.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from readie_protocol.errors import SandboxSetupError

__all__ = [
    "BUILD_CHECKPOINTS",
    "CACHE_VARIABLE",
    "CHECKPOINTS_VARIABLE",
    "MANIFEST_NAME",
    "CheckpointsNotFound",
    "Located",
    "UnsafeCheckpoints",
    "cache_dir",
    "check_owned",
    "default_checkpoints",
    "link_default",
    "locate_checkpoints",
]

#: The file a checkpoint directory is found by: the manifest that names its images.
MANIFEST_NAME = "manifest.json"
CHECKPOINTS_VARIABLE = "READIE_CHECKPOINTS"
CACHE_VARIABLE = "READIE_CACHE"
#: What ``make capture`` writes, relative to a checkout (and to the working directory).
BUILD_CHECKPOINTS = Path("build") / "checkpoints"
# Bits that let someone other than the owner change a directory's entries.
_OTHERS_WRITE = stat.S_IWGRP | stat.S_IWOTH


class CheckpointsNotFound(SandboxSetupError):
    """No manifest where the search order looked; the message lists each place and why."""


class UnsafeCheckpoints(SandboxSetupError):
    """A manifest was found, but someone other than its owner could change it or its path."""


@dataclass(frozen=True)
class Located:
    """A manifest found by :func:`locate_checkpoints`: its resolved path and what named it."""

    manifest: Path  # absolute, symlinks resolved: later reads never follow the link again
    source: str  # "--checkpoints", "$READIE_CHECKPOINTS", "./build/checkpoints" or the default

    @property
    def directory(self) -> Path:
        return self.manifest.parent


def cache_dir(environ: Mapping[str, str] | None = None) -> Path:
    """readie's per-user cache: ``$READIE_CACHE``, else ``~/.cache/readie`` (the rootfs lives here)."""
    env = os.environ if environ is None else environ
    return Path(env.get(CACHE_VARIABLE) or Path(env.get("HOME") or Path.home()) / ".cache" / "readie")


def default_checkpoints(environ: Mapping[str, str] | None = None) -> Path:
    """The per-user default, step 4 of the search: ``<cache>/checkpoints``."""
    return cache_dir(environ) / "checkpoints"


def locate_checkpoints(
    given: str | os.PathLike[str] | None = None,
    *,
    cwd: Path | None = None,
    environ: Mapping[str, str] | None = None,
    flag: str = "--checkpoints",
) -> Located:
    """The checkpoint manifest by the search order above, checked by :func:`check_owned`.

    Raises :class:`CheckpointsNotFound` naming every place it looked, or
    :class:`UnsafeCheckpoints`.
    """
    env = os.environ if environ is None else environ
    here = Path(cwd) if cwd is not None else Path.cwd()
    variable = env.get(CHECKPOINTS_VARIABLE) or None
    if given is not None and os.fspath(given):
        return _named(Path(here, given), flag)
    if variable is not None:
        return _named(Path(here, variable), f"${CHECKPOINTS_VARIABLE}")
    looked = [f"{flag}: not given", f"${CHECKPOINTS_VARIABLE}: not set"]
    for label, directory in (
        (f"./{BUILD_CHECKPOINTS}", here / BUILD_CHECKPOINTS),
        (_home_relative(default_checkpoints(env), env), default_checkpoints(env)),
    ):
        manifest = directory / MANIFEST_NAME
        if manifest.is_file():
            return _checked(manifest, label)
        looked.append(f"{label}: {_why_not(directory)}")
    raise CheckpointsNotFound(
        "no checkpoints found; looked, in order, at:\n"
        + "".join(f"  {line}\n" for line in looked)
        + "run `make capture` in a readie checkout (it links the default to its build/checkpoints), "
        f"or name them with {flag} DIR or {CHECKPOINTS_VARIABLE}=DIR"
    )


def _named(path: Path, source: str) -> Located:
    manifest = path / MANIFEST_NAME if path.is_dir() else path
    if not manifest.is_file():
        raise CheckpointsNotFound(
            f"no checkpoint manifest at {manifest} (named by {source}): build the checkpoints "
            "with `make capture`, or point it at the directory holding manifest.json"
        )
    return _checked(manifest, source)


def _checked(manifest: Path, source: str) -> Located:
    resolved = Path(os.path.realpath(manifest))
    check_owned(Path(os.path.abspath(manifest)), source)  # the path as named: its links and dirs
    check_owned(resolved, source)  # and where they lead
    return Located(resolved, source)


def check_owned(path: Path, source: str = "the checkpoints") -> None:
    """Refuse ``path`` unless it and every directory above it are owned by root or by us and
    writable by nobody else; above the last directory a sticky bit (``/tmp``) is enough.

    Symlinks met on the way must be ours or root's (their targets are checked by
    the caller resolving them).
    """
    allowed = {0, os.geteuid()}
    parts = path.parts
    for depth in range(len(parts), 0, -1):
        current = Path(*parts[:depth])
        try:
            info = os.lstat(current)
        except OSError as exc:
            raise UnsafeCheckpoints(f"{current} ({source}): {exc.strerror}") from None
        if info.st_uid not in allowed:
            raise UnsafeCheckpoints(
                f"refusing the checkpoints at {path} ({source}): {current} belongs to uid {info.st_uid}, "
                "neither root nor us, so its owner could replace what readie restores"
            )
        if stat.S_ISLNK(info.st_mode):
            continue
        near = depth >= len(parts) - 1  # the manifest and the checkpoint directory itself
        if info.st_mode & _OTHERS_WRITE and (near or not info.st_mode & stat.S_ISVTX):
            raise UnsafeCheckpoints(
                f"refusing the checkpoints at {path} ({source}): {current} is writable by others "
                f"(mode {stat.filemode(info.st_mode)}); chmod go-w it"
            )


def link_default(directory: Path, environ: Mapping[str, str] | None = None) -> Path | None:
    """Point the per-user default at ``directory`` (what ``readie capture --link-default`` does).

    The link is made beside the default under a temporary name and renamed
    over it, so a reader sees the old link or the new one. A real directory
    there is left alone (someone captured into it). Returns the link, or None
    when the default already is ``directory``.
    """
    target = Path(os.path.realpath(directory))
    link = default_checkpoints(environ)
    if os.path.realpath(link) == str(target):
        return None
    link.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    check_owned(link.parent, "the default's directory")
    if link.is_dir() and not link.is_symlink():
        raise UnsafeCheckpoints(f"{link} is a directory of its own; not replacing it with a link to {target}")
    temporary = link.with_name(f".{link.name}.{os.getpid()}")
    try:
        os.symlink(target, temporary)
        os.replace(temporary, link)
    finally:
        if os.path.lexists(temporary):
            os.unlink(temporary)
    return link


def _why_not(directory: Path) -> str:
    if os.path.islink(directory) and not directory.exists():
        return f"a dangling link to {os.readlink(directory)}"
    if not directory.exists():
        return f"{directory} does not exist"
    return f"no {MANIFEST_NAME} in {directory}"


def _home_relative(path: Path, env: Mapping[str, str]) -> str:
    try:
        return f"~/{path.relative_to(Path(env.get('HOME') or Path.home()))}"
    except ValueError:
        return str(path)
