"""The capture point: freeze here, wake up in a new sandbox, learn its environment.

Two triggers behind :func:`checkpoint_and_wait`:

* ``/proc/gvisor/checkpoint`` (newer gVisor): write ``1``; the read that follows
  returns ``restore``, ``resume`` or ``error``; the new environment is in
  ``/proc/gvisor/spec_environ``.
* stdio (Debian's runsc, which has no such file): announce readiness on stdout
  and block reading stdin. The pipeline sees the announcement and runs
  ``runsc checkpoint``; after ``runsc restore`` the blocked read continues on
  the new sandbox's stdin, where the worker writes one JSON line
  ``{"env": {...}}``: the restored process's new environment.

Either way the announcement carries a census of the template (OS threads and
open descriptors) so that the pipeline can refuse a template that would carry
a helper thread or a stray file into every sandbox restored from it.
"""

from __future__ import annotations

import ctypes
import gc
import json
import os
from pathlib import Path
from typing import BinaryIO, TextIO

PROC_CHECKPOINT = Path("/proc/gvisor/checkpoint")
PROC_SPEC_ENVIRON = Path("/proc/gvisor/spec_environ")

#: Prefix of the announcement line; what follows it is JSON.
READY_MARKER = "readie-capture-ready "
# The handover carries only an environment; a megabyte is far beyond any real
# one and keeps a runaway writer from growing the template's memory.
MAX_HANDOVER_LINE = 1024 * 1024


class CapturePointError(Exception):
    """The capture point could not be reached or left cleanly."""


def template_census() -> dict[str, list[dict[str, object]]]:
    """OS-level threads (not ``threading``'s view) and open descriptors of this process."""
    threads = []
    for tid in sorted(os.listdir("/proc/self/task"), key=int):
        try:
            name = Path(f"/proc/self/task/{tid}/comm").read_text().strip()
        except OSError:
            continue
        threads.append({"tid": int(tid), "name": name})
    fds = []
    for fd in sorted(os.listdir("/proc/self/fd"), key=int):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue  # the descriptor listdir() itself used, closed by now
        fds.append({"fd": int(fd), "target": target})
    return {"threads": threads, "fds": fds}


def compact_heap() -> None:
    """Leave the image only the memory the template still uses, and keep jobs off its pages.

    Imports leave garbage (cycles, freed arenas, the compiler's scratch) that
    would be saved in the image and loaded by every restore. Collected, and
    freed heap handed back with malloc_trim, it is not. gc.freeze() then
    moves every surviving object out of the collector's reach: a job's
    garbage collections never walk (and so never write to) the template's
    pages, which stay shared with the image instead of being copied into
    each sandbox's memory.
    """
    gc.collect()
    gc.freeze()
    _trim_heap()


def _trim_heap() -> None:
    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):  # a libc without malloc_trim: only the saving is lost
        pass


def checkpoint_and_wait(stdin: BinaryIO, stdout: TextIO) -> dict[str, str]:
    """Trigger the checkpoint and return the environment of the sandbox we woke up in."""
    compact_heap()
    stdout.write(READY_MARKER + json.dumps(template_census()) + "\n")
    stdout.flush()
    if PROC_CHECKPOINT.exists():
        return _via_procfs()
    return _via_stdio(stdin)


def _via_procfs() -> dict[str, str]:
    with open(PROC_CHECKPOINT, "r+b", buffering=0) as trigger:
        trigger.write(b"1")
        outcome = trigger.read().decode("ascii", "replace").strip()
    if outcome == "restore":
        return parse_spec_environ(PROC_SPEC_ENVIRON.read_bytes())
    if outcome == "resume":
        return dict(os.environ)
    raise CapturePointError(f"/proc/gvisor/checkpoint answered {outcome!r}")


def _via_stdio(stdin: BinaryIO) -> dict[str, str]:
    line = stdin.readline(MAX_HANDOVER_LINE + 1)
    if not line:
        raise CapturePointError("stdin closed before the restored sandbox handed over its environment")
    if len(line) > MAX_HANDOVER_LINE:
        raise CapturePointError(f"handover line longer than {MAX_HANDOVER_LINE} bytes")
    return parse_handover(line)


def wait_for_handover(handover: BinaryIO) -> None:
    """Block at a hibernated session's capture point until a restore (or resume) hands over.

    The new sandbox's environment is not applied: ``os.environ`` is the
    session's own state by now, and what the executor derives from the
    environment (its socket's path) is the same in every sandbox.
    """
    gc.collect()  # not gc.freeze(): the session's objects must stay collectable
    _trim_heap()
    _via_stdio(handover)


def parse_handover(line: bytes) -> dict[str, str]:
    try:
        handover = json.loads(line)
    except ValueError as exc:
        raise CapturePointError(f"handover line is not JSON: {exc}") from None
    env = handover.get("env") if isinstance(handover, dict) else None
    # A NUL cannot be in an environment variable: os.environ would raise mid-update.
    if not isinstance(env, dict) or not all(
        isinstance(key, str) and key and "=" not in key and "\0" not in key
        and isinstance(value, str) and "\0" not in value
        for key, value in env.items()
    ):
        raise CapturePointError('handover line must be {"env": {NAME: VALUE, ...}} with string values')
    return env


def parse_spec_environ(raw: bytes) -> dict[str, str]:
    env = {}
    for entry in raw.split(b"\0"):
        key, sep, value = os.fsdecode(entry).partition("=")
        if sep and key:
            env[key] = value
    return env
