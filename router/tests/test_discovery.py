"""Workers found by DNS (``--worker-dns``): Placement over fake workers, with a resolver stub.

No runsc: each worker is a fake runner behind the worker's real ``serve()``,
on its own loopback address (127.0.0.2, 127.0.0.3, ...) and one shared port,
as a headless Service's pods are; the resolver is a stub the test changes
between rounds, and each round is run by hand (``Placement.discover``), so
counts are exact. ``Placement``, ``Discovery``, ``WorkerClient`` and the
Interact stream are the real ones. Covered:

* every address of the answer becomes a member, probed before it gets work;
  one that does not answer its probe gets none;
* an address that leaves the answer gets no new jobs or sessions, the job
  running there finishes, a session there keeps it until it ends, then the
  member is dropped; an address back in time is un-retired;
* an address added later is probed and gets jobs;
* a failed lookup keeps the last answer, logged once per change;
* the answer is bounded, and only IP literals are taken; NAME:PORT parsing;
* the router's metrics: probes, evictions by reason, the discovered gauge.

Real ``readie worker`` processes behind a real router, with /etc/hosts
changing under it: test_router_dns.py.
"""

from __future__ import annotations

import argparse
import socket
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
import structlog

from readie_router._discovery import MAX_DISCOVERED_WORKERS, Discovery, DnsName, dns_name
from readie_router._placement import Placement
from readie_rpc.grpc_service import WorkerServer, serve
from readie_policy.jobs import Capacity
from readie_worker.errors import SandboxSetupError
from readie_worker.jobs import CodeJob, JobOutcome, Step
from readie_worker.metrics import Metrics
from readie_worker.sessions import StepOutcome
from readie_worker.testing import free_port, wait_until

NAME = "workers.readie.test"
WAIT_S = 10.0  # the most a bounded wait below takes when things go right
# Rounds are run by hand: the timers must never fire during a test.
NEVER_S = 3600.0


def _ok(text: str) -> JobOutcome:
    return JobOutcome(0, text, "", False, False, None, 1, "", (), None, "fake")


class FakeSession:
    def __init__(self, worker: FakeWorker, number: int) -> None:
        self.id = f"{worker.name}-s{number}"
        self.ended = False
        self.steps = 0

    def run_step(self, step, *, job_id=None, host=None, cancel=None, output=None):
        self.steps += 1
        return StepOutcome(_ok(step.code), self.steps + 1, False)

    def close(self) -> None:
        self.ended = True


class FakeWorker:
    """A runner whose job ``block`` waits for ``release``; counts the jobs it ran."""

    def __init__(self, name: str, slots: int = 2) -> None:
        self.name = name
        self.slots = slots
        self.release = threading.Event()
        self.jobs: list[str] = []
        self.running = 0
        self.sessions: list[FakeSession] = []
        self._lock = threading.Lock()

    def capacity(self) -> Capacity:
        open_sessions = sum(1 for s in self.sessions if not s.ended)
        return Capacity(self.slots, self.running, False, {}, True, open_sessions, 4)

    def run_job(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None) -> JobOutcome:
        with self._lock:
            self.jobs.append(job.code)
            self.running += 1
        try:
            if job.code == "block":
                self.release.wait(30)
            return _ok(job.code)
        finally:
            with self._lock:
                self.running -= 1

    def open_session(self, job: CodeJob, job_id=None, host=None, cancel=None, output=None):
        session = FakeSession(self, len(self.sessions) + 1)
        self.sessions.append(session)
        return session, StepOutcome(_ok(job.code), 1, False)

    def drain(self, grace_s: float) -> None:
        pass

    def close(self) -> None:
        pass


@dataclass
class Answers:
    """The resolver stub: what NAME resolves to now, or the error it raises."""

    ips: list[str] = field(default_factory=list)
    error: OSError | None = None
    asked: int = 0

    def __call__(self, host: str, port: int) -> list[str]:
        assert host == NAME
        self.asked += 1
        if self.error is not None:
            raise self.error
        return list(self.ips)


