"""The paths a policy holds: the operator's resolved (symlinks followed), a request's made absolute
lexically and refused when they pass through a symlink, and the checks that a path lies beneath a
ceiling's or off the pool's own package dirs. ``policy`` says why, and re-exports the public three.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from readie_protocol.errors import RequestError

__all__ = [
    "Named",
    "beneath",
    "join",
    "merge",
    "named",
    "normal",
    "not_over",
    "refuse_symlinks",
    "request_path",
    "resolve_path",
]


def resolve_path(path: str | Path, base: str | Path, resolve: Callable[[str], str] = os.path.realpath) -> Path:
    """``path`` made absolute against ``base``, normalized and symlink-free (symlinks followed:
    for the operator's paths; a request's go through :func:`request_path`)."""
    if not os.path.isabs(base):
        raise ValueError(f"base directory must be absolute, got {base!r}")
    joined = os.path.join(base, path)  # an absolute path replaces base
    # realpath first, as the kernel would walk it: in "data/link/../x" the
    # ".." applies to link's target, which a lexical normpath would get wrong.
    return normal(resolve(joined))


def request_path(field: str, path: str, cwd: str | Path) -> Path:
    """A path a request names, made absolute against ``cwd`` (symlink-free) and normalized
    lexically; :func:`refuse_symlinks` checks that the lexical reading is the true one."""
    if not os.path.isabs(cwd):
        raise ValueError(f"base directory must be absolute, got {cwd!r}")
    if "\0" in path:
        raise RequestError(f"{path!r} contains a NUL character", field)
    return normal(os.path.join(cwd, path))


def refuse_symlinks(
    field: str, shown: str, path: Path, cwd: str | Path, resolve: Callable[[str], str] = os.path.realpath
) -> None:
    """RequestError if ``shown`` (the request's words, against ``cwd``) passes through a
    symlink, so that ``path`` (its lexical reading) is not what the kernel would reach.

    Asked only of paths already found beneath the ceiling: the host's other
    paths are never looked at on a request's behalf, so a refusal tells
    nothing about them (nor can a path elsewhere make the pool wait on it).
    """
    try:
        # The words as written: in "data/link/../x" the ".." applies to the link's target.
        resolved = normal(resolve(os.path.join(cwd, shown)))
    except OSError as exc:  # its text would name where the walk got to: not the client's business
        raise RequestError(f"cannot resolve {shown!r}: {exc.strerror}", field) from None
    if resolved != path:
        raise RequestError(
            f"{shown!r} passes through a symbolic link, which readie never follows in a granted path", field
        )


#: A path as the request (or profile) wrote it, for messages, and as the policy holds it.
Named = tuple[str, Path]


def named(paths: tuple[Path, ...] | None) -> tuple[Named, ...]:
    """The operator's paths (a profile's): shown as they resolved."""
    return tuple((str(path), path) for path in paths or ())


def normal(path: str) -> Path:
    normal = os.path.normpath(path)
    # POSIX keeps a leading "//" as it is; Linux means "/" by it.
    return Path("/" + normal.lstrip("/") if normal.startswith("//") else normal)


def merge(first: tuple[Path, ...] | None, second: tuple[Path, ...] | None) -> tuple[Path, ...]:
    return tuple(dict.fromkeys((*(first or ()), *(second or ()))))


def join(*groups: tuple[Path, ...] | None) -> tuple[Path, ...] | None:
    """Union of ceiling path lists; unbounded (None) if any of them is."""
    if any(group is None for group in groups):
        return None
    return tuple(path for group in groups for path in group or ())


def beneath(
    field: str, paths: tuple[Named, ...], ceiling: tuple[Path, ...] | None, note: str = ""
) -> None:
    if ceiling is None:
        return
    for shown, path in paths:
        if not any(path.is_relative_to(top) for top in ceiling):
            listed = ", ".join(str(top) for top in ceiling) or "none"
            raise RequestError(
                f"{shown!r} is not beneath a path the pool's [pool.limits] allow ({listed}){note}",
                field,
            )


def not_over(writes: tuple[Named, ...], guarded: tuple[Path, ...], note: str = "") -> None:
    for shown, path in writes:
        for top in guarded:
            if path.is_relative_to(top) or top.is_relative_to(path):
                raise RequestError(
                    f"{shown!r} overlaps the pool's package dir {str(top)!r}, "
                    f"which jobs may not write{note}",
                    "allow_write",
                )
