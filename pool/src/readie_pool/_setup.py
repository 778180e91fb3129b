"""What the operator fixed when ``readie pool`` started: the engine's one configuration value."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from readie_policy.config import DEFAULT_MAX_SESSIONS, DEFAULT_SESSION_IDLE_MS, Config
from readie_protocol.events import ReadyEvent

from ._events import RuntimeInfo

__all__ = ["QUEUE_FACTOR", "PoolSetup"]

#: The spec: "the pool's queue holds twice the worker count". One batch runs
#: while the next waits, so a worker never idles between jobs, and no more.
QUEUE_FACTOR = 2


@dataclass(frozen=True, slots=True)
class PoolSetup:
    """What the operator fixed at start-up; nothing here comes off the wire."""

    workers: int
    checkpoint: str
    runtime: RuntimeInfo
    cwd: Path  # absolute and resolved; relative request paths resolve against it
    config: Config = field(default_factory=Config)
    package_dirs: tuple[Path, ...] = ()  # the pool's own, absolute; every job gets them
    log_jobs: bool = False  # --log=json: one job_log_line per finished job
    max_sessions: int = DEFAULT_MAX_SESSIONS  # [pool] max_sessions after --max-sessions
    session_idle_ms: int = DEFAULT_SESSION_IDLE_MS  # [pool] session_idle after --session-idle
    session_hibernate_ms: int | None = None  # [pool] session_hibernate after --session-hibernate; None: off

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"workers must be at least 1, got {self.workers}")
        if not self.cwd.is_absolute():
            raise ValueError(f"cwd must be absolute, got {self.cwd}")

    @property
    def queue_limit(self) -> int:
        return QUEUE_FACTOR * self.workers

    def ready_event(self) -> ReadyEvent:
        """The pool's first line: what it serves with."""
        return ReadyEvent.pool(
            workers=self.workers,
            preloaded_modules=self.runtime.preloaded_modules,
            package_dirs=self.package_dirs,
            config=self.config.path,
            profiles=self.config.profile_names,
        )
