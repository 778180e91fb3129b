"""The liveness probe the worker sends before trusting a sandbox with a job.

A reference to :func:`ping` pickles as a module path, not code, and its answer
is raw bytes (see ``_calls.RAW_RESPONSE_ATTRIBUTE``), so the worker can probe
without ever unpickling anything from the sandbox.
"""

from __future__ import annotations

from ._calls import RAW_RESPONSE_ATTRIBUTE

PONG = b"pong"


def ping() -> bytes:
    return PONG


setattr(ping, RAW_RESPONSE_ATTRIBUTE, True)
