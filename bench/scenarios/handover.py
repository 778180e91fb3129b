"""Scenario 16: a draining worker hands its sessions on (issue 30, decision 32).

Two ``readie worker`` processes on loopback share a session store (a
directory and a 0600 key file: ``--session-store``, ``--session-store-key``),
as behind a router. Sessions are opened and stepped through
:class:`~readie_rpc.client.WorkerClient`, the client a router uses, so no
router hop is in the figures (scenario 8 has that hop). Each round:

* **drain**: ``sessions`` sessions, each holding a notebook's state (for
  pandas, a DataFrame of ``STATE_ROWS`` rows; a smoke run takes the base
  checkpoint and a list as long), are opened on worker A; once
  quiet, A gets SIGTERM and the store is polled: ``drain_to_stored_ms`` is
  from the signal until the last of them is in the store,
  ``drain_to_exit_ms`` until the process has exited. A is then started again
  on the same address and state dir, as a supervisor would.
* **first step vs live step**: each handed-over session is attached on
  worker B by its key (``attach_ms``) and stepped (``first_step_ms``, wall
  time, and the ``resumed_ms`` of it), taking turns (the first arm
  alternates, each settled) with the same one-line step of a session that
  has lived on B all along (``live_step_ms``). ``first_over_live`` is what a
  hand-over costs the step after it; ``handover_step_ms`` adds the attach,
  which a router does on that step's behalf.

The attached sessions are closed at the end of their round (removing their
images), the live one and both workers at the end; the entry says whether a
store entry or a runsc container was left.
"""

from __future__ import annotations

import os
import secrets
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from readie_rpc.client import WorkerClient
from readie_rpc.testing import EXIT_TIMEOUT_S, WorkerProcess, start_worker, stop_worker
from readie_worker.errors import ReadieError
from readie_worker.jobs import CodeJob, Step
from readie_worker.session_store import entry_name
from readie_worker.testing import wait_until

from .._bench import WARM_FILL_TIMEOUT_S, Bench
from .._stats import paired_ratio, ratio, summary
from .hibernate import PANDAS_SETUP, STATE_ROWS

# The store's key: what `secrets` gives a key file (decision 32: 32 random bytes).
KEY_BYTES = 32
# A smoke run's state on the base checkpoint: as many rows, as a list (the step reads len(df) alike).
LIST_SETUP = f"df = list(range({STATE_ROWS}))\nn = 0\nprint('set')\n"
# The same one-line step on both arms: the figure is the session's cost, not the code's.
STEP = "n += 1\nprint(n, len(df))\n"
# The store is polled this often between SIGTERM and the drain's end: well under a hibernation.
STORE_POLL_S = 0.005
# Both workers' sessions at once: A's, plus B's live one and the ones it attached.
MAX_SESSIONS = 16


@dataclass
class _Samples:
    drain_to_stored_ms: list[float] = field(default_factory=list)
    drain_to_exit_ms: list[float] = field(default_factory=list)
    attach_ms: list[float] = field(default_factory=list)
    first_step_ms: list[float] = field(default_factory=list)
    resumed_ms: list[float] = field(default_factory=list)
    handover_step_ms: list[float] = field(default_factory=list)
    live_step_ms: list[float] = field(default_factory=list)
    pairs: list[tuple[float, float]] = field(default_factory=list)  # (first step, live step), back to back
    errors: list[str] = field(default_factory=list)


@dataclass
class _Live:
    """The session that lives on B all along, and the counter its steps advance."""

    session: Any = None
    count: int = 0


