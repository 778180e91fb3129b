"""The executor's socket: one connection at a time, one call at a time."""

from __future__ import annotations

import importlib
import logging
import os
import socket
from pathlib import Path
from typing import BinaryIO

from . import _channel
from ._calls import run_call
from ._checkpoint import CapturePointError, wait_for_handover
from .hibernation import HIBERNATE, HIBERNATING
from .hostwire import REPLY_PREFIX
from .jobs import fill_stdio
from .framing import FramingError, MessageReader
from ._uniqueness import Reseeder
from .sockets import MAX_SOCKET_PATH, receive_message, send_message

log = logging.getLogger("readie_executor")

# A sandbox holds one interpreter that runs one call at a time; a second
# caller waits in the kernel's queue rather than in ours.
LISTEN_BACKLOG = 1


class ServeError(Exception):
    """The socket cannot be set up."""


def bind_listener(path: Path) -> socket.socket:
    encoded = os.fsencode(path)
    if len(encoded) > MAX_SOCKET_PATH:
        raise ServeError(
            f"socket path {path} is {len(encoded)} bytes; a Unix socket path may have at most "
            f"{MAX_SOCKET_PATH}: use a shorter EXECUTOR_DIR"
        )
    try:
        path.unlink()  # a stale socket from an earlier executor would make bind fail
    except FileNotFoundError:
        pass
    except OSError as exc:
        raise ServeError(f"cannot remove stale socket {path}: {exc}") from None
    fill_stdio()  # a number a job's leftover stream freed (closing fd 1 when collected) is not ours to take
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(encoded)
        listener.listen(LISTEN_BACKLOG)
    except OSError as exc:
        listener.close()
        raise ServeError(f"cannot listen on {path}: {exc}") from None
    return listener


def wake(reseeder: Reseeder) -> None:
    """What a sandbox does when it wakes from a checkpoint, before it serves: fresh seeds
    (``_uniqueness``; raises ``ReseedError``), and every directory listing Python's import
    system holds dropped. Package slots, empty directories when the template froze its
    listings, may hold a job's packages now; their mounts are fixed at restore, so once per
    wake-up is enough (a job's own directories are listed again per job: ``jobs``)."""
    reseeder.reseed()
    try:
        importlib.invalidate_caches()
    except Exception as exc:  # a finder a session's code put in place: its own listings, stale
        log.warning("import listings not dropped after a wake-up: %s", exc)


def serve_forever(
    listener: socket.socket, socket_path: Path, chunk_size: int, handover: BinaryIO | None, reseeder: Reseeder
) -> None:
    """Serve until the process ends; hibernate when the worker asks (``hibernation``).

    ``handover`` is the pipe a restored sandbox's hand-over arrives on (None:
    this executor cannot hibernate, and the request is answered by a dropped
    connection). ``reseeder`` re-seeds every wake-up from a hibernation (a
    resume, and each side of a fork): it raises ``ReseedError``, and the
    sandbox must not serve.
    """
    while True:
        fill_stdio()  # as in bind_listener: the connection must not take fd 0, 1 or 2
        connection, _ = listener.accept()
        with connection:
            hibernate = serve_connection(connection, chunk_size) and handover is not None
            if hibernate:
                listener.close()  # no bound host socket may be saved in the image
                try:
                    send_message(connection, HIBERNATING, chunk_size)
                except OSError as exc:
                    log.warning("worker left before the hibernation was confirmed: %s", exc)
        if hibernate:
            assert handover is not None
            reseeder.take_census()  # the session may have imported modules with generators of their own
            try:
                wait_for_handover(handover)
            except (CapturePointError, OSError) as exc:  # the worker is gone, or a job closed the pipe
                raise ServeError(f"cannot resume: {exc}") from None
            wake(reseeder)
            listener = bind_listener(socket_path)


def serve_connection(connection: socket.socket, chunk_size: int) -> bool:
    """Answer requests on one connection until the peer hangs up or breaks the framing;
    True when it ended with the worker's request to hibernate (not answered yet).

    While a call runs, the connection is its channel to the worker (host
    functions: decision 8).
    """
    reader = MessageReader()
    while True:
        try:
            request = receive_message(connection, reader)
        except (FramingError, OSError) as exc:
            log.warning("dropping connection: %s", exc)
            return False
        if request is None:
            return False
        if request == HIBERNATE:
            return True
        if request.startswith(REPLY_PREFIX):
            # The worker's answer to a frame the last job wrote on this socket
            # by hand and never read: not a request (a request is a pickle).
            continue
        with _channel.serving(_channel.Channel(connection, reader, chunk_size)) as channel:
            response = run_call(request)
        if channel.broken:
            log.warning("dropping connection: a host-function exchange broke the framing")
            return False
        try:
            send_message(connection, response, chunk_size)
        except FramingError as exc:  # a response beyond the 4 GiB message limit
            log.warning("response cannot be framed: %s", exc)
            return False
        except OSError as exc:
            log.warning("peer left before the response was sent: %s", exc)
            return False
