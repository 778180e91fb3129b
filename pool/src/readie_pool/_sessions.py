"""The pool's sessions: a table of named sessions and the rules that admit a request to one.

No I/O and no backend calls here: the session driver (``_session_driver``) runs the steps.
What this module decides, for each line naming a session:

* no open session of that name: the line is the first request. It creates
  the session (unless ``max_sessions`` are open or sessions are disabled)
  and fixes its
  permissions, limits and environment with its own fields;
* an open session: the line is a later step and may carry only code, name,
  args, timeout and max_output; any other field is a RequestError naming it.
  A session with :data:`MAX_PENDING_STEPS` steps not yet answered refuses
  more until it catches up.

Each session's requests (steps and its close) run one at a time, in the
order they were read: each waits for the one before it (:meth:`NamedSession.enqueue`).
A session leaves the table, and stops counting against ``max_sessions``, as
soon as the pool reads its close (the steps read before the close still run
first: CLOSING) or it ends: a step timed out, crashed or exited, it was idle
for ``session_idle``, or the pool is ending. So the next request under that
name creates a new session with the fields it brings. Requests queued
behind an end are answered without running (a step with a RequestError, a
close with ``closed``).

Phases, one direction only::

    OPENING --(first step ran)--> OPEN --(close read)--> CLOSING --> ENDED
    OPENING or OPEN --(a step ended it, idle, pool drains, first step refused)--> ENDED
"""

from __future__ import annotations

import asyncio
import enum
from dataclasses import dataclass, field

from ._backend import BackendSession
from readie_worker.errors import RequestError
from readie_policy.jobs import CodeJob
from readie_protocol.requests import JobRequest

__all__ = ["MAX_PENDING_STEPS", "NamedSession", "SessionPhase", "SessionTable", "not_open"]

#: The spec: "a session with eight pending steps answers RequestError until
#: it catches up". Pending means accepted and not yet answered, the running
#: step included. Every accepted line also holds one of the pool's
#: 2 x workers permits, so below five workers that bound is reached first.
MAX_PENDING_STEPS = 8

_STEP_FIELDS = "code, name, args, timeout and max_output"


class SessionPhase(enum.Enum):
    OPENING = "opening"  # first request accepted; its sandbox and first step are under way
    OPEN = "open"  # its first step ran: later steps go to the same sandbox
    CLOSING = "closing"  # its close was read: out of the table, queued steps still run
    ENDED = "ended"  # out of the table; queued requests are answered without running


_TRANSITIONS: dict[SessionPhase, frozenset[SessionPhase]] = {
    SessionPhase.OPENING: frozenset({SessionPhase.OPEN, SessionPhase.CLOSING, SessionPhase.ENDED}),
    SessionPhase.OPEN: frozenset({SessionPhase.CLOSING, SessionPhase.ENDED}),
    SessionPhase.CLOSING: frozenset({SessionPhase.ENDED}),
    SessionPhase.ENDED: frozenset(),
}


@dataclass(eq=False)
class NamedSession:
    """One session as the pool sees it; the sandbox is behind ``handle``."""

    name: str
    phase: SessionPhase = SessionPhase.OPENING
    pending: int = 0  # accepted requests (steps and closes) not yet answered
    handle: BackendSession | None = None
    job: CodeJob | None = None  # the session's first job: its grants and limits, fixed for its life
    functions: tuple[str, ...] = ()  # its host functions, fixed by the first request too
    idle: asyncio.TimerHandle | None = None  # closes it at session_idle
    hibernation: asyncio.TimerHandle | None = None  # hibernates it at session_hibernate
    idle_since: float = 0.0  # the loop's time when it last went idle
    _tail: asyncio.Event | None = field(default=None, repr=False)

    @property
    def ended(self) -> bool:
        return self.phase is SessionPhase.ENDED

    def move(self, phase: SessionPhase) -> None:
        if phase not in _TRANSITIONS[self.phase]:
            raise RuntimeError(f"session cannot go from {self.phase.value} to {phase.value}")
        self.phase = phase

    def enqueue(self, *, idle: bool = False) -> tuple[asyncio.Event | None, asyncio.Event]:
        """Queue one request: the event to wait for before it runs (None: run now) and its own,
        to set once it is answered. ``idle``: the pool's own hibernation, which keeps the
        session idle (its close timer runs on)."""
        previous, done = self._tail, asyncio.Event()
        self._tail = done
        self.pending += 1
        if not idle:
            self.stop_idle_timer()
        return previous, done

    def answered(self) -> None:
        self.pending -= 1

    def stop_idle_timer(self) -> None:
        for timer in (self.idle, self.hibernation):
            if timer is not None:
                timer.cancel()
        self.idle = self.hibernation = None


