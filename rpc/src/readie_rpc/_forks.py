"""Forks made on an Interact stream, waiting for the stream that attaches to them.

A fork is a new session of the server's (decision 0022). The stream that
asked for it is its parent's; the client reaches the fork on a second
stream whose first message is ``attach`` with the token the fork's answer
carried. The token is the only way in: 32 random bytes, good for one
attach within :data:`FORK_ATTACH_S`, after which the fork is closed. So a
fork nobody attaches costs its image for half a minute, and no client can
reach a session it did not fork.
"""

from __future__ import annotations

import secrets
import threading

from readie_protocol.errors import RequestError, SandboxSetupError
from readie_policy.runner import SessionHandle

__all__ = ["FORK_ATTACH_S", "MAX_WAITING_FORKS", "WaitingForks"]

#: An honest client attaches within milliseconds of the answer (one stream's start).
FORK_ATTACH_S = 30.0
#: Forks made and not attached yet, per server: each holds an image on disk and a session place.
MAX_WAITING_FORKS = 16
_TOKEN_BYTES = 32


class WaitingForks:
    """Forks by token until claimed or expired (see the module docstring). Thread-safe."""

    def __init__(self, attach_s: float = FORK_ATTACH_S) -> None:
        self._attach_s = attach_s
        self._lock = threading.Lock()
        self._waiting: dict[str, tuple[SessionHandle, threading.Timer]] = {}

    def add(self, fork: SessionHandle) -> str:
        """The token for ``fork``; SandboxSetupError (and ``fork`` closed) when too many wait."""
        with self._lock:
            full = len(self._waiting) >= MAX_WAITING_FORKS
            if not full:
                token = secrets.token_urlsafe(_TOKEN_BYTES)
                timer = threading.Timer(self._attach_s, self._expire, (token,))
                timer.daemon = True
                self._waiting[token] = (fork, timer)
                timer.start()
        if full:
            fork.close()
            raise SandboxSetupError(f"{MAX_WAITING_FORKS} forks wait to be attached on this server; attach them first")
        return token

    def claim(self, token: str) -> SessionHandle:
        """The fork ``token`` names, once; RequestError for a token that names none (now)."""
        with self._lock:
            entry = self._waiting.pop(token, None)
        if entry is None:
            raise RequestError("no fork waits under this token (unknown, attached already, or expired)", field="attach")
        fork, timer = entry
        timer.cancel()
        return fork

    def close(self) -> None:
        with self._lock:
            waiting, self._waiting = list(self._waiting.values()), {}
        for fork, timer in waiting:
            timer.cancel()
            fork.close()

    def _expire(self, token: str) -> None:
        with self._lock:
            entry = self._waiting.pop(token, None)
        if entry is not None:
            entry[0].close()
