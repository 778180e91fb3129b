"""The soak: many jobs and concurrent sessions through one ``readie pool``, and what it leaves.

While the load runs, :func:`soak` samples, at even steps of the jobs done,
what a leak would grow: each watched process's descriptors, threads and
RSS, the runsc containers in the state dirs, the sandbox dirs on disk, the
memory cgroups runsc made (``/sys/fs/cgroup/*/rd-*``) and the network
namespaces. Two samples are taken at rest, when no request is in flight and
the warm pools are full again: after a warm-up (a tenth of the jobs, and a
round of sessions), and at the end. The leak test compares those two
against its allowances; the bench prints every sample as the curve.

The load is ``clients`` closed-loop job clients (``print(i)``, output
checked) and ``sessions`` session clients that each open a session, run
:data:`STEPS_PER_SESSION` steps (the state checked), close it and open the
next, :data:`SESSION_ROUNDS` times (or until the jobs are done): what a
session's lifecycle leaks shows up too.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from readie_protocol.requests import CloseSession, Request, build_job
from readie_protocol.wire import RequestId

from ._pool_client import PoolClient

CGROUP_ROOT = Path("/sys/fs/cgroup")
NETNS_DIR = Path("/run/netns")
REQUEST_TIMEOUT_S = 120.0  # a loaded 2-core machine restores slowly; a hang is still caught
# At rest: in-flight work done and the warm pools refilled. Refills restore one
# sandbox at a time; on a busy machine that is seconds each.
REST_TIMEOUT_S = 120.0
# Steps per session before it is closed and the next opened, and sessions each session client
# opens in the run: a session costs a restore, as a job does, so session clients cycling without
# end took most restores from the jobs (942 sessions beside 1,000 jobs, measured); this keeps
# them all open at once early on and a few hundred restores beside the jobs'.
STEPS_PER_SESSION = 10
SESSION_ROUNDS = 3


@dataclass(frozen=True)
class Usage:
    fds: int
    threads: int
    rss_kib: int


@dataclass(frozen=True)
class Sample:
    jobs_done: int
    sessions_done: int
    elapsed_s: float
    processes: Mapping[str, Usage]  # by the name the caller gave each pid
    containers: int
    sandbox_dirs: int
    cgroups: int
    empty_cgroups: int
    netns: int

    def to_json(self) -> dict[str, Any]:
        return {
            "jobs_done": self.jobs_done,
            "sessions_done": self.sessions_done,
            "elapsed_s": round(self.elapsed_s, 2),
            "processes": {name: vars(usage) for name, usage in self.processes.items()},
            "containers": self.containers,
            "sandbox_dirs": self.sandbox_dirs,
            "cgroups": self.cgroups,
            "empty_cgroups": self.empty_cgroups,
            "netns": self.netns,
        }


@dataclass
class Watched:
    """What to sample: processes by name, and where their sandboxes live."""

    pids: Mapping[str, int]
    containers: Callable[[], int]  # runsc containers in the state dirs
    run_dirs: tuple[Path, ...]  # each holds one directory per sandbox
    warm: int  # containers at rest: the warm pools' targets


@dataclass
class SoakResult:
    rest_before: Sample
    rest_after: Sample
    curve: list[Sample] = field(default_factory=list)
    jobs: int = 0
    sessions: int = 0
    failures: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {
            "jobs": self.jobs,
            "sessions": self.sessions,
            "failures": self.failures[:20],
            "rest_before": self.rest_before.to_json(),
            "rest_after": self.rest_after.to_json(),
            "curve": [sample.to_json() for sample in self.curve],
        }


def usage(pid: int) -> Usage:
    fds = len(os.listdir(f"/proc/{pid}/fd"))
    status = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines() if ":" in line
    )
    return Usage(fds, int(status["Threads"]), int(status["VmRSS"].split()[0]))


def sandbox_cgroups() -> int:
    """runsc's cgroups for readie's sandboxes (named after the container, ``rd-...``), in every controller."""
    return sum(1 for _ in CGROUP_ROOT.glob("*/rd-*"))


def empty_sandbox_cgroups() -> frozenset[str]:
    """The sandboxes whose cgroups hold no process, by name: a live sandbox's hold its sentry and
    gofer, so at rest an empty one was left behind (or is being torn down: another process's)."""
    empty = set()
    for path in CGROUP_ROOT.glob("*/rd-*"):
        try:
            if not (path / "cgroup.procs").read_text().strip():
                empty.add(path.name)
        except OSError:
            pass  # removed between the listing and the read
    return frozenset(empty)


def netns_entries() -> int:
    return len(os.listdir(NETNS_DIR)) if NETNS_DIR.is_dir() else 0


def sample(watched: Watched, jobs_done: int, sessions_done: int, started: float) -> Sample:
    return Sample(
        jobs_done,
        sessions_done,
        time.monotonic() - started,
        {name: usage(pid) for name, pid in watched.pids.items()},
        watched.containers(),
        sum(len(os.listdir(run)) for run in watched.run_dirs if run.is_dir()),
        sandbox_cgroups(),
        len(empty_sandbox_cgroups()),
        netns_entries(),
    )


def at_rest(watched: Watched, jobs_done: int, sessions_done: int, started: float) -> Sample:
    """A sample once the warm pools are full and no sandbox beyond them is left (or the timeout)."""
    deadline = time.monotonic() + REST_TIMEOUT_S
    while True:
        taken = sample(watched, jobs_done, sessions_done, started)
        settled = taken.containers == watched.warm and taken.sandbox_dirs == watched.warm
        if settled or time.monotonic() > deadline:
            return taken
        time.sleep(0.2)


class _Load:
    """The job and session clients: threads sharing a job counter."""

    def __init__(self, pool: PoolClient, jobs: int, on_progress: Callable[[int, int], None]) -> None:
        self.pool = pool
        self.jobs = jobs
        self._next = itertools.count()
        self._lock = threading.Lock()
        self.jobs_done = 0
        self.sessions_done = 0
        self.failures: list[str] = []
        self._on_progress = on_progress
        self._stop = threading.Event()

    def job_client(self) -> None:
        while not self._stop.is_set():
            i = next(self._next)
            if i >= self.jobs:
                self._stop.set()  # the session clients finish their session and stop
                return
            result = self._request(lambda rid: build_job(rid, {"code": f"print({i})"}))
            if result is not None and result.get("stdout") != f"{i}\n":
                self._fail(f"job {i}: {_brief(result)}")
            with self._lock:
                self.jobs_done += 1
                done = self.jobs_done
            self._on_progress(done, self.sessions_done)

    def session_client(self, k: int, rounds: int) -> None:
        for cycle in range(rounds):
            if self._stop.is_set():
                return
            name = f"soak-{k}-{cycle}"
            steps = [("x = 0", None), *(("x += 1\nprint(x)", f"{n}\n") for n in range(1, STEPS_PER_SESSION + 1))]
            for code, expected in steps:
                result = self._request(lambda rid: build_job(rid, {"session": name, "code": code}))
                if result is None:
                    break
                if expected is not None and result.get("stdout") != expected:
                    self._fail(f"session {name}: {_brief(result)}")
            self._request(lambda rid: CloseSession(rid, name))
            with self._lock:
                self.sessions_done += 1

    def _request(self, make: Callable[[RequestId], Request]) -> dict[str, Any] | None:
        try:
            return self.pool.request(make, REQUEST_TIMEOUT_S)[0]
        except Exception as exc:  # counted, and the soak goes on: the leak check still runs
            self._fail(f"{make('?')}: {type(exc).__name__}: {exc}")
            return None

    def _fail(self, what: str) -> None:
        with self._lock:
            self.failures.append(what[:300])


def soak(
    pool: PoolClient,
    watched: Watched,
    *,
    jobs: int,
    sessions: int,
    clients: int,
    session_rounds: int = SESSION_ROUNDS,
    samples: int = 20,
    progress: Callable[[Sample], None] | None = None,
) -> SoakResult:
    """Run the load (see the module docstring); return the two samples at rest and the curve."""
    started = time.monotonic()
    warmup = _Load(pool, max(1, jobs // 10), lambda done, _: None)
    _run_threads([warmup.job_client] * clients + [lambda k=k: warmup.session_client(k, 1) for k in range(sessions)])
    before = at_rest(watched, 0, 0, started)
    curve: list[Sample] = [before]
    step = max(1, jobs // samples)
    marks = threading.Lock()
    next_mark = [step]

    def on_progress(done: int, sessions_done: int) -> None:
        with marks:
            if done < next_mark[0]:
                return
            next_mark[0] += step
        taken = sample(watched, done, sessions_done, started)
        curve.append(taken)
        if progress is not None:
            progress(taken)

    load = _Load(pool, jobs, on_progress)
    _run_threads([load.job_client] * clients + [lambda k=k: load.session_client(k, session_rounds) for k in range(sessions)])
    after = at_rest(watched, load.jobs_done, load.sessions_done, started)
    curve.append(after)
    return SoakResult(
        before, after, curve, load.jobs_done, load.sessions_done, warmup.failures + load.failures
    )


def _run_threads(targets: Iterable[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=target, daemon=True) for target in targets]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()


def _brief(result: dict[str, Any]) -> str:
    return str({key: result.get(key) for key in ("exit", "stdout", "error")})[:200]
