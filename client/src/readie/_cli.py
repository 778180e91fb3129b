"""The ``readie`` command: one entry point, each subcommand served by its component.

Components are imported only when their subcommand runs, so ``readie`` works
with just the parts of the workspace that are installed.
"""

from __future__ import annotations

import importlib
import sys

# subcommand -> module whose main(argv) serves it (argv includes the subcommand)
SUBCOMMANDS = {
    "capture": "readie_pipeline.cli",
    "pool": "readie_router.pool_cli",
    "rootfs": "readie_pipeline.cli",
    "router": "readie_router.router_cli",
    "worker": "readie_rpc.cli",
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] not in SUBCOMMANDS:
        names = ", ".join(sorted(SUBCOMMANDS))
        sys.stderr.write(f"usage: readie {{{names}}} [options]\n")
        return 0 if args and args[0] in ("-h", "--help") else 2
    try:
        module = importlib.import_module(SUBCOMMANDS[args[0]])
    except ImportError as exc:
        sys.stderr.write(f"readie {args[0]}: its component is not installed ({exc.name})\n")
        return 2
    return int(module.main(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
