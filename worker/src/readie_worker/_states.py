"""Lives as tables of allowed transitions (h11's ``_state.py`` pattern): a sandbox's and a session's."""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import TypeVar


class SandboxState(enum.Enum):
    STARTING = "starting"  # restore or cold start under way
    READY = "ready"  # socket answers; waiting warm, or between a session's steps
    BUSY = "busy"  # running a job or a session step
    DEAD = "dead"  # destroyed, or broken and about to be


ALLOWED: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.STARTING: frozenset({SandboxState.READY, SandboxState.DEAD}),
    SandboxState.READY: frozenset({SandboxState.BUSY, SandboxState.DEAD}),
    # BUSY -> READY only for a sandbox that may serve again (a session's next step).
    SandboxState.BUSY: frozenset({SandboxState.READY, SandboxState.DEAD}),
    SandboxState.DEAD: frozenset(),
}


class SessionState(enum.Enum):
    """A worker session (``sessions.py``): one sandbox, many steps, one at a time."""

    OPENING = "opening"  # its sandbox is being made ready; the first step follows at once
    IDLE = "idle"  # between steps: the sandbox waits with its __main__ intact (sandbox READY)
    RUNNING = "running"  # a step runs, or a hibernation or resume (sandbox BUSY)
    HIBERNATED = "hibernated"  # no sandbox: its image waits on disk for the next step (hibernation.py)
    ENDED = "ended"  # closed, timed out, crashed or exited: the sandbox is destroyed


SESSION_ALLOWED: dict[SessionState, frozenset[SessionState]] = {
    SessionState.OPENING: frozenset({SessionState.RUNNING, SessionState.ENDED}),
    SessionState.IDLE: frozenset({SessionState.RUNNING, SessionState.ENDED}),
    SessionState.RUNNING: frozenset({SessionState.IDLE, SessionState.HIBERNATED, SessionState.ENDED}),
    SessionState.HIBERNATED: frozenset({SessionState.RUNNING, SessionState.ENDED}),
    SessionState.ENDED: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


_S = TypeVar("_S", SandboxState, SessionState)


def check_transition(current: _S, target: _S, table: Mapping[_S, frozenset[_S]] | None = None) -> _S:
    allowed = (ALLOWED if isinstance(current, SandboxState) else SESSION_ALLOWED) if table is None else table
    if target not in allowed[current]:  # type: ignore[index]
        kind = "sandbox" if isinstance(current, SandboxState) else "session"
        raise IllegalTransition(f"{kind} cannot go from {current.value} to {target.value}")
    return target