class _Cluster:
    """Workers A and B sharing one store; A is the one that drains."""

    def __init__(self, bench: Bench, name: str, sessions: int) -> None:
        self.base = bench.scratch / "handover"
        self.store = self.base / "store"
        self.store.mkdir(parents=True, mode=0o700)
        key = self.base / "store.key"
        fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as file:
            file.write(secrets.token_urlsafe(KEY_BYTES))
        self.manifest = bench.manifest_path
        self.name = name
        self.setup = PANDAS_SETUP if "pandas" in bench.checkpoint(name).preimport else LIST_SETUP
        self.args = [f"--session-store={self.store}", f"--session-store-key={key}", f"--max-sessions={MAX_SESSIONS}"]
        self.warm = {"a": f"{name}={sessions}", "b": f"{name}=1"}
        self.workers: dict[str, WorkerProcess] = {}
        self.clients: dict[str, WorkerClient] = {}
        with ThreadPoolExecutor(2) as threads:  # each start waits for its health: side by side
            list(threads.map(self.start, ("a", "b")))

    def start(self, role: str, port: int | None = None) -> None:
        worker = start_worker(
            self.base / role, f"handover-{role}", self.manifest, warm=self.warm[role], args=self.args, port=port
        )
        self.workers[role], self.clients[role] = worker, WorkerClient(f"127.0.0.1:{worker.port}")

    def wait_warm(self, role: str) -> None:
        """The role's warm sandboxes all restored: sessions open on them, not on a restore."""
        def full() -> bool:
            warm = self.clients[role].capacity()[0].warm.get(self.name, {})
            return bool(warm) and warm["ready"] >= warm["target"]

        if not wait_until(full, WARM_FILL_TIMEOUT_S, poll_s=0.1):
            raise ReadieError(f"worker {role}'s warm pool did not fill in {WARM_FILL_TIMEOUT_S:.0f} s")

    def restart(self, role: str) -> None:
        old = self.workers[role]
        self.clients[role].close()
        old.channel.close()
        self.start(role, port=old.port)

    def close(self) -> Any:
        for client in self.clients.values():
            client.close()
        problems = [f"{role} exited {status}" for role, w in self.workers.items() if (status := stop_worker(w)) != 0]
        left = {role: w.containers() for role, w in self.workers.items() if w.containers()}
        return problems or left or 0


def stored(store: Path, keys: list[str]) -> int:
    """How many of the sessions with ``keys`` the store holds an image of, seen from outside the
    workers: entries with a complete generation (``g<N>``, renamed into place once written)."""
    count = 0
    for key in keys:
        try:
            count += any(name[:1] == "g" and name[1:].isdigit() for name in os.listdir(store / entry_name(key)))
        except OSError:
            continue  # no entry yet
    return count


def store_leftovers(store: Path) -> int:
    """Files and directories the store holds besides its lock file."""
    return sum(1 for path in store.rglob("*") if path.name != ".lock")


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    # pandas: the session; the smoke run proves the code path on the smallest image.
    name = bench.names[0] if bench.settings.smoke_scope else bench.names[-1]
    sessions = bench.settings.handover_sessions
    samples = _Samples()
    cluster = _Cluster(bench, name, sessions)
    live = _Live()
    try:
        cluster.wait_warm("b")
        live.session, first = cluster.clients["b"].open_session(CodeJob(checkpoint=name, code=cluster.setup))
        if first.outcome.error is not None:
            raise ReadieError(f"the live session did not open: {first.outcome.error.message}")
        rounds = bench.settings.handover_rounds
        for round_index in range(rounds):
            try:
                _round(bench, cluster, live, sessions, round_index, samples, last=round_index == rounds - 1)
            except ReadieError as exc:  # one failed round costs its samples, not the scenario
                samples.errors.append(f"round {round_index}: {type(exc).__name__}: {exc}")
    finally:
        if live.session is not None:
            live.session.close()
        left_in_store = store_leftovers(cluster.store)
        left = cluster.close()
    return {"handover": {
        "what": f"{sessions} idle {name} sessions ({STATE_ROWS:,} rows of state each) on a readie worker "
        "that gets SIGTERM: until the last is in the shared store, and each one's first step after attaching "
        "on the other worker vs a step of a session live there, taking turns; WorkerClient, no router",
        "checkpoint": name,
        "sessions_per_drain": sessions,
        "drain_to_stored_ms": summary(samples.drain_to_stored_ms),
        "drain_to_exit_ms": summary(samples.drain_to_exit_ms),
        "attach_ms": summary(samples.attach_ms),
        "first_step_ms": summary(samples.first_step_ms),  # the step after the attach, restore included
        "resumed_ms": summary(samples.resumed_ms),  # of it, the restore (StepOutcome.resumed_ms)
        "handover_step_ms": summary(samples.handover_step_ms),  # attach + first step: what a routed client waits
        "live_step_ms": summary(samples.live_step_ms),
        "first_over_live": ratio(summary(samples.first_step_ms), summary(samples.live_step_ms)),
        "first_over_live_paired": paired_ratio(samples.pairs),
        "store_entries_left": left_in_store,
        "workers_left": left,
        "errors": samples.errors[:5],
    }}


