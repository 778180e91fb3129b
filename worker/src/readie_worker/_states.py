"""A sandbox's life as one table of allowed transitions (h11's ``_state.py`` pattern)."""

from __future__ import annotations

import enum


class SandboxState(enum.Enum):
    STARTING = "starting"  # restore or cold start under way
    READY = "ready"  # socket answers; waiting in a pool
    BUSY = "busy"  # running a job or a session step
    DEAD = "dead"  # destroyed, or broken and about to be


ALLOWED: dict[SandboxState, frozenset[SandboxState]] = {
    SandboxState.STARTING: frozenset({SandboxState.READY, SandboxState.DEAD}),
    SandboxState.READY: frozenset({SandboxState.BUSY, SandboxState.DEAD}),
    # BUSY -> READY only for a sandbox that may serve again (a session's next step).
    SandboxState.BUSY: frozenset({SandboxState.READY, SandboxState.DEAD}),
    SandboxState.DEAD: frozenset(),
}


class IllegalTransition(RuntimeError):
    pass


def check_transition(current: SandboxState, target: SandboxState) -> SandboxState:
    if target not in ALLOWED[current]:
        raise IllegalTransition(f"sandbox cannot go from {current.value} to {target.value}")
    return target
