"""Warm sandboxes: restored before anyone asks for them.

A :class:`WarmSandboxes` keeps ``target`` ready sandboxes of one kind (one checkpoint, one
restore-time policy shape), each warmed up before it is ready (its first-touch
costs paid, see Sandbox.warm_up). Taking one is a pop and a liveness check:
the connection the warm-up left open tells of an executor that died since
(~10 us); one that waited longer than PING_AFTER_IDLE_S is pinged as well
(~5 ms under gVisor). The refill happens in the background, one restore at a time per worker by
default, because restore is CPU-bound (~0.2-0.45 CPU-s each here) and a
refill that took every core would starve the jobs it is preparing for.

When none is ready the job restores its own sandbox in its own thread,
outside the refill budget: a waiting job outranks a top-up.

("Pool" is the ``readie pool`` process alone, decision 0028: the warm
sandboxes of a checkpoint are its *warm* set, ``Worker.warm``.)
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

import structlog

from ._states import SandboxState
from .errors import SandboxSetupError
from .grants import NO_GRANTS, HeldGrants
from .sandbox import Sandbox, SandboxFactory

log = structlog.get_logger("readie.warm")

# Background restores in flight across all warm sets of a worker. One keeps a
# core free for running jobs on these two-core machines.
DEFAULT_REFILL_CONCURRENCY = 1
# After a failed background restore, wait before the next try, doubling up
# to the cap, so a broken checkpoint does not turn the worker into a restore loop.
REFILL_BACKOFF_S = 0.5
REFILL_BACKOFF_MAX_S = 30.0
# Surplus ready sandboxes (above target) idle longer than this are destroyed.
DEFAULT_IDLE_TTL_S = 300.0
# A sandbox warmed up less than this ago answered a call moments before; its
# open connection is check enough. Past it (an idle worker, where 5 ms do not
# show) the executor must answer a ping before it gets a job.
PING_AFTER_IDLE_S = 10.0
# The next in line, running this long with no take, is paused too (``_pause_idle_head``): an idle
# sentry costs 3-4 % of a core here, and a take this late pings it anyway (PING_AFTER_IDLE_S),
# which wakes what the pause let go cold. Not shorter than the ping's age, so a take that comes
# sooner never meets a paused sandbox it would not ping.
PAUSE_NEXT_IN_LINE_AFTER_S = PING_AFTER_IDLE_S
# A refill waits while the job that took a warm sandbox runs, for at most this long: a restore
# (~0.3 CPU-s on several threads, and the worker's own work to start it) beside a short job on
# two cores slowed a warm pandas print(1) by about a fifth (decision 33). A longer job shares
# the CPU with it after this; the refill never waits on more than this.
REFILL_HOLD_MAX_S = 0.05
# ...but not while demand outruns the set: this soon after a miss, a refill starts at once.
NO_HOLD_AFTER_MISS_S = 2.0


class RefillBudget:
    """Bounds background restores across all warm sets of one worker."""

    def __init__(self, concurrency: int = DEFAULT_REFILL_CONCURRENCY) -> None:
        self._slots = threading.BoundedSemaphore(max(1, concurrency))

    def __enter__(self) -> None:
        self._slots.acquire()

    def __exit__(self, *exc: object) -> None:
        self._slots.release()


class SandboxObserver(Protocol):
    """What a warm set tells of the sandboxes it makes (``metrics.Metrics`` is one)."""

    def sandbox_made(self, checkpoint: str, sandbox: Sandbox) -> None: ...

    def sandbox_failed(self, checkpoint: str) -> None: ...


@dataclass
class _Ready:
    sandbox: Sandbox
    since: float  # ready (warmed up) since: what a take's probe goes by
    running_since: float | None = None  # the next in line, running, since; None while paused


class WarmSandboxes:
    def __init__(
        self,
        name: str,
        factory: SandboxFactory,
        target: int,
        budget: RefillBudget,
        idle_ttl_s: float = DEFAULT_IDLE_TTL_S,
        *,
        warm_up: bool = True,
        observer: SandboxObserver | None = None,
    ) -> None:
        self.name = name
        self.factory = factory
        self.target = target
        self._budget = budget
        self._idle_ttl_s = idle_ttl_s
        self._warm_up = warm_up
        self._observer = observer  # told of every sandbox made or failed (metrics.py)
        self._ready: deque[_Ready] = deque()
        self._restoring = 0
        self._holds = 0  # jobs running that asked the refill to wait (refill_held)
        self._last_miss = -NO_HOLD_AFTER_MISS_S
        self._closed = False
        self._stop = threading.Event()  # wakes a refiller sleeping off a failure
        self._changed = threading.Condition()
        self._refiller = threading.Thread(target=self._refill_loop, name=f"refill-{name}", daemon=True)
        self.hits = 0
        self.misses = 0

    def start(self) -> WarmSandboxes:
        self._refiller.start()
        return self

    @property
    def ready_count(self) -> int:
        with self._changed:
            return len(self._ready)

    @property
    def paused_count(self) -> int:
        """Ready sandboxes waiting paused now: those behind the next in line, and it after a long wait."""
        with self._changed:
            return sum(1 for ready in self._ready if ready.sandbox.paused)

    def take(self) -> Sandbox:
        """A live, pristine sandbox: a warm one if any passes its probe, else a fresh restore."""
        while True:
            with self._changed:
                if self._closed:
                    raise SandboxSetupError(f"pool {self.name} is closed")
                entry = self._ready.popleft() if self._ready else None
                if not self._holds:  # else once the job that took it is done (refill_held)
                    self._next_in_line_runs()
                self._changed.notify_all()
            if entry is None:
                break
            # The next in line runs already, unless a job of this set was running when it became
            # next. One that cannot be resumed is as good as dead (a stopped sentry's socket is quiet).
            resumed = entry.sandbox.resume()
            recent = time.monotonic() - entry.since < PING_AFTER_IDLE_S
            if resumed and ((recent and entry.sandbox.connection_intact()) or entry.sandbox.alive()):
                entry.sandbox.move(SandboxState.BUSY)
                self.hits += 1
                return entry.sandbox
            log.warning("warm sandbox failed its probe", checkpoint=self.name, sandbox=entry.sandbox.id)
            entry.sandbox.destroy()
        with self._changed:
            self.misses += 1
            self._last_miss = time.monotonic()
        # Warmed here too, so that every sandbox a warm set hands out is in the same state
        # (the seccomp filter in place above all), hit or miss.
        sandbox = self._warmed(self._create())
        sandbox.move(SandboxState.BUSY)
        return sandbox

    @contextlib.contextmanager
    def refill_held(self) -> Iterator[None]:
        """Around a job that takes a sandbox of this set: the refill its take starts waits until
        the job is done, at most ``REFILL_HOLD_MAX_S`` (none soon after a miss)."""
        with self._changed:
            self._holds += 1
        try:
            yield
        finally:
            with self._changed:
                self._holds -= 1
                self._next_in_line_runs()
                self._changed.notify_all()

    def _hold_left_s(self, needed_since: float) -> float:
        """How much longer a refill needed since ``needed_since`` waits for running jobs (called
        holding ``_changed``): never past ``REFILL_HOLD_MAX_S``, whatever jobs come meanwhile."""
        now = time.monotonic()
        if self._holds == 0 or now - self._last_miss < NO_HOLD_AFTER_MISS_S:
            return 0.0
        return needed_since + REFILL_HOLD_MAX_S - now

    def reap_idle(self) -> int:
        """Destroy surplus sandboxes (beyond target) idle longer than the TTL."""
        doomed = []
        now = time.monotonic()
        with self._changed:
            while len(self._ready) > self.target and now - self._ready[0].since > self._idle_ttl_s:
                doomed.append(self._ready.popleft().sandbox)
            self._next_in_line_runs()
            self._changed.notify_all()  # the refiller pauses the next in line in time
        for sandbox in doomed:
            sandbox.destroy()
        return len(doomed)

    def close(self) -> None:
        self._stop.set()
        with self._changed:
            self._closed = True
            doomed = [entry.sandbox for entry in self._ready]
            self._ready.clear()
            self._changed.notify_all()
        if self._refiller.is_alive():
            self._refiller.join()
        for sandbox in doomed:
            sandbox.destroy()

    def _refill_loop(self) -> None:
        backoff = REFILL_BACKOFF_S
        while True:
            with self._changed:
                needed_since = None
                while not self._closed:
                    pause_in_s = self._pause_idle_head()
                    if len(self._ready) + self._restoring >= self.target:
                        needed_since = None
                        self._changed.wait(pause_in_s)
                        continue
                    needed_since = needed_since or time.monotonic()
                    hold_s = self._hold_left_s(needed_since)
                    if hold_s <= 0:
                        break
                    self._changed.wait(hold_s)
                if self._closed:
                    return
                self._restoring += 1
            try:
                with self._budget:
                    sandbox = None if self._closed else self._warmed(self._create())
            except Exception as exc:  # a refill failure must never kill the refiller
                log.warning("background restore failed", checkpoint=self.name, error=str(exc), retry_in_s=backoff)
                sandbox = None
                self._stop.wait(backoff)
                backoff = min(backoff * 2, REFILL_BACKOFF_MAX_S)
            else:
                backoff = REFILL_BACKOFF_S
            with self._changed:
                self._restoring -= 1
                if sandbox is not None:
                    if self._closed:
                        sandbox.destroy()
                    else:
                        now = time.monotonic()
                        if self._ready:  # behind another: paused till it is next (_next_in_line_runs)
                            sandbox.pause()
                        self._ready.append(_Ready(sandbox, now, None if self._ready else now))
                self._changed.notify_all()

    def _next_in_line_runs(self) -> None:
        """The sandbox a take gets next runs; those behind it wait paused (holding ``_changed``).

        An idle gVisor sentry still wakes every 400 µs (systrap's fast-path controller): a few
        percent of a core per waiting sandbox here, none paused (frozen). But a sandbox resumed
        right before its job runs the job slower (+0.4-0.6 ms p50 frozen, and p90 +9 ms when a SIGSTOP
        paused it: decision 33), and
        one resumed beside a running job slows that job (+0.3 ms p50). So the next in line is
        resumed when a job of this set ends (``refill_held``), or at a take outside any job; a take
        while another job runs may get it still paused, and resume it then, the cold case. It runs
        until ``PAUSE_NEXT_IN_LINE_AFTER_S`` pass with no take (``_pause_idle_head``).
        """
        if self._ready and self._ready[0].running_since is None:
            self._ready[0].sandbox.resume()
            self._ready[0].running_since = time.monotonic()

    def _pause_idle_head(self) -> float | None:
        """Pause the next in line once it has run ``PAUSE_NEXT_IN_LINE_AFTER_S`` with no take (holding
        ``_changed``); the seconds until that is due, None if nothing runs waiting."""
        head = self._ready[0] if self._ready else None
        if head is None or head.running_since is None:
            return None
        due_in_s = head.running_since + PAUSE_NEXT_IN_LINE_AFTER_S - time.monotonic()
        if due_in_s > 0:
            return due_in_s
        head.sandbox.pause()
        head.running_since = None
        log.debug("idle warm sandbox paused", checkpoint=self.name, sandbox=head.sandbox.id)
        return None

    def made_for_a_job(self, grants: HeldGrants, factory: SandboxFactory | None = None) -> Sandbox:
        """A sandbox of this checkpoint made for one job (its own mounts, or ``factory``'s network),
        not taken from the warm set; told to the observer as the set's own are."""
        return self._create(grants, factory or self.factory)

    def _create(self, grants: HeldGrants = NO_GRANTS, factory: SandboxFactory | None = None) -> Sandbox:
        try:
            sandbox = (factory or self.factory).create(grants)
        except Exception:
            if self._observer is not None:
                self._observer.sandbox_failed(self.name)
            raise
        if self._observer is not None:
            self._observer.sandbox_made(self.name, sandbox)
        return sandbox

    def _warmed(self, sandbox: Sandbox) -> Sandbox:
        """``sandbox`` once its first-touch costs are paid (Sandbox.warm_up); destroyed if that fails."""
        if not self._warm_up:
            return sandbox
        try:
            problem = sandbox.warm_up()
        except BaseException:
            sandbox.destroy()
            raise
        if problem is not None:
            sandbox.destroy()
            raise SandboxSetupError(f"sandbox {sandbox.id} failed its warm-up: {problem}")
        return sandbox

    def wait_until_full(self, timeout: float) -> bool:
        """Block until the warm set holds its target (tests, benchmarks, start-up)."""
        deadline = time.monotonic() + timeout
        with self._changed:
            while len(self._ready) < self.target:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._changed.wait(remaining)
        return True
