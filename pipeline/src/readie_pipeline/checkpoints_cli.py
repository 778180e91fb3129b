"""``readie checkpoints export|import|verify``: checkpoint sets that travel between hosts (docs/checkpoints.md).

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
import sys
import time
from pathlib import Path

from readie_worker.errors import ReadieError
from readie_policy.locations import cache_dir, locate_checkpoints
from readie_policy.logs import configure_logging

from .checkpoint_export import export_checkpoints
from .checkpoint_import import import_checkpoints
from .checkpoint_verify import verify_manifest

EXIT_FAILED = 1


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args((sys.argv[1:] if argv is None else argv)[1:])  # argv[0] is "checkpoints"
    configure_logging(process="checkpoints")
    started = time.monotonic()
    try:
        if args.action == "export":
            located = locate_checkpoints(args.checkpoints)
            exported = export_checkpoints(located.manifest, args.output)
            _say(
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
            _say(
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
        _say(f"readie checkpoints {args.action} failed: {exc}")
        return EXIT_FAILED


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="readie checkpoints", description="move checkpoint sets between hosts")
    actions = parser.add_subparsers(dest="action", required=True)
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
    return parser


def _say(line: str) -> None:
    sys.stderr.write(line + "\n")
    sys.stderr.flush()