@dataclass
class Fleet:
    port: int
    answers: Answers
    placement: Placement
    metrics: Metrics
    workers: dict[str, FakeWorker]  # by IP
    servers: list[WorkerServer]

    def add_worker(self, ip: str) -> FakeWorker:
        fake = FakeWorker(f"w-{ip}")
        self.servers.append(serve(fake, f"{ip}:{self.port}", name=fake.name))  # type: ignore[arg-type]
        self.workers[ip] = fake
        return fake

    def members(self) -> dict[str, tuple[bool, bool]]:
        """(healthy, retired) by address, as the placement holds them."""
        with self.placement._roster.lock:
            return {m.client.address: (m.healthy, m.retired) for m in self.placement._roster.members}

    def jobs(self) -> dict[str, int]:
        return {ip: len(fake.jobs) for ip, fake in self.workers.items()}

    def count(self, name: str, **labels: str) -> float:
        value = self.metrics.registry.get_sample_value(name, labels)
        return 0.0 if value is None else value


@pytest.fixture
def fleet() -> Iterator[Callable[..., Fleet]]:
    made: list[Fleet] = []

    def make(ips: list[str], *, serving: list[str] | None = None) -> Fleet:
        """Fake workers on ``serving`` (default: every one of ``ips``); the answer is ``ips``."""
        port = free_port()
        answers = Answers(list(ips))
        metrics = Metrics()
        placement = Placement(
            [], probe_interval_s=NEVER_S, dns_interval_s=NEVER_S, wait_s=WAIT_S,
            discovery=Discovery([DnsName(NAME, port)], answers), metrics=metrics,
        )
        built = Fleet(port, answers, placement, metrics, {}, [])
        made.append(built)
        for ip in ips if serving is None else serving:
            built.add_worker(ip)
        placement.start()
        metrics.watch_router(placement.discovered_workers)
        return built

    yield make
    for built in made:
        for fake in built.workers.values():
            fake.release.set()
        built.placement.close()
        for server in built.servers:
            server.server.stop(0).wait()


def in_thread(target: Callable[[], object]) -> tuple[threading.Thread, list[object]]:
    outcome: list[object] = []
    thread = threading.Thread(target=lambda: outcome.append(target()), daemon=True)
    thread.start()
    return thread, outcome


def job(code: str) -> CodeJob:
    return CodeJob("base", code, timeout_ms=20_000)


# --------------------------------------------------------------------------- members from the answer


def test_every_address_of_the_answer_is_probed_then_gets_jobs(fleet):
    f = fleet(["127.0.0.2", "127.0.0.3"])
    assert f.members() == {f"127.0.0.2:{f.port}": (True, False), f"127.0.0.3:{f.port}": (True, False)}
    blocked = [in_thread(lambda: f.placement.run_job(job("block"))) for _ in range(4)]
    assert wait_until(lambda: sum(w.running for w in f.workers.values()) == 4, WAIT_S)
    assert f.jobs() == {"127.0.0.2": 2, "127.0.0.3": 2}  # two slots each: both took their share
    for fake in f.workers.values():
        fake.release.set()
    for thread, outcome in blocked:
        thread.join(WAIT_S)
        assert outcome[0].stdout == "block"
    # Start: no static worker to probe, one round of DNS with two fresh members, each probed once.
    assert f.count("readie_router_probes_total", outcome="ok") == 2
    assert f.count("readie_router_probes_total", outcome="failed") == 0
    assert f.count("readie_router_discovered_workers") == 2
    assert f.placement.capacity().slots == 4


def test_an_address_that_does_not_answer_its_probe_gets_no_work(fleet):
    f = fleet(["127.0.0.2", "127.0.0.3"], serving=["127.0.0.2"])
    assert f.members()[f"127.0.0.3:{f.port}"] == (False, False)
    for _ in range(3):
        assert f.placement.run_job(job("x")).stdout == "x"
    assert f.jobs() == {"127.0.0.2": 3}
    assert f.count("readie_router_probes_total", outcome="failed") == 1
    assert f.count("readie_router_evictions_total", reason="probes") == 0  # never admitted: nothing to evict