class SessionTable:
    """The open sessions by name, and the admission rules (see the module docstring)."""

    def __init__(self, max_sessions: int) -> None:
        self.max_sessions = max_sessions
        self._open: dict[str, NamedSession] = {}

    def __len__(self) -> int:
        return len(self._open)

    def get(self, name: str) -> NamedSession | None:
        return self._open.get(name)

    def sessions(self) -> list[NamedSession]:
        return list(self._open.values())

    def admit(self, request: JobRequest) -> tuple[NamedSession, bool]:
        """The session ``request`` is a step of, and whether it is the first; RequestError if refused."""
        name = request.session
        assert name is not None
        session = self._open.get(name)
        if session is not None:
            setup = request.setup_fields
            if setup:
                raise RequestError(
                    f"session {name!r} is open and its first request fixed its permissions, limits "
                    f"and environment; a later step carries only {_STEP_FIELDS}",
                    setup[0],
                )
            if session.pending >= MAX_PENDING_STEPS:
                raise RequestError(
                    f"session {name!r} has {session.pending} pending steps, the most it queues; "
                    "read their results before sending more",
                    "session",
                )
            return session, False
        if self.max_sessions == 0:
            raise RequestError("sessions are disabled: the pool's max_sessions is 0", "session")
        if len(self._open) >= self.max_sessions:
            raise RequestError(
                f"{len(self._open)} sessions are open, the pool's max_sessions; close one "
                "(or let one idle out) before starting another",
                "session",
            )
        session = NamedSession(name)
        self._open[name] = session
        return session, True

    def closing(self, session: NamedSession) -> bool:
        """A close for ``session`` was read: out of the table; True if this took it out."""
        if session.phase in (SessionPhase.OPENING, SessionPhase.OPEN):
            session.move(SessionPhase.CLOSING)
        return self._leave(session)

    def end(self, session: NamedSession) -> bool:
        """``session`` ended: out of the table; True if this took it out."""
        if not session.ended:
            session.move(SessionPhase.ENDED)
        return self._leave(session)

    def reserve(self, name: str, *, field: str = "fork") -> NamedSession:
        """An entry named ``name`` for a fork (``field`` "fork") or an attached session ("session"),
        OPENING until it is made; RequestError naming ``field`` if refused."""
        what = "a fork" if field == "fork" else "an attached session"
        if name in self._open:
            raise RequestError(f"session {name!r} is open already; {what} needs a name of its own", field)
        if len(self._open) >= self.max_sessions:
            raise RequestError(
                f"{len(self._open)} sessions are open, the pool's max_sessions; {what} is a session too", field
            )
        session = NamedSession(name)
        self._open[name] = session
        return session

    def _leave(self, session: NamedSession) -> bool:
        session.stop_idle_timer()
        if self._open.get(session.name) is session:
            del self._open[session.name]
            return True
        return False


def not_open(name: str) -> RequestError:
    """Why a request for session ``name`` is refused when none of that name is open."""
    return RequestError(f"no open session named {name!r} (never opened, closed, or ended)", "session")
