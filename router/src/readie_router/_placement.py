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

Workers named by ``--worker`` stay members for the router's life. Those
found by DNS (``--worker-dns``, :mod:`._discovery`) come and go: a new
address is a member that gets work once a probe admits it; an address that
left the answer is *retired*: it gets no new jobs or sessions, the calls
running on it finish, the sessions on it keep it until they end, and then
it is dropped. An address that comes back before then is simply un-retired.

A session is placed on the healthy worker with the fewest sessions (among
those with a free slot and room for one more), and stays there: its steps go
down the session's own Interact stream to that worker
(:class:`~readie_rpc.remote_session.RemoteSession`). A session without a key
ends with its worker: the next step says so and nothing starts a fresh one
elsewhere. One with a key (decision 32) is placed anew by it when its
worker hands it over or is lost (:meth:`Placement.attach_session`, which a
client's ``attach`` uses too). Jobs with host functions are placed like any
job; their calls come back on the job's stream.

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

from readie_protocol.cancel import NEVER, Cancellation
from readie_worker.metrics import Metrics
from readie_rpc.client import WorkerClient
from readie_policy.jobs import Capacity
from readie_worker.errors import Cancelled, ErrorType, PoolWorkerError, RequestError, SandboxSetupError
from readie_worker.jobs import CodeJob, HostFunction, JobOutcome, OutputSink
from readie_rpc.client import NotStarted, Unreachable, WorkerLost
from readie_rpc.remote_session import RemoteSession, StreamBroken
from readie_rpc.security import ClientSecurity
from readie_worker.sessions import StepOutcome

from ._discovery import DEFAULT_DNS_INTERVAL_S, Discovery
from ._members import Member
from ._placed_session import OpenSessions, PlacedSession
from ._roster import EVICT_AFTER_FAILURES, PLACEMENT_POLL_S, Roster

log = structlog.get_logger("readie.placement")

# Probes are cheap (a Capacity RPC answered from memory); once a second
# notices a dead worker within a few seconds without loading anyone.
PROBE_INTERVAL_S = 1.0
# The longest a router stays quiet about a worker that does not answer its probes.
COMPLAINT_GAP_MAX_S = 60.0
# How long a job waits for a free slot anywhere before it is refused.
PLACEMENT_WAIT_S = 60.0
# Sessions this router keeps open across its workers. A session served over
# the router's own Interact stream holds one of its server threads for its
# life, so the router's thread pool is sized with this (router_cli).
DEFAULT_ROUTER_SESSIONS = 64

_T = TypeVar("_T")


@dataclass
class Placement:
    addresses: Sequence[str]
    probe_interval_s: float = PROBE_INTERVAL_S
    wait_s: float = PLACEMENT_WAIT_S
    max_sessions: int = DEFAULT_ROUTER_SESSIONS
    security: ClientSecurity = ClientSecurity()  # how this router reaches its workers
    discovery: Discovery | None = None  # further workers, found by DNS
    dns_interval_s: float = DEFAULT_DNS_INTERVAL_S
    metrics: Metrics | None = None
    _roster: Roster = field(init=False)  # the members and their counts, under its lock
    _stop: threading.Event = field(init=False, default_factory=threading.Event)
    _prober: threading.Thread | None = field(init=False, default=None)
    _discoverer: threading.Thread | None = field(init=False, default=None)
    _draining: bool = field(init=False, default=False)
    # A router's drain hands its clients' sessions over: its workers' stores hold them (decision 32).
    hands_sessions_over: bool = field(init=False, default=True)
    _sessions: OpenSessions = field(init=False)

    def __post_init__(self) -> None:
        members = [Member(WorkerClient(address, self.security)) for address in self.addresses]
        self._roster = Roster(self.wait_s, self.max_sessions, self.metrics, members)
        self._sessions = OpenSessions(self._roster, self._attach)

    def start(self) -> Placement:
        self.probe_all()
        if self.discovery is not None:
            self.discover()  # the first answer's workers probed before the router serves
            self._discoverer = threading.Thread(target=self._discover_loop, name="placement-dns", daemon=True)
            self._discoverer.start()
        self._prober = threading.Thread(target=self._probe_loop, name="placement-probe", daemon=True)
        self._prober.start()
        return self

    # -- the Worker shape ---------------------------------------------------

    def run_job(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> JobOutcome:
        started = time.monotonic()
        try:
            return self._place(lambda client: client.run_job(job, job_id, host, cancel=cancel, output=output), job.checkpoint)
        except PoolWorkerError as exc:
            duration_us = int((time.monotonic() - started) * 1_000_000)
            return JobOutcome.failure(ErrorType.POOL_WORKER, str(exc), duration_us, "remote")

    def open_session(
        self, job: CodeJob, job_id: str | None = None, host: HostFunction | None = None, *,
        cancel: Cancellation = NEVER, output: OutputSink | None = None,
    ) -> tuple[PlacedSession, StepOutcome]:
        """Open a session on one worker, where it stays (``Worker.open_session``'s shape)."""
        refused: set[int] = set()
        while True:
            member = self._choose(refused, session=True)
            try:
                remote, first = member.client.open_session(job, job_id, host, cancel=cancel, output=output)
            except SandboxSetupError as exc:
                log.info("worker refused a session; placing it elsewhere", worker=member.name, error=str(exc))
                refused.add(id(member))
                self._roster.release(member, session=True)
                continue
            except BaseException as exc:
                self._roster.release(member, session=True)
                if isinstance(exc, StreamBroken):
                    self._roster.mark_failed(member)  # as for a job lost with its worker
                raise
            self._roster.release(member)
            placed = self._sessions.add(member, remote)
            if first.session_ended:
                placed.close()
            log.info("session placed", session=remote.id, worker=member.name)
            return placed, first

    def attach_session(self, key: str, *, take_over: bool = False, cancel: Cancellation = NEVER) -> tuple[PlacedSession, int]:
        """The session stored under ``key``, attached on the worker chosen as for a new session,
        and the number of its last step (``JobRunner.attach_session``'s shape, decision 32)."""
        member, remote, step = self._attach(key, take_over, None, cancel)
        log.info("session attached", session=remote.id, worker=member.name, take_over=take_over)
        return self._sessions.add(member, remote), step

    def _attach(
        self, key: str, take_over: bool, job: CodeJob | None, cancel: Cancellation = NEVER
    ) -> tuple[Member, RemoteSession, int]:
        """Attach by ``key`` on a worker with room for a session (its place taken, its slot given
        back); a worker that refuses before anything ran is passed over for the next, and so is
        one that holds no session under the key (workers with stores of their own hold only
        theirs). A key no worker knows, the session's own failure or a lost worker are raised,
        the place given back."""
        refused: set[int] = set()
        unknown: RequestError | None = None
        # A worker that refused the stored image (failed verification: it removed the entry) said
        # what became of the session; the workers asked after it can only say they know no such key.
        setup_failed: SandboxSetupError | None = None
        while True:
            try:
                member = self._choose(refused, session=True)
            except SandboxSetupError:
                if setup_failed is not None:
                    raise setup_failed from None
                if unknown is not None:  # every worker that could was asked
                    raise unknown from None
                raise
            try:
                remote, step = member.client.attach_session(key, take_over=take_over, cancel=cancel, job=job)
            except (StreamBroken, Unreachable) as exc:  # that worker is lost: the next is asked as it was
                # Not with take_over: nothing says the lost worker held the session. Its live holder
                # may be another (detaching, its newest state not yet written), and a take-over would
                # throw that state away; a lease the lost worker took goes stale in seconds.
                log.info("worker lost while attaching a session; trying another", worker=member.name, error=str(exc))
                refused.add(id(member))
                self._roster.release(member, session=True)
                self._roster.mark_failed(member)
                continue
            except (SandboxSetupError, RequestError) as exc:
                if isinstance(exc, RequestError) and exc.field != "attach":
                    self._roster.release(member, session=True)
                    raise
                if isinstance(exc, RequestError):
                    unknown = exc
                else:
                    setup_failed = exc
                log.info("worker did not attach a session; trying another", worker=member.name, error=str(exc))
                refused.add(id(member))
                self._roster.release(member, session=True)
                continue
            except BaseException:
                self._roster.release(member, session=True)
                raise
            self._roster.release(member)
            return member, remote, step

    def execute_call(
        self,
        checkpoint: str,
        payload: bytes,
        timeout_s: float,
        max_response: int | None = None,
        *,
        cancel: Cancellation = NEVER,
    ) -> bytes:
        return self._place(
            lambda client: client.execute_call(checkpoint, payload, timeout_s, max_response, cancel=cancel), checkpoint
        )

    def capacity(self) -> Capacity:
        with self._roster.lock:
            live = [m for m in self._roster.members if m.healthy and m.capacity is not None and not m.retired]
            warm: dict[str, dict[str, int]] = {}
            for member in live:
                assert member.capacity is not None
                for name, state in member.capacity.warm.items():
                    total = warm.setdefault(name, {"ready": 0, "target": 0})
                    total["ready"] += state["ready"]
                    total["target"] += state["target"]
            return Capacity(
                slots=sum(m.capacity.slots for m in live if m.capacity),
                busy=sum(m.in_flight for m in live),
                draining=self._draining,
                warm=warm,
                isolated=all(m.capacity.isolated for m in live if m.capacity),
                sessions=sum(m.sessions for m in self._roster.members),
                # The router's own cap, unless its live workers keep fewer between them.
                max_sessions=min(self.max_sessions, sum(m.capacity.max_sessions for m in live if m.capacity)),
                problem=None if live else f"no healthy worker (of {len(self._roster.members)})",
            )

    def drain(self, grace_s: float = 30.0) -> None:
        with self._roster.lock:
            self._draining = True
            deadline = time.monotonic() + grace_s
            while any(m.in_flight for m in self._roster.members) and time.monotonic() < deadline:
                self._roster.lock.wait(deadline - time.monotonic())
        self.close()

    def close(self) -> None:
        self._stop.set()
        for thread in (self._prober, self._discoverer):
            if thread is not None and thread is not threading.current_thread():
                thread.join()
        self._sessions.let_go_all("the router is shutting down")
        with self._roster.lock:
            members = list(self._roster.members)
        for member in members:
            member.client.close()

    def discovered_workers(self) -> int:
        """Members found by DNS and not retired (what ``readie_router_discovered_workers`` shows)."""
        with self._roster.lock:
            return sum(1 for m in self._roster.members if m.discovered and not m.retired)

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
            except Cancelled:
                raise  # our caller left: the worker is as healthy as it was
            except WorkerLost:  # no word from the worker: it may be gone until a probe says otherwise
                self._roster.mark_failed(member)
                raise  # it may have run: never retried
            # Any other PoolWorkerError is the worker's word, or this router's refusal of what the
            # worker relayed from a sandbox: the worker is as healthy as it was (a tenant's job must
            # not be able to evict it), and the job, which may have run, is never retried.
            finally:
                self._roster.release(member)

    def _choose(self, refused: set[int], *, session: bool = False) -> Member:
        """The worker for a job (a slot taken), or for a session (a slot and a session place taken)."""
        deadline = time.monotonic() + self.wait_s
        room, order = (Member.session_room, Member.session_load) if session else (Member.free, Member.load)
        with self._roster.lock:
            while True:
                if self._draining:
                    raise NotStarted("the router is draining and takes no new work")
                if session and sum(m.sessions for m in self._roster.members) >= self.max_sessions:
                    raise SandboxSetupError(f"this router keeps at most {self.max_sessions} sessions, and all are open")
                candidates = [m for m in self._roster.members if not m.retired and room(m) > 0 and id(m) not in refused]
                if candidates:
                    chosen = min(candidates, key=order)
                    chosen.in_flight += 1
                    chosen.sessions += session
                    return chosen
                if not any(m.could_take(session) and id(m) not in refused for m in self._roster.members):
                    # Waiting cannot help: nobody left who would ever say yes. Nothing ran, so a
                    # client with another router (or time to wait for a restarted worker) may send
                    # it again: a rolling restart leaves a router with no worker for a moment.
                    what = "session (a worker with --max-sessions 0, or too old, keeps none)" if session else "job"
                    raise NotStarted(f"no healthy worker can take the {what}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SandboxSetupError(f"no worker had a free slot within {self.wait_s:.0f} s")
                self._roster.lock.wait(min(remaining, PLACEMENT_POLL_S * 50))

    # -- probing ------------------------------------------------------------

    def probe_all(self) -> None:
        with self._roster.lock:
            members = list(self._roster.members)  # discovery may add or drop some meanwhile
        for member in members:
            self._probe(member)

    def _probe(self, member: Member) -> None:
        try:
            capacity, name = member.client.capacity()
        except Exception as exc:  # any failure to answer counts against the worker
            with self._roster.lock:
                if member not in self._roster.members:
                    return  # dropped (and its channel closed) while we asked
                self._count_probe("failed")
                member.failures += 1
                if member.failures >= EVICT_AFTER_FAILURES and member.healthy:
                    member.healthy = False
                    self._roster.count_eviction("probes")
                    log.warning("worker evicted", worker=member.name or member.client.address, error=str(exc))
                self._complain(member, exc)
            return
        with self._roster.lock:
            if member not in self._roster.members:
                return
            self._count_probe("ok")
            if not member.healthy:
                log.info("worker admitted", worker=name, address=member.client.address, slots=capacity.slots)
            member.name, member.capacity, member.failures, member.healthy = name, capacity, 0, True
            member.next_complaint, member.complaint_gap_s = 0.0, 0.0
            self._roster.lock.notify_all()

    def _complain(self, member: Member, exc: Exception) -> None:
        """Log a failed probe: the first at once (a mistyped --worker shows at start), then after
        gaps that double up to COMPLAINT_GAP_MAX_S, so a dead worker does not flood the log."""
        now = time.monotonic()
        if now < member.next_complaint:
            return
        member.complaint_gap_s = min(COMPLAINT_GAP_MAX_S, max(self.probe_interval_s, member.complaint_gap_s * 2))
        member.next_complaint = now + member.complaint_gap_s
        log.warning(
            "worker unreachable",
            worker=member.name or member.client.address,
            failed_probes=member.failures,
            error=str(exc),
            next_report_s=round(member.complaint_gap_s, 1),
        )

    def _probe_loop(self) -> None:
        while not self._stop.wait(self.probe_interval_s):
            self.probe_all()

    def _count_probe(self, outcome: str) -> None:
        if self.metrics is not None:
            self.metrics.placement_probed(outcome)

    # -- discovery ----------------------------------------------------------

    def discover(self) -> None:
        """One round of DNS: members added for new addresses (and probed), retired for those gone."""
        assert self.discovery is not None
        answer = set(self.discovery.resolve())
        fresh: list[Member] = []
        with self._roster.lock:
            named = {m.client.address for m in self._roster.members if not m.discovered}
            found = {m.client.address: m for m in self._roster.members if m.discovered}
            for address in sorted(answer - named - found.keys()):
                member = Member(WorkerClient(address, self.security), discovered=True)
                self._roster.members.append(member)
                fresh.append(member)
            for address, member in found.items():
                if member.retired and address in answer:
                    member.retired = False
                    log.info("worker back in the DNS answer", worker=member.name or address)
                    self._roster.lock.notify_all()
                elif not member.retired and address not in answer:
                    member.retired = True
                    self._roster.count_eviction("retired")
                    log.info(
                        "worker retired: its address left the DNS answer",
                        worker=member.name or address, in_flight=member.in_flight, sessions=member.sessions,
                    )
            dropped = [m for m in found.values() if self._roster.drop_if_done(m)]
        for member in dropped:
            member.client.close()
        for member in fresh:  # before any work: only a probe makes a member healthy
            self._probe(member)

    def _discover_loop(self) -> None:
        while not self._stop.wait(self.dns_interval_s):
            try:
                self.discover()
            except Exception:  # a bug here must not stop discovery for the router's life
                log.exception("worker discovery failed")