def test_an_address_that_leaves_gets_no_new_jobs_while_its_running_job_finishes(fleet):
    f = fleet(["127.0.0.2", "127.0.0.3"])
    running, outcome = in_thread(lambda: f.placement.run_job(job("block")))
    assert wait_until(lambda: any(w.running for w in f.workers.values()), WAIT_S)
    hosting = next(ip for ip, w in f.workers.items() if w.running)
    other = next(ip for ip in f.workers if ip != hosting)
    f.answers.ips = [other]
    with structlog.testing.capture_logs() as logs:
        f.placement.discover()
    assert f.members()[f"{hosting}:{f.port}"] == (True, True)
    assert [line["event"] for line in logs if "retired" in line["event"]] == ["worker retired: its address left the DNS answer"]
    for _ in range(4):
        assert f.placement.run_job(job("x")).stdout == "x"
    assert f.jobs() == {hosting: 1, other: 4}
    assert running.is_alive(), "the job on the retired worker was still running all along"
    assert f.placement.capacity().slots == 2  # the retired worker's slots are not offered any more
    f.workers[hosting].release.set()
    running.join(WAIT_S)
    assert outcome[0].stdout == "block" and outcome[0].error is None
    # Its last call done, the member is dropped.
    assert f.members() == {f"{other}:{f.port}": (True, False)}
    assert f.count("readie_router_evictions_total", reason="retired") == 1
    assert f.count("readie_router_discovered_workers") == 1


def test_a_session_on_a_retired_worker_keeps_it_until_it_ends(fleet):
    f = fleet(["127.0.0.2", "127.0.0.3"])
    session, first = f.placement.open_session(job("x = 1"))
    hosting = next(ip for ip, w in f.workers.items() if w.sessions)
    other = next(ip for ip in f.workers if ip != hosting)
    f.answers.ips = [other]
    f.placement.discover()
    assert f.members()[f"{hosting}:{f.port}"] == (True, True)
    for n in range(3):
        assert session.run_step(Step(f"step {n}")).outcome.stdout == f"step {n}"
    assert f.workers[hosting].sessions[0].steps == 3
    fresh, _ = f.placement.open_session(job("y = 1"))
    assert fresh.id.startswith(f"w-{other}")  # new sessions go elsewhere
    session.close()
    fresh.close()
    assert set(f.members()) == {f"{other}:{f.port}"}


def test_an_address_back_before_its_member_is_dropped_is_unretired(fleet):
    f = fleet(["127.0.0.2", "127.0.0.3"])
    session, _ = f.placement.open_session(job("x = 1"))
    hosting = next(ip for ip, w in f.workers.items() if w.sessions)
    f.answers.ips = [ip for ip in f.workers if ip != hosting]
    f.placement.discover()
    f.answers.ips = ["127.0.0.2", "127.0.0.3"]
    f.placement.discover()
    assert f.members()[f"{hosting}:{f.port}"] == (True, False)
    assert f.count("readie_router_discovered_workers") == 2
    session.close()
    assert len(f.members()) == 2


def test_an_address_added_later_is_probed_and_gets_jobs(fleet):
    f = fleet(["127.0.0.2"])
    f.add_worker("127.0.0.3")
    f.answers.ips = ["127.0.0.2", "127.0.0.3"]
    f.placement.discover()
    assert f.members()[f"127.0.0.3:{f.port}"] == (True, False)
    blocked = [in_thread(lambda: f.placement.run_job(job("block"))) for _ in range(4)]
    assert wait_until(lambda: sum(w.running for w in f.workers.values()) == 4, WAIT_S)
    assert f.jobs() == {"127.0.0.2": 2, "127.0.0.3": 2}
    for fake in f.workers.values():
        fake.release.set()
    for thread, _ in blocked:
        thread.join(WAIT_S)
    assert f.count("readie_router_probes_total", outcome="ok") == 2  # one at start, one when it was found


def test_an_address_also_named_by_worker_is_one_member(fleet):
    port = free_port()
    fake = FakeWorker("static")
    server = serve(fake, f"127.0.0.2:{port}", name=fake.name)  # type: ignore[arg-type]
    answers = Answers(["127.0.0.2"])
    placement = Placement([f"127.0.0.2:{port}"], probe_interval_s=NEVER_S, dns_interval_s=NEVER_S,
                          discovery=Discovery([DnsName(NAME, port)], answers)).start()
    try:
        assert [m.client.address for m in placement._roster.members] == [f"127.0.0.2:{port}"]
        answers.ips = []
        placement.discover()  # a static member is never retired
        assert placement.run_job(job("x")).stdout == "x"
        assert placement.discovered_workers() == 0
    finally:
        placement.close()
        server.server.stop(0).wait()


