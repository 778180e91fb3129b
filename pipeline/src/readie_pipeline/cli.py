"""``readie capture``, ``readie rootfs`` and ``readie checkpoints``: the offline half, with progress on the terminal.

``readie capture`` writes to ``--output``, else ``$READIE_CHECKPOINTS``, else
``./build/checkpoints``; ``--link-default`` (``make capture`` passes it) then
points the per-user default every readie command falls back to
(``~/.cache/readie/checkpoints``, ``readie_policy.locations``) at it.

``readie checkpoints export|import|verify`` moves checkpoint sets between
hosts (docs/checkpoints.md)::

    readie checkpoints export --output set.tar            # on the build host
    readie checkpoints import set.tar                     # on each worker host
    readie checkpoints verify                             # would a worker here restore them?

``export`` and ``verify`` find the set as every readie command does
(``--checkpoints``, ``$READIE_CHECKPOINTS``, ``./build/checkpoints``, the
per-user default); ``import`` installs into ``--into`` (default
``$READIE_CACHE``, else ``~/.cache/readie``) and points that cache's
``checkpoints`` at the imported set. Exit 0 on success (verify: every
checkpoint usable), 1 otherwise, 2 for usage errors.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

from readie_worker.errors import ReadieError
from readie_worker.manifest import MANIFEST_NAME
from readie_policy.locations import (
    BUILD_CHECKPOINTS, CHECKPOINTS_VARIABLE, cache_dir, default_checkpoints, link_default, locate_checkpoints,
)
from readie_policy.logs import configure_logging

from .capture import CaptureError, CaptureOptions, capture, format_table
from .checkpoint_export import export_checkpoints
from .checkpoint_import import import_checkpoints
from .checkpoint_verify import verify_manifest
from .plan import DEFAULT_PLAN, PlanError, load_plan
from .rootfs import RootfsError, ensure_rootfs


EXIT_FAILED = 1  # 2 is argparse's, for usage errors


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)  # the subcommand included
    if args.command == "checkpoints":
        return _checkpoints(args)
    return _capture(parser, args)


def build_parser() -> argparse.ArgumentParser:
    """The parser of ``readie rootfs``, ``readie capture`` and ``readie checkpoints``, the subcommand included."""
    parser = argparse.ArgumentParser(prog="readie", description="readie's capture pipeline and checkpoint sets")
    commands = parser.add_subparsers(dest="command", required=True)
    rootfs = commands.add_parser("rootfs", help="build (or reuse) the sandbox rootfs")
    rootfs.add_argument("--plan", type=Path, default=DEFAULT_PLAN, help="checkpoint plan (TOML)")
    cap = commands.add_parser("capture", help="capture the planned checkpoints and write manifest.json")
    cap.add_argument("--plan", type=Path, default=DEFAULT_PLAN, help="checkpoint plan (TOML)")
    cap.add_argument(
        "--output", type=Path, metavar="DIR",
        help=f"where images and manifest.json go (default: ${CHECKPOINTS_VARIABLE}, else ./{BUILD_CHECKPOINTS})",
    )
    cap.add_argument(
        "--link-default", action="store_true",
        help=f"then point {default_checkpoints()} (where every readie command looks last) at the output",
    )
    cap.add_argument("--only", action="append", default=[], metavar="NAME", help="capture only this checkpoint")
    cap.add_argument("--runs", type=int, default=3, help="timed restores and cold starts per checkpoint")
    cap.add_argument("--force", action="store_true", help="recapture checkpoints that are up to date")
    cap.add_argument("--runsc", default="runsc", metavar="BINARY", help="the runsc to capture with (default: runsc on PATH)")
    _add_checkpoints(commands)
    return parser


def _capture(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    configure_logging(process="capture")
    started = time.monotonic()
    try:
        plan = load_plan(args.plan)
        if args.command == "rootfs":
            built = ensure_rootfs(plan, _report)
            _report(f"rootfs ready: {built.path} (python {built.python}, {built.fingerprint[:23]}…)")
            return 0
        if args.runs < 1:
            parser.error("--runs must be at least 1")
        output = _output(args.output)
        manifest = capture(plan, CaptureOptions(output, args.runs, tuple(args.only), args.force, args.runsc), _report)
    except (PlanError, RootfsError, CaptureError, ReadieError) as exc:
        _report(f"capture failed: {exc}")
        return EXIT_FAILED
    if args.link_default:
        try:
            linked = link_default(output)
        except (OSError, ReadieError) as exc:
            _report(f"captured, but the default was not linked: {exc}")
            return EXIT_FAILED
        if linked is not None:
            _report(f"linked {linked} -> {os.path.realpath(output)}")
    _report(f"wrote {output / 'manifest.json'} in {time.monotonic() - started:.1f} s\n")
    sys.stdout.write(format_table(manifest) + "\n")
    return 0


def _output(given: Path | None) -> Path:
    if given is not None:
        return given
    named = Path(os.environ.get(CHECKPOINTS_VARIABLE) or BUILD_CHECKPOINTS)
    return named.parent if named.name == MANIFEST_NAME else named


def _report(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _checkpoints(args: argparse.Namespace) -> int:
    configure_logging(process="checkpoints")
    started = time.monotonic()
    try:
        if args.action == "export":
            located = locate_checkpoints(args.checkpoints)
            exported = export_checkpoints(located.manifest, args.output)
            _report(
                f"exported {located.directory} ({located.source}) and its rootfs to {exported.path}: "
                f"{exported.members} members, {exported.bytes / 1e6:.1f} MB, {time.monotonic() - started:.1f} s"
                + (f"; {len(exported.skipped)} device nodes not carried (every sandbox has its own /dev)" if exported.skipped else "")
            )
            return 0
        if args.action == "import":
            cache = args.into or cache_dir()
            # --no-host-check stages a set for another host: this host's default does not move to it.
            imported = import_checkpoints(
                args.archive, cache, runsc_binary=args.runsc, check_host=not args.no_host_check, link=not args.no_host_check
            )
            moved = "" if imported.captured_rootfs == str(imported.rootfs) else f" (captured at {imported.captured_rootfs})"
            _report(
                f"imported {args.archive} in {time.monotonic() - started:.1f} s: set {imported.set_dir}, rootfs "
                f"{imported.rootfs}{moved}{', already installed' if imported.rootfs_reused else ''}; "
                + (f"{imported.linked or cache / 'checkpoints'} -> {imported.set_dir}" if not args.no_host_check else "not made the default")
            )
            return 0
        located = locate_checkpoints(args.checkpoints)
        verdict = verify_manifest(located.manifest, args.runsc)
        sys.stdout.write("\n".join(verdict.lines()) + "\n")
        return 0 if verdict.usable else EXIT_FAILED
    except (ReadieError, OSError) as exc:
        _report(f"readie checkpoints {args.action} failed: {exc}")
        return EXIT_FAILED


def _add_checkpoints(commands: Any) -> None:
    checkpoints = commands.add_parser(
        "checkpoints", help="export, import or verify a checkpoint set", description="move checkpoint sets between hosts"
    )
    actions = checkpoints.add_subparsers(dest="action", required=True)
    where = "the set (default: $READIE_CHECKPOINTS, else ./build/checkpoints, else ~/.cache/readie/checkpoints)"
    export = actions.add_parser("export", help="pack a set and its rootfs into one tar")
    export.add_argument("--checkpoints", type=Path, metavar="DIR", help=where)
    export.add_argument("--output", "-o", type=Path, required=True, metavar="FILE.tar", help="the archive to write")
    imports = actions.add_parser("import", help="verify an archive and install it as this host's default set")
    imports.add_argument("archive", type=Path, metavar="FILE.tar")
    imports.add_argument("--into", type=Path, metavar="CACHE", help="the cache to install into (default: $READIE_CACHE, else ~/.cache/readie)")
    imports.add_argument("--runsc", default="runsc", metavar="BINARY", help="the runsc the workers here run (default: runsc on PATH)")
    imports.add_argument(
        "--no-host-check", action="store_true",
        help="install even if this host's runsc or executor could not restore the set (e.g. to stage it for another host)",
    )
    verify = actions.add_parser("verify", help="would a worker on this host restore each checkpoint?")
    verify.add_argument("--checkpoints", type=Path, metavar="DIR", help=where)
    verify.add_argument("--runsc", default="runsc", metavar="BINARY", help="the runsc the workers here run (default: runsc on PATH)")
