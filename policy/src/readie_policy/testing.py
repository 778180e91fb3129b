"""Helpers for tests of any readie program (ours and yours): a free loopback port, and the
command that starts ``readie`` from this environment. Below the worker and the gRPC layer, so
both their test helpers (``readie_worker.testing``, ``readie_rpc.testing``) share them."""

from __future__ import annotations

import socket
import sys
from pathlib import Path

__all__ = ["free_port", "readie_command"]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def readie_command() -> list[str]:
    entry_point = Path(sys.executable).with_name("readie")
    if entry_point.exists():
        return [str(entry_point)]
    return [sys.executable, "-c", "import sys; from readie.cli import main; sys.exit(main())"]