def _round(
    bench: Bench, cluster: _Cluster, live: _Live, sessions: int, round_index: int, samples: _Samples, *, last: bool
) -> None:
    cluster.wait_warm("a")
    keys, opened = [], []  # the handles stay referenced until the drain: a dropped stream would detach
    for index in range(sessions):
        session, first = cluster.clients["a"].open_session(CodeJob(checkpoint=cluster.name, code=cluster.setup))
        opened.append(session)
        if first.outcome.error is not None or session.key is None:
            raise ReadieError(f"session {index} on A: {first.outcome.error or 'no key'}")
        keys.append(session.key)
    if stored(cluster.store, keys) != 0:
        raise ReadieError(f"{stored(cluster.store, keys)} sessions in the store before the drain (expected none)")
    bench.settle()
    worker = cluster.workers["a"]
    signalled = time.monotonic()
    worker.process.send_signal(signal.SIGTERM)
    stored_at = None
    while worker.process.poll() is None or stored_at is None:
        if stored_at is None and stored(cluster.store, keys) == sessions:
            stored_at = time.monotonic()
        if worker.process.poll() is not None and stored_at is None:
            raise ReadieError(f"A exited {worker.process.returncode} with {stored(cluster.store, keys)} of "
                              f"{sessions} sessions in the store")
        if time.monotonic() - signalled > EXIT_TIMEOUT_S:
            raise ReadieError(f"A did not drain within {EXIT_TIMEOUT_S:.0f} s")
        time.sleep(STORE_POLL_S)
    exited_at = time.monotonic()  # within a poll of the exit
    opened.clear()  # handed over: their streams ended with A's drain
    samples.drain_to_stored_ms.append((stored_at - signalled) * 1000)
    samples.drain_to_exit_ms.append((exited_at - signalled) * 1000)
    if not last:  # as a supervisor would; after the last round nothing needs A
        cluster.restart("a")

    attached = []
    try:
        for index, key in enumerate(keys):
            bench.settle()
            started = time.monotonic()
            session, _ = cluster.clients["b"].attach_session(key)
            attach_ms = (time.monotonic() - started) * 1000
            attached.append(session)
            order = ("live", "first") if (round_index + index) % 2 == 0 else ("first", "live")
            timed: dict[str, float] = {}
            for arm in order:
                bench.settle()
                if arm == "live":
                    live.count += 1
                target, expected = (live.session, live.count) if arm == "live" else (session, 1)
                started = time.monotonic()
                step = target.run_step(Step(STEP))
                timed[arm] = (time.monotonic() - started) * 1000
                problem = _problem(step.outcome, expected)
                if arm == "first" and problem is None and step.resumed_ms is None:
                    problem = "the first step after the hand-over did not resume"
                if problem is not None:
                    raise ReadieError(f"{arm} step: {problem}")
                if arm == "first":
                    samples.resumed_ms.append(step.resumed_ms)
            samples.attach_ms.append(attach_ms)
            samples.first_step_ms.append(timed["first"])
            samples.handover_step_ms.append(attach_ms + timed["first"])
            samples.live_step_ms.append(timed["live"])
            samples.pairs.append((timed["first"], timed["live"]))
    finally:
        for session in attached:
            session.close()


def _problem(outcome: Any, count: int) -> str | None:
    """Why a step's answer is not the counter and the frame intact; None when it is."""
    if outcome.error is not None:
        return f"{outcome.error.type}: {outcome.error.message}"
    if outcome.exit != 0 or outcome.stdout != f"{count} {STATE_ROWS}\n":
        return f"exit {outcome.exit!r}, stdout {outcome.stdout!r} != {count} {STATE_ROWS}"
    return None
