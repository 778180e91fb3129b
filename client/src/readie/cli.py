"""The ``readie`` command: one entry point, each subcommand served by its component.

Components are imported only when their subcommand runs, so ``readie`` works
with just the parts of the workspace that are installed; ``--help`` and
``--version`` import none of them (the one-line descriptions live here).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import sys
from typing import NamedTuple, TextIO


class Subcommand(NamedTuple):
    module: str  # whose main(argv) serves it (argv includes the subcommand)
    summary: str  # its line in ``readie --help``


SUBCOMMANDS = {
    "capture": Subcommand("readie_pipeline.cli", "capture the planned checkpoints and write manifest.json"),
    "checkpoints": Subcommand("readie_pipeline.cli", "export, import or verify a checkpoint set and its rootfs"),
    "mcp": Subcommand("readie._mcp", "a Model Context Protocol server (run_python tool)"),
    "pool": Subcommand("readie_pool.cli", "serve the pool protocol (JSON Lines) on stdin and stdout"),
    "rootfs": Subcommand("readie_pipeline.cli", "build (or reuse) the sandbox rootfs"),
    "router": Subcommand("readie_router.cli", "place jobs on readie workers, over gRPC"),
    "sessions": Subcommand("readie_worker.sessions_cli", "list or remove the sessions in a session store"),
    "worker": Subcommand("readie_worker.cli", "serve one worker's gVisor sandboxes over gRPC"),
}
DISTRIBUTION = "readie"
EXIT_USAGE = 2


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args:
        _help(sys.stderr)
        return EXIT_USAGE
    first = args[0]
    if first in ("-h", "--help", "help"):
        _help(sys.stdout)
        return 0
    if first in ("-V", "--version"):
        sys.stdout.write(version_line() + "\n")
        return 0
    if first not in SUBCOMMANDS:
        what = "option" if first.startswith("-") else "subcommand"
        sys.stderr.write(f"readie: unknown {what} {first!r}; `readie --help` lists the subcommands\n")
        return EXIT_USAGE
    try:
        module = importlib.import_module(SUBCOMMANDS[first].module)
    except ImportError as exc:
        sys.stderr.write(f"readie {first}: its component is not installed ({exc.name})\n")
        return EXIT_USAGE
    return int(module.main(args) or 0)


def version_line() -> str:
    """``readie X.Y.Z (pool protocol N)``: the installed distribution and the protocol it speaks."""
    from readie_protocol.wire import PROTOCOL_VERSION  # standard library only

    try:
        installed = importlib.metadata.version(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError:
        installed = "unknown (not installed)"
    return f"readie {installed} (pool protocol {PROTOCOL_VERSION})"


def _help(out: TextIO) -> None:
    width = max(map(len, SUBCOMMANDS))
    lines = [
        "usage: readie SUBCOMMAND [options]    (readie SUBCOMMAND --help for its options)",
        "       readie --version | --help",
        "",
        "subcommands:",
        *(f"  {name:<{width}}  {sub.summary}" for name, sub in sorted(SUBCOMMANDS.items())),
        "",
        "Checkpoints are found by --checkpoints, else $READIE_CHECKPOINTS, else ./build/checkpoints,",
        "else ~/.cache/readie/checkpoints (make capture links it): docs/pool.md.",
    ]
    out.write("\n".join(lines) + "\n")


if __name__ == "__main__":
    sys.exit(main())