def test_an_empty_answer_retires_every_member_and_new_work_is_refused_at_once(fleet):
    f = fleet(["127.0.0.2"])
    f.answers.ips = []  # an answer with no address (a stub may give one; getaddrinfo raises instead)
    f.placement.discover()
    assert f.members() == {}  # idle, so dropped at once
    with pytest.raises(SandboxSetupError, match="no healthy worker"):
        f.placement.open_session(job("x"))
    with pytest.raises(SandboxSetupError, match="no healthy worker"):
        f.placement.run_job(job("x"))
    assert f.placement.capacity().problem == "no healthy worker (of 0)"


# --------------------------------------------------------------------------- failures and bounds


def test_a_failed_lookup_keeps_the_last_answer_and_is_logged_once_per_change(fleet):
    f = fleet(["127.0.0.2", "127.0.0.3"])
    before = f.members()
    with structlog.testing.capture_logs() as logs:
        f.answers.error = socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        for _ in range(5):
            f.placement.discover()
        f.answers.error = socket.gaierror(socket.EAI_NONAME, "Name or service not known")
        for _ in range(5):
            f.placement.discover()
        f.answers.error = None
        for _ in range(3):
            f.placement.discover()
    assert f.members() == before, "a lookup that failed retired nobody"
    assert f.placement.run_job(job("x")).stdout == "x"
    events = [(line["event"], line.get("error")) for line in logs if line["log_level"] in ("warning", "info")]
    assert events == [
        ("worker name does not resolve; keeping its last answer", "[Errno -3] Temporary failure in name resolution"),
        ("worker name does not resolve; keeping its last answer", "[Errno -2] Name or service not known"),
        ("worker name resolves again", None),
    ], events
    assert f.answers.asked == 1 + 13
    assert f.count("readie_router_evictions_total", reason="retired") == 0


def test_the_answer_is_bounded_and_only_ip_literals_are_taken():
    answers = [f"10.0.{i // 250}.{i % 250 + 1}" for i in range(MAX_DISCOVERED_WORKERS + 40)]
    discovery = Discovery([DnsName(NAME, 50061)], lambda host, port: ["not an address", "::1", *reversed(answers)])
    with structlog.testing.capture_logs() as logs:
        first = discovery.resolve()
        again = discovery.resolve()
    assert len(first) == MAX_DISCOVERED_WORKERS and first == again
    assert first[:2] == ["10.0.0.1:50061", "10.0.0.2:50061"]  # numeric order, IPv4 first: a stable cut
    assert "[::1]:50061" not in first and not any("not an address" in a for a in first)
    cut = [line for line in logs if line["event"].startswith("more workers than one router keeps")]
    assert len(cut) == 1, "logged when the cut starts, not every round"
    ignored = [line for line in logs if line["event"].startswith("ignoring an answer")]
    assert ignored and ignored[0]["answer"] == "'not an address'"


def test_ipv6_answers_are_bracketed():
    discovery = Discovery([DnsName(NAME, 50061)], lambda host, port: ["fd00::1", "127.0.0.2", "fd00::1"])
    assert discovery.resolve() == ["127.0.0.2:50061", "[fd00::1]:50061"]


@pytest.mark.parametrize(
    "text, expected",
    [
        ("readie-workers.readie.svc.cluster.local:50061", DnsName("readie-workers.readie.svc.cluster.local", 50061)),
        ("localhost:1", DnsName("localhost", 1)),
    ],
)
def test_worker_dns_takes_name_colon_port(text, expected):
    assert dns_name(text) == expected and str(expected) == text


@pytest.mark.parametrize("text", ["workers", "workers:", ":50061", "workers:0", "workers:65536", "workers:5o061",
                                  "work ers:50061", "[::1]:50061", "x" * 254 + ":1", "wörkers:50061"])
def test_worker_dns_refuses_anything_else(text):
    with pytest.raises(argparse.ArgumentTypeError):
        dns_name(text)


def test_the_router_cli_takes_worker_dns_repeated_and_beside_worker():
    from readie_router.cli import build_parser

    args = build_parser().parse_args(
        ["--worker=10.0.0.1:50061", "--worker-dns=a.example:50061", "--worker-dns=b.example:50062", "--dns-interval=2s"]
    )
    assert args.worker == ["10.0.0.1:50061"]
    assert args.worker_dns == [DnsName("a.example", 50061), DnsName("b.example", 50062)]
    assert args.dns_interval == 2.0
    assert build_parser().parse_args([]).dns_interval == 5.0
    for refused in (["--dns-interval=0"], ["--worker-dns=a.example"]):
        with pytest.raises(SystemExit):
            build_parser().parse_args(refused)
