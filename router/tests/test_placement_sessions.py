"""Placement of sessions across two fake workers, each a fake runner behind the real ``serve()``.

No runsc: each worker is a fake runner (its ``capacity()`` reports slots,
open sessions and max_sessions; steps by code) served on loopback by the
worker's own gRPC service, so ``Placement``, ``PlacedSession``,
``WorkerClient`` and the Interact stream are the real ones. Covered:

* sessions go to the worker with the fewest (not round robin);
* a worker that refuses (UNAVAILABLE: its runner refuses, or its stream cap
  is full) has the session placed on the other, and is not evicted;
* the router's own max_sessions refuses with SandboxSetupError naming it;
  no worker keeping sessions refuses at once, not after the placement wait;
* a first step that ends the session gives its place back;
* PlacedSession's counters (in_flight, sessions) never go negative and are
  back to 0 after steps, failures, double closes and Placement.close();
* a worker whose server stopped under a session: SessionLost, and that
  worker is evicted; a worker-side PoolWorkerError and a step refused for a
  bad field (timeout_ms over 3,600,000) evict nobody, and after the latter
  the session goes on;
* Placement.close() closes sessions in parallel: sessions on a worker that
  hangs cost one close wait in all, not one each (CLOSE_WAIT_S, 10 s, is
  cut to 1 s there through ``InteractStream.close``'s default);
* a session's step waits for a free slot on its worker instead of
  oversubscribing it; its file requests are relayed without one (a transfer
  waits behind nobody's steps), unless it is hibernated: its worker resumes
  it first, on a slot.

* when the only worker that keeps sessions refuses one and the others
  keep none, open_session refuses at once.

Real workers behind a real router: test_router_runsc.py.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import pytest
from readie_protocol.requests import MAX_TIMEOUT_MS
import structlog

from readie_router._placement import Placement, PlacedSession
from readie_worker.testing import wait_until as wait_for
from readie_policy.jobs import Capacity
from readie_worker.errors import PoolWorkerError, RequestError, SandboxSetupError
from readie_rpc.grpc_service import WorkerServer, serve
from readie_worker.jobs import CodeJob, JobOutcome, Step
from readie_rpc.remote_session import InteractStream, SessionLost
from readie_worker.sessions import StepOutcome
from rpc.tests._interact_fakes import MemoryWorkspace

WAIT_S = 5.0  # the most any bounded wait below takes when things go right


# --------------------------------------------------------------------------- the fake worker


def _ok(text: str) -> JobOutcome:
    return JobOutcome(0, text, "", False, False, None, 1, "", (), None, "fake")


class FakeSession(MemoryWorkspace):
    """Steps by code: ``block`` waits for the worker's release, ``exit`` ends the session,
    ``fail`` is the worker failing (PoolWorkerError); anything else returns at once. Its
    workspace is a dict; a hibernation only says it took 1 ms."""

    def __init__(self, worker: FakeWorker, number: int) -> None:
        super().__init__()
        self._worker = worker
        self.id = f"{worker.name}-s{number}"
        self.steps: list[str] = []
        self.ended = False
        self.closed = threading.Event()

    def run_step(self, step, *, job_id=None, host=None, cancel=None, output=None):
        code = step.code
        with self._worker.busy():
            self.steps.append(code)
            if code == "block":
                self._worker.release.wait(30)
            if code == "fail":
                raise PoolWorkerError("the fake worker failed under the step")
            self.ended = code == "exit"
            return StepOutcome(_ok(code), len(self.steps) + 1, self.ended)

    def hibernate(self, cancel=None) -> float:
        return 1.0

    def close(self) -> None:
        if self._worker.hang_close:
            self._worker.release.wait(30)  # a worker whose sandbox will not go away
        self.ended = True
        self.closed.set()


class FakeWorker:
    """The runner shape plus capacity/drain/close. ``busy`` counts what runs at once (jobs, openings, steps)."""

    def __init__(self, name: str, slots: int = 2, max_sessions: int = 4) -> None:
        self.name = name
        self.slots = slots
        self.max_sessions = max_sessions
        self.refuse = False
        self.hang_close = False
        self.refusals = 0
        self.release = threading.Event()
        self._lock = threading.Lock()
        self.running = 0
        self.max_running = 0
        self.sessions: list[FakeSession] = []

    def busy(self):
        worker = self

        class _Busy:
            def __enter__(self) -> None:
                with worker._lock:
                    worker.running += 1
                    worker.max_running = max(worker.max_running, worker.running)

            def __exit__(self, *exc: object) -> None:
                with worker._lock:
                    worker.running -= 1

        return _Busy()

    def open_sessions(self) -> list[FakeSession]:
        return [s for s in self.sessions if not s.closed.is_set()]

    def capacity(self) -> Capacity:
        return Capacity(self.slots, self.running, False, {}, True, len(self.open_sessions()), self.max_sessions)

    def run_job(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None) -> JobOutcome:
        with self.busy():
            if job.code == "block":
                self.release.wait(30)
            if job.code == "fail":  # the worker's word that the job's sandbox failed
                raise PoolWorkerError("the fake worker's sandbox failed under the job")
            return _ok(job.code)

    def open_session(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None):
        if self.refuse:
            self.refusals += 1
            raise SandboxSetupError(f"{self.name} has no sandbox for a session")
        with self.busy():
            session = FakeSession(self, len(self.sessions) + 1)
            self.sessions.append(session)
            session.ended = job.code == "exit"
            return session, StepOutcome(_ok(job.code), 1, session.ended)

    def drain(self, grace_s: float) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Cluster:
    placement: Placement
    workers: list[FakeWorker]
    servers: list[WorkerServer]

    def member(self, index: int):
        return self.placement._roster.members[index]

    def counts(self) -> list[tuple[int, int]]:
        """(in_flight, sessions) per member, as the placement counts them."""
        with self.placement._roster.lock:
            return [(m.in_flight, m.sessions) for m in self.placement._roster.members]

    def idle(self) -> bool:
        with self.placement._roster.lock:
            return self.counts() == [(0, 0)] * len(self.workers) and not self.placement._sessions


@pytest.fixture
def cluster() -> Iterator[Callable[..., Cluster]]:
    made: list[Cluster] = []

    def make(
        workers: int = 2,
        *,
        slots: int = 2,
        max_sessions: int | list[int] = 4,
        router_max_sessions: int = 64,
        wait_s: float = WAIT_S,
        max_streams: list[int | None] | None = None,
    ) -> Cluster:
        keeps = max_sessions if isinstance(max_sessions, list) else [max_sessions] * workers
        fakes = [FakeWorker(f"w{i}", slots, keep) for i, keep in enumerate(keeps)]
        streams = max_streams or [None] * workers
        servers = [
            serve(fake, "127.0.0.1:0", name=fake.name, max_streams=cap)  # type: ignore[arg-type]
            for fake, cap in zip(fakes, streams)
        ]
        placement = Placement(
            [server.address for server in servers], probe_interval_s=30, wait_s=wait_s, max_sessions=router_max_sessions
        ).start()
        made.append(Cluster(placement, fakes, servers))
        return made[-1]

    yield make
    for built in made:
        for fake in built.workers:
            fake.release.set()
        built.placement.close()
        for server in built.servers:
            server.server.stop(0).wait()


def wait_until(predicate: Callable[[], bool], timeout: float = WAIT_S) -> bool:
    return wait_for(predicate, timeout)


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    """Run ``target`` on a thread; the list gets what it returned or raised."""
    outcome: list[object] = []

    def run() -> None:
        try:
            outcome.append(target())
        except BaseException as exc:  # noqa: BLE001
            outcome.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, outcome


JOB = CodeJob("base", "open", timeout_ms=2000)


# --------------------------------------------------------------------------- where sessions go


def test_sessions_go_to_the_worker_with_the_fewest(cluster):
    c = cluster()
    placed = [c.placement.open_session(JOB)[0] for _ in range(4)]
    assert [len(w.open_sessions()) for w in c.workers] == [2, 2]
    assert c.counts() == [(0, 2), (0, 2)]

    # Free both of w0's: the next two go there, not round robin.
    for session in placed:
        if session.id.startswith("w0"):
            session.close()
    assert c.counts() == [(0, 0), (0, 2)]
    more = [c.placement.open_session(JOB)[0] for _ in range(2)]
    assert [s.id.split("-")[0] for s in more] == ["w0", "w0"]
    assert c.counts() == [(0, 2), (0, 2)]


@pytest.mark.parametrize("how", ["its runner refuses", "its stream cap is full"])
def test_a_session_a_worker_refuses_is_placed_on_the_other(cluster, how):
    c = cluster(max_streams=[0, None] if how == "its stream cap is full" else None)
    c.workers[0].refuse = how == "its runner refuses"
    with structlog.testing.capture_logs() as logs:
        session, first = c.placement.open_session(JOB)
    assert session.id.startswith("w1") and first.step == 1
    refusals = [line for line in logs if line["event"].startswith("worker refused a session")]
    assert [line["worker"] for line in refusals] == ["w0"]  # w0 was asked first, and said no
    assert c.member(0).healthy, "a refusal is not a failure: the worker stays"
    assert c.counts() == [(0, 0), (0, 1)]
    assert session.run_step(Step("x")).outcome.stdout == "x"


def test_the_routers_own_session_limit_is_refused_naming_it(cluster):
    c = cluster(router_max_sessions=2)
    first = c.placement.open_session(JOB)[0]
    c.placement.open_session(JOB)
    started = time.monotonic()
    with pytest.raises(SandboxSetupError, match="at most 2 sessions"):
        c.placement.open_session(JOB)
    assert time.monotonic() - started < 1.0
    first.close()
    c.placement.open_session(JOB)  # a place came back
    assert sum(len(w.open_sessions()) for w in c.workers) == 2


def test_no_worker_keeping_sessions_is_refused_at_once_not_after_the_wait(cluster):
    c = cluster(max_sessions=0, wait_s=60)
    started = time.monotonic()
    with pytest.raises(SandboxSetupError, match="no healthy worker can take the session"):
        c.placement.open_session(JOB)
    assert time.monotonic() - started < 5
    assert c.idle()


def test_when_the_only_worker_keeping_sessions_refuses_the_session_is_refused_at_once(cluster):
    c = cluster(max_sessions=[4, 0], wait_s=2)  # w1 keeps no sessions
    c.workers[0].refuse = True
    started = time.monotonic()
    with pytest.raises(SandboxSetupError):
        c.placement.open_session(JOB)
    assert time.monotonic() - started < 1.0


# --------------------------------------------------------------------------- session places and counters


def test_a_first_step_that_ends_the_session_gives_its_place_back(cluster):
    c = cluster(router_max_sessions=1)
    session, first = c.placement.open_session(CodeJob("base", "exit", timeout_ms=2000))
    assert first.session_ended and session.ended
    assert c.idle()
    assert wait_until(lambda: c.workers[0].sessions[0].closed.is_set())
    with pytest.raises(RequestError, match="has ended"):
        session.run_step(Step("x"))
    assert c.idle()
    again, _ = c.placement.open_session(JOB)  # the router's one place is free again
    assert not again.ended


def test_placed_session_counters_never_go_negative_and_end_at_zero(cluster):
    c = cluster()
    lows = [[0, 0] for _ in c.workers]
    sampling = threading.Event()

    def sample() -> None:
        while not sampling.is_set():
            for low, (in_flight, sessions) in zip(lows, c.counts()):
                low[0], low[1] = min(low[0], in_flight), min(low[1], sessions)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    try:
        sessions: list[PlacedSession] = [c.placement.open_session(JOB)[0] for _ in range(6)]
        ends = ["exit", "fail", None, "close twice", None, None]

        def use(session: PlacedSession, end: str | None) -> None:
            for step in range(5):
                session.run_step(Step(f"step {step}"))
            if end in ("exit", "fail"):
                try:
                    session.run_step(Step(end))
                except PoolWorkerError:
                    pass
                with pytest.raises(RequestError):
                    session.run_step(Step("after the end"))
            if end == "close twice":
                session.close()
                session.close()

        threads = [in_thread(lambda s=s, e=e: use(s, e)) for s, e in zip(sessions, ends)]
        for thread, outcome in threads:
            thread.join(WAIT_S)
            assert outcome == [None], outcome
        assert sum(s.ended for s in sessions) == 3
        assert sum(sessions for _, sessions in c.counts()) == 3
        c.placement.close()
    finally:
        sampling.set()
        sampler.join()
    assert lows == [[0, 0], [0, 0]], f"a counter went negative: {lows}"
    assert c.idle()
    assert c.placement.capacity().sessions == 0 and c.placement.capacity().busy == 0
    assert all(s.closed.is_set() for w in c.workers for s in w.sessions)


# --------------------------------------------------------------------------- what evicts a worker


def test_a_session_whose_worker_stopped_is_lost_and_the_worker_evicted(cluster):
    c = cluster()
    session, _ = c.placement.open_session(JOB)
    assert session.id.startswith("w0")
    c.servers[0].server.stop(0).wait()
    with pytest.raises(SessionLost, match="was lost"):
        session.run_step(Step("x"))
    assert session.ended
    assert not c.member(0).healthy
    assert c.member(1).healthy
    assert c.idle()
    again, _ = c.placement.open_session(JOB)
    assert again.id.startswith("w1")  # the evicted worker gets nothing more


def test_a_worker_side_failure_ends_the_session_without_evicting_the_worker(cluster):
    c = cluster()
    session, _ = c.placement.open_session(JOB)
    with pytest.raises(PoolWorkerError) as caught:
        session.run_step(Step("fail"))
    assert not isinstance(caught.value, SessionLost)
    assert "ended" in str(caught.value)
    assert session.ended
    # A job's too: or a tenant failing its own sandboxes would keep every worker out of placement.
    assert c.placement.run_job(CodeJob("base", "fail")).error.type == "PoolWorkerError"
    assert c.member(0).healthy and c.member(1).healthy
    assert c.idle()
    assert wait_until(lambda: c.workers[0].sessions[0].closed.is_set())


def test_a_step_refused_for_a_bad_field_evicts_nobody_and_the_session_goes_on(cluster):
    c = cluster()
    session, _ = c.placement.open_session(JOB)
    with pytest.raises(RequestError) as caught:
        session.run_step(Step("x", timeout_ms=MAX_TIMEOUT_MS + 1))  # past any timeout: refused before it is sent
    assert caught.value.field == "step.timeout_ms"
    assert not session.ended
    assert c.member(0).healthy and c.member(1).healthy
    assert c.counts() == [(0, 1), (0, 0)]
    assert session.run_step(Step("y")).step == 2
    fake = c.workers[0].sessions[0]
    assert fake.steps == ["y"] and not fake.closed.is_set()


# --------------------------------------------------------------------------- closing


def test_closing_the_placement_closes_sessions_on_a_hanging_worker_in_parallel(cluster, monkeypatch):
    close_wait_s = 1.0  # stands in for CLOSE_WAIT_S (10 s) so the test stays quick
    monkeypatch.setattr(InteractStream.close, "__defaults__", (close_wait_s,))
    c = cluster()
    c.workers[0].hang_close = True
    sessions = [c.placement.open_session(JOB)[0] for _ in range(8)]
    assert [len(w.open_sessions()) for w in c.workers] == [4, 4]
    started = time.monotonic()
    c.placement.close()
    elapsed = time.monotonic() - started
    # Serially this is 4 × close_wait_s on the hanging worker alone.
    assert close_wait_s * 0.9 <= elapsed < close_wait_s + 2.0, elapsed
    assert all(s.ended for s in sessions)
    assert c.idle()
    assert all(s.closed.is_set() for s in c.workers[1].sessions)


# --------------------------------------------------------------------------- a step waits for a slot


def test_a_step_waits_for_a_free_slot_on_its_worker_instead_of_oversubscribing_it(cluster):
    c = cluster(workers=1, slots=1)
    worker = c.workers[0]
    session, _ = c.placement.open_session(JOB)
    job, job_outcome = in_thread(lambda: c.placement.run_job(CodeJob("base", "block", timeout_ms=5000)))
    assert wait_until(lambda: worker.running == 1)
    step, step_outcome = in_thread(lambda: session.run_step(Step("s")))
    time.sleep(0.3)  # long enough for the step to have reached the worker, had it not waited
    assert worker.sessions[0].steps == [] and step_outcome == []
    assert c.counts() == [(1, 1)]

    worker.release.set()
    job.join(WAIT_S)
    step.join(WAIT_S)
    assert job_outcome[0].stdout == "block"
    assert step_outcome[0].outcome.stdout == "s"
    assert worker.max_running == 1, "the step ran beside the job on a one-slot worker"
    assert c.counts() == [(0, 1)]

    # And a running step holds the slot: a job waits for it.
    worker.release.clear()
    step, step_outcome = in_thread(lambda: session.run_step(Step("block")))
    assert wait_until(lambda: worker.running == 1)
    assert c.counts() == [(1, 1)]
    job, job_outcome = in_thread(lambda: c.placement.run_job(CodeJob("base", "after", timeout_ms=5000)))
    time.sleep(0.2)
    assert job_outcome == []
    worker.release.set()
    job.join(WAIT_S)
    step.join(WAIT_S)
    assert job_outcome[0].stdout == "after" and step_outcome[0].outcome.stdout == "block"
    assert worker.max_running == 1


# --------------------------------------------------------------------------- files: relayed, on a slot only to resume


def test_file_requests_are_relayed_without_a_slot_unless_the_session_must_resume(cluster):
    c = cluster(workers=1, slots=1)
    worker = c.workers[0]
    session, _ = c.placement.open_session(JOB)
    job, job_outcome = in_thread(lambda: c.placement.run_job(CodeJob("base", "block", timeout_ms=5000)))
    assert wait_until(lambda: worker.running == 1)  # the worker's one slot is taken
    assert session.upload_chunk("out/a.txt", 0, b"abc", 3) == 3
    assert session.download_chunk("out/a.txt", 1, 8).data == b"bc"
    assert [entry.name for entry in session.list_files("out").entries] == ["a.txt"]
    with pytest.raises(RequestError) as refused:
        session.download_chunk("../a.txt", 0, 1)
    assert refused.value.field == "download.path" and not session.ended
    assert c.counts() == [(1, 1)]

    worker.release.set()
    job.join(WAIT_S)
    worker.release.clear()
    session.hibernate()
    job, job_outcome = in_thread(lambda: c.placement.run_job(CodeJob("base", "block", timeout_ms=5000)))
    assert wait_until(lambda: worker.running == 1)
    listed, listing = in_thread(lambda: session.list_files("."))
    time.sleep(0.2)  # long enough to have reached the worker, had it not waited for the slot
    assert listing == [] and c.counts() == [(1, 1)]  # waiting for the slot
    worker.release.set()
    listed.join(WAIT_S)
    assert [entry.name for entry in listing[0].entries] == ["out"]
    assert not session.hibernated and c.counts() == [(0, 1)]
