"""``readie capture`` and ``readie rootfs``: the offline half, with progress on the terminal.

``readie capture`` writes to ``--output``, else ``$READIE_CHECKPOINTS``, else
``./build/checkpoints``; ``--link-default`` (``make capture`` passes it) then
points the per-user default every readie command falls back to
(``~/.cache/readie/checkpoints``, ``readie_policy.locations``) at it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from readie_worker.errors import ReadieError
from readie_worker.manifest import MANIFEST_NAME
from readie_policy.locations import BUILD_CHECKPOINTS, CHECKPOINTS_VARIABLE, default_checkpoints, link_default
from readie_policy.logs import configure_logging

from .capture import CaptureError, CaptureOptions, capture, format_table
from .plan import DEFAULT_PLAN, PlanError, load_plan
from .rootfs import RootfsError, ensure_rootfs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="readie", description="readie's capture pipeline")
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
    args = parser.parse_args(argv)
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
        return 1
    if args.link_default:
        try:
            linked = link_default(output)
        except (OSError, ReadieError) as exc:
            _report(f"captured, but the default was not linked: {exc}")
            return 1
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
