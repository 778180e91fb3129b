"""``python -u -m readie_executor``: the startup sequence of the executor spec."""

from __future__ import annotations

import importlib
import logging
import os
import sys
from typing import BinaryIO

from . import jobs  # noqa: F401 - see below
from ._checkpoint import CapturePointError, checkpoint_and_wait
from ._server import ServeError, bind_listener, serve_forever, wake
from ._settings import Mode, Settings, SettingsError
from ._uniqueness import AFTER_RESTORE_VARIABLE, Reseeder, ReseedError
from .jobs import dedicate_stdio

# The job runner (and ctypes, resource, select... under it) is imported here,
# before the checkpoint, so that no restored sandbox reads those modules
# through the gofer on its first job: that cost 20-40 ms of every warm job.

# Exit codes: 2 for settings the executor cannot start with (as the spec asks),
# 3 for a capture that cannot reach its checkpoint, 4 for a sandbox that woke
# up and could not be re-seeded (it must not serve: _uniqueness).
EXIT_BAD_SETTINGS = 2
EXIT_CAPTURE_FAILED = 3
EXIT_NOT_RESEEDED = 4


def main() -> int:
    _configure_logging()
    try:
        settings = Settings.from_environ(os.environ)
        reseeder = Reseeder()
        if settings.mode is Mode.CAPTURE:
            try:
                preimport(settings.preimport)
                reseeder = Reseeder.prepared(os.environ.get(AFTER_RESTORE_VARIABLE, ""))
                restored_environ = checkpoint_and_wait(sys.stdin.buffer, sys.stdout)
            except (CapturePointError, ReseedError) as exc:
                return _fail(f"capture failed: {exc}", EXIT_CAPTURE_FAILED)
            try:
                wake(reseeder)  # before anything else runs in the sandbox we woke up in
            except ReseedError as exc:
                return _fail(f"sandbox refused: {exc}", EXIT_NOT_RESEEDED)
            # The frozen environment is the capture's; only the new sandbox's counts.
            os.environ.clear()
            os.environ.update(restored_environ)
            settings = Settings.from_environ(os.environ)
            if settings.mode is Mode.MEASURE:
                return 0
        listener = bind_listener(settings.socket_path)
    except (SettingsError, ServeError) as exc:
        return _fail(str(exc), EXIT_BAD_SETTINGS)
    handover = release_inherited(keep=listener.fileno())
    _log_to(dedicate_stdio())
    try:
        serve_forever(listener, settings.socket_path, settings.chunk_size, handover, reseeder)
    except ServeError as exc:
        return _fail(str(exc), EXIT_BAD_SETTINGS)
    except ReseedError as exc:
        return _fail(f"sandbox refused: {exc}", EXIT_NOT_RESEEDED)
    return 0


def release_inherited(keep: int) -> BinaryIO:
    """Leave a job nothing that leads out of the sandbox but the worker's socket.

    stdin carried the hand-over and stdout the capture announcement; from
    now on both are /dev/null. The hand-over pipe moves to a descriptor of
    its own (returned): a session that hibernates waits there for the next
    hand-over (``hibernation``). It is the read end of a pipe only the worker
    writes, so it leads nowhere: a job that reads or closes it spoils only its
    own resume. stderr stays: it is this executor's log, a pipe the worker
    drains into a bounded tail (never a host file). Any other descriptor
    inherited is closed (a template with one is refused at capture).
    """
    handover = os.dup(0)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(devnull, 1)
    os.close(devnull)
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in (keep, handover):
            try:
                os.close(fd)
            except OSError:
                pass  # the descriptor listdir itself used
    return os.fdopen(handover, "rb")


def preimport(modules: tuple[str, ...]) -> None:
    for name in modules:
        try:
            importlib.import_module(name)
        except BaseException as exc:
            raise CapturePointError(f"cannot pre-import {name!r}: {type(exc).__name__}: {exc}") from None


def _configure_logging() -> None:
    # Our own logger only: the root logger stays the user's, so a called
    # function's logging output lands in its captured output, not here.
    logger = logging.getLogger("readie_executor")
    handler = logging.StreamHandler(sys.__stderr__)
    handler.setFormatter(logging.Formatter("readie_executor: %(message)s"))
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    logger.propagate = False


def _log_to(fd: int) -> None:
    """Write this executor's log, and what it writes to sys.stderr outside jobs, to ``fd``: fd 2
    belongs to job captures now (``dedicate_stdio``), and what reaches it between jobs is dropped."""
    stream = os.fdopen(fd, "w", buffering=1, encoding="utf-8", errors="backslashreplace")  # by line
    for handler in logging.getLogger("readie_executor").handlers:
        if isinstance(handler, logging.StreamHandler):
            handler.setStream(stream)
    sys.stderr = stream


def _fail(message: str, code: int) -> int:
    sys.stderr.write(f"readie_executor: {message}\n")
    return code


if __name__ == "__main__":
    sys.exit(main())
