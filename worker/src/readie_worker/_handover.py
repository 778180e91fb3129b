"""The line an executor waiting at its capture point wakes up to (decision 22): its environment.

A restored executor reads it from its stdin, a pipe the worker holds for the container's life,
and so does one resumed after a per-step checkpoint. Job code runs in that process and can stop
reading it: every checkpoint would then add a line to a pipe nobody drains, and once the pipe
is full a blocking write would hold the checkpoint's thread, and with it the session's teardown,
forever. So the write never blocks: it waits for room at most HANDOVER_WAIT_S.
"""

from __future__ import annotations

import errno
import json
import os
import select
import subprocess
import time
from collections.abc import Mapping

from .errors import SandboxSetupError, host_failure

__all__ = ["HANDOVER_WAIT_S", "hand_over"]

# An executor at its capture point reads the line at once; a pipe still full after this long
# belongs to one that does not read it. (A first hand-over's line, the job's whole env, can be
# larger than the pipe: its reader takes it in pieces meanwhile.)
HANDOVER_WAIT_S = 10.0


def hand_over(process: subprocess.Popen[bytes], env: Mapping[str, str]) -> None:
    """Give an executor waiting at its capture point the environment it wakes up to."""
    assert process.stdin is not None
    line = memoryview(json.dumps({"env": dict(env)}).encode() + b"\n")
    deadline = time.monotonic() + HANDOVER_WAIT_S
    with host_failure(SandboxSetupError, "executor took no handover"):
        process.stdin.flush()  # nothing of ours waits in its buffer: the line goes by the descriptor
        fd = process.stdin.fileno()
        os.set_blocking(fd, False)
        while line:
            try:
                line = line[os.write(fd, line):]
            except BlockingIOError:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([], [fd], [], left)[1]:
                    raise OSError(errno.EAGAIN, f"its stdin stayed full for {HANDOVER_WAIT_S:.0f} s: it does not read it") from None
