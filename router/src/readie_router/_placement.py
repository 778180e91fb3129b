"""Placement: which worker runs the next job.

Workers are probed on a timer (their Capacity RPC). A worker that fails
``EVICT_AFTER_FAILURES`` probes in a row is evicted: it gets no jobs until a
probe succeeds again. A job goes to the least loaded healthy worker that is
not draining and has a free slot, counting the jobs this router has in
flight there (the probe's figure is up to one interval old).

A job whose worker dies under it fails with PoolWorkerError and is not
retried, since its side effects may have happened. A worker that refuses a
job before running it (draining, no sandbox) is not a failure of the job:
the job is offered to another worker.

:class:`Placement` has the in-process :class:`~readie_worker.core.Worker`'s
shape (``run_job``, ``execute_call``, ``capacity``, ``drain``, ``close``), so
the worker's own gRPC service serves a router unchanged.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

import structlog

from readie_worker.client import WorkerClient
from readie_worker.core import Capacity
from readie_worker.errors import PoolWorkerError, SandboxSetupError
from readie_worker.jobs import CodeJob, JobOutcome

log = structlog.get_logger("readie.placement")

# Probes are cheap (a Capacity RPC answered from memory); once a second
# notices a dead worker within a few seconds without loading anyone.
PROBE_INTERVAL_S = 1.0
# One missed probe can be a hiccup; three in a row is a dead worker.
EVICT_AFTER_FAILURES = 3
# How long a job waits for a free slot anywhere before it is refused.
PLACEMENT_WAIT_S = 60.0
PLACEMENT_POLL_S = 0.02

_T = TypeVar("_T")


@dataclass
class _Member:
    client: WorkerClient
    name: str = ""
    healthy: bool = False
    capacity: Capacity | None = None
    failures: int = 0
    in_flight: int = 0

    def free(self) -> int:
        if not self.healthy or self.capacity is None or self.capacity.draining:
            return 0
        return self.capacity.slots - self.in_flight

    def load(self) -> float:
        assert self.capacity is not None
        return self.in_flight / max(1, self.capacity.slots)


@dataclass
class Placement:
    addresses: Sequence[str]
    probe_interval_s: float = PROBE_INTERVAL_S
    wait_s: float = PLACEMENT_WAIT_S
    _members: list[_Member] = field(init=False)
    _lock: threading.Condition = field(init=False, default_factory=threading.Condition)
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _prober: threading.Thread | None = field(init=False, default=None)
    _draining: bool = field(init=False, default=False)

    def __post_init__(self) -> None:
        self._members = [_Member(WorkerClient(address)) for address in self.addresses]

    def start(self) -> Placement:
        self.probe_all()
        self._prober = threading.Thread(target=self._probe_loop, name="placement-probe", daemon=True)
        self._prober.start()
        return self

    # -- the Worker shape ---------------------------------------------------

    def run_job(self, job: CodeJob, job_id: str | None = None) -> JobOutcome:
        started = time.monotonic()
        try:
            return self._place(lambda client: client.run_job(job, job_id), job.checkpoint)
        except PoolWorkerError as exc:
            duration_us = int((time.monotonic() - started) * 1_000_000)
            return JobOutcome.failure("PoolWorkerError", str(exc), duration_us, "remote")

    def execute_call(self, checkpoint: str, payload: bytes, timeout_s: float, max_response: int | None = None) -> bytes:
        return self._place(lambda client: client.execute_call(checkpoint, payload, timeout_s, max_response), checkpoint)

    def capacity(self) -> Capacity:
        with self._lock:
            live = [m for m in self._members if m.healthy and m.capacity is not None]
            pools: dict[str, dict[str, int]] = {}
            for member in live:
                assert member.capacity is not None
                for name, state in member.capacity.pools.items():
                    total = pools.setdefault(name, {"ready": 0, "target": 0})
                    total["ready"] += state["ready"]
                    total["target"] += state["target"]
            return Capacity(
                slots=sum(m.capacity.slots for m in live if m.capacity),
                busy=sum(m.in_flight for m in live),
                draining=self._draining,
                pools=pools,
                isolated=all(m.capacity.isolated for m in live if m.capacity),
            )

    def drain(self, grace_s: float = 30.0) -> None:
        with self._lock:
            self._draining = True
            deadline = time.monotonic() + grace_s
            while any(m.in_flight for m in self._members) and time.monotonic() < deadline:
                self._lock.wait(deadline - time.monotonic())
        self.close()

    def close(self) -> None:
        self._stop.set()
        if self._prober is not None and self._prober is not threading.current_thread():
            self._prober.join()
        for member in self._members:
            member.client.close()

    # -- placement ----------------------------------------------------------

    def _place(self, call: Callable[[WorkerClient], _T], checkpoint: str) -> _T:
        refused: set[int] = set()
        while True:
            member = self._choose(refused)
            try:
                return call(member.client)
            except SandboxSetupError as exc:
                # Refused before anything ran (draining, no sandbox): another worker may take it.
                log.info("worker refused a job; placing it elsewhere", worker=member.name, error=str(exc))
                refused.add(id(member))
            except PoolWorkerError:
                self._mark_failed(member)
                raise  # it may have run: never retried
            finally:
                with self._lock:
                    member.in_flight -= 1
                    self._lock.notify_all()

    def _choose(self, refused: set[int]) -> _Member:
        deadline = time.monotonic() + self.wait_s
        with self._lock:
            while True:
                if self._draining:
                    raise SandboxSetupError("the router is draining and takes no new work")
                candidates = [m for m in self._members if m.free() > 0 and id(m) not in refused]
                if candidates:
                    chosen = min(candidates, key=_Member.load)
                    chosen.in_flight += 1
                    return chosen
                if not any(m.healthy and id(m) not in refused for m in self._members):
                    raise SandboxSetupError("no healthy worker can take the job")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SandboxSetupError(f"no worker had a free slot within {self.wait_s:.0f} s")
                self._lock.wait(min(remaining, PLACEMENT_POLL_S * 50))

    def _mark_failed(self, member: _Member) -> None:
        with self._lock:
            member.healthy = False
            member.failures = EVICT_AFTER_FAILURES
        log.warning("worker lost under a job; evicted until it answers a probe", worker=member.name or member.client.address)

    # -- probing ------------------------------------------------------------

    def probe_all(self) -> None:
        for member in self._members:
            self._probe(member)

    def _probe(self, member: _Member) -> None:
        try:
            capacity, name = member.client.capacity()
        except Exception as exc:  # any failure to answer counts against the worker
            with self._lock:
                member.failures += 1
                if member.failures >= EVICT_AFTER_FAILURES and member.healthy:
                    member.healthy = False
                    log.warning("worker evicted", worker=member.name or member.client.address, error=str(exc))
            return
        with self._lock:
            if not member.healthy:
                log.info("worker admitted", worker=name, address=member.client.address, slots=capacity.slots)
            member.name, member.capacity, member.failures, member.healthy = name, capacity, 0, True
            self._lock.notify_all()

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            self.probe_all()
