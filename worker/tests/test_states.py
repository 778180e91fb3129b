"""The sandbox and session life tables: every move either allowed or refused by name. No gVisor."""

from __future__ import annotations

import itertools

import pytest

from readie_worker._states import (
    ALLOWED,
    SESSION_ALLOWED,
    IllegalTransition,
    SandboxState,
    SessionState,
    check_transition,
)

S = SessionState
SESSION_MOVES = {
    (S.OPENING, S.RUNNING), (S.OPENING, S.ENDED),
    (S.IDLE, S.RUNNING), (S.IDLE, S.ENDED),
    (S.RUNNING, S.IDLE), (S.RUNNING, S.ENDED),
    # Hibernation: a hibernation runs as a step does, and a step resumes it.
    (S.RUNNING, S.HIBERNATED), (S.HIBERNATED, S.RUNNING), (S.HIBERNATED, S.ENDED),
}


@pytest.mark.parametrize(("current", "target"), list(itertools.product(SessionState, SessionState)))
def test_session_moves(current, target):
    if (current, target) in SESSION_MOVES:
        assert check_transition(current, target) is target
    else:
        with pytest.raises(IllegalTransition, match=f"session cannot go from {current.value} to {target.value}"):
            check_transition(current, target)


def test_tables_cover_every_state():
    assert set(SESSION_ALLOWED) == set(SessionState) and set(ALLOWED) == set(SandboxState)
    assert SESSION_ALLOWED[S.ENDED] == frozenset()
    # A sandbox serves a session's next step: BUSY -> READY.
    assert check_transition(SandboxState.BUSY, SandboxState.READY) is SandboxState.READY
    with pytest.raises(IllegalTransition, match="sandbox cannot go from dead to ready"):
        check_transition(SandboxState.DEAD, SandboxState.READY)
