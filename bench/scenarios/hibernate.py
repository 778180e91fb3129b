"""Scenario 13: a session hibernating to disk, resuming, and forking (issue 18, decision 0022).

An in-process worker of its own (one warm sandbox per checkpoint, so a fresh
session takes a warm one, as through ``readie pool``) keeps one long-lived
session per checkpoint with a notebook's state in it (for pandas, a
DataFrame of ``STATE_ROWS`` rows). Each round, per checkpoint, settled and
with the warm pool full before each timed arm:

* **hibernate**: the live session's PSS and the worker's, then
  ``session.hibernate()`` (its ms), the image's bytes (``capacity()``, the
  only image at that moment) and blocks on disk, and the worker's PSS again
  (what hibernating freed);
* **resume** and **fresh**, in a shuffled order: the hibernated session's
  next step (wall time, and the ``resumed_ms`` of it) vs a new session's
  first step on a warm sandbox (``open_session``), the same one-line step:
  ``resume_over_fresh`` is what coming back from disk costs against
  starting with nothing; a third arm in the same shuffle is a bare restore
  of the checkpoint itself (what a warm pool pays ahead of that fresh
  session, scenario 1's figure): ``resumed_over_restore`` compares the two
  restores;
* **fork**: ``fork_session`` of the live session (a hibernation plus hard
  links), the fork's first step (it resumes from the shared image), then a
  second fork of the now hibernated session (the links alone).

Checkpoint order rotates between rounds. The sessions and the worker are
closed at the end, and the entry says whether any container was left.
"""

from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from typing import Any

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ReadieError
from readie_worker.jobs import CodeJob, Step
from readie_worker.sessions import SandboxSession

from .._bench import WARM_FILL_TIMEOUT_S, Bench
from .._procs import memory_kb, processes, sandbox_pids
from .._stats import paired_ratio, ratio, summary
from .latency import measure_restore

# Fixed, so two runs shuffle their arms the same way.
RANDOM_SEED = 20261202
ARMS = ("resume", "fresh", "restore")
MB = 1024 * 1024
# A notebook's worth of data: the "hibernated pandas session" holds a frame, not just imports.
STATE_ROWS = 200_000
PANDAS_SETUP = f"import pandas as pd\ndf = pd.DataFrame({{'n': range({STATE_ROWS})}})\nn = 0\nprint('set')\n"
BASE_SETUP = "n = 0\nprint('set')\n"
# The step both arms time: one line, so the figure is the session's cost, not the code's.
FRESH_STEP = "n = 1\nprint(n)\n"
# A hibernated sandbox's processes end with its destroy; the reaper may take a moment more.
GONE_TIMEOUT_S = 5.0
GONE_POLL_S = 0.02
# Sessions open at once: per checkpoint the kept one, a fresh one and two forks.
MAX_SESSIONS = 8


@dataclass
class _Kept:
    """The long-lived session of one checkpoint, and the counter its steps advance."""

    name: str
    pandas: bool
    session: SandboxSession | None = None
    count: int = 0

    @property
    def step(self) -> Step:
        return Step("n += 1\nprint(n, len(df))\n" if self.pandas else "n += 1\nprint(n)\n")

    def expected(self, count: int) -> str:
        return f"{count} {STATE_ROWS}\n" if self.pandas else f"{count}\n"


@dataclass
class _Samples:
    hibernate_ms: list[float] = field(default_factory=list)
    image_bytes: list[float] = field(default_factory=list)
    image_disk_bytes: list[float] = field(default_factory=list)
    session_pss_kb: list[float] = field(default_factory=list)
    freed_pss_kb: list[float] = field(default_factory=list)
    resume: dict[int, float] = field(default_factory=dict)  # round -> the step's wall ms
    resumed_ms: list[float] = field(default_factory=list)
    fresh: dict[int, float] = field(default_factory=dict)
    restore_ms: list[float] = field(default_factory=list)  # the checkpoint's bare restore, to a ready socket
    fork_ms: list[float] = field(default_factory=list)
    fork_hibernated_ms: list[float] = field(default_factory=list)
    fork_step_ms: list[float] = field(default_factory=list)
    fork_resumed_ms: list[float] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    # Base and pandas: the smallest and the largest image; a smoke run takes pandas alone.
    names = bench.names[-1:] if bench.settings.smoke_scope else list(dict.fromkeys([bench.names[0], bench.names[-1]]))
    config = WorkerConfig.in_temp(
        bench.manifest_path, warm={name: 1 for name in names}, slots=bench.settings.slots, max_sessions=MAX_SESSIONS
    )
    worker = Worker(config).start()
    kept = {name: _Kept(name, "pandas" in bench.checkpoint(name).preimport) for name in names}
    samples = {name: _Samples() for name in names}
    rng = random.Random(RANDOM_SEED)
    left: int | str = "?"
    try:
        for name in names:
            worker.warm[name].wait_until_full(WARM_FILL_TIMEOUT_S)
        for round_index in range(bench.settings.hibernate_rounds):
            shift = round_index % len(names)
            for name in names[shift:] + names[:shift]:
                try:
                    _round(bench, worker, kept[name], samples[name], round_index, rng)
                except ReadieError as exc:  # one failed round costs its samples, not the scenario
                    samples[name].errors.append(f"round {round_index}: {type(exc).__name__}: {exc}")
    finally:
        for one in kept.values():
            if one.session is not None:
                one.session.close()
        worker.close()
        try:
            left = len(worker.runsc.list_ids())
        except (ReadieError, OSError) as exc:
            left = f"cannot list: {exc}"
    return {
        "hibernate": {
            "what": "a session with state (pandas: a DataFrame of "
            f"{STATE_ROWS:,} rows) hibernated to disk, its next step (resume) vs a new session's first step "
            "on a warm sandbox vs a bare restore of the checkpoint, taking turns; fork of the live session "
            "and the fork's first step; Worker API in process",
            "checkpoints": {name: _entry(bench, name, samples[name]) for name in names},
            "containers_left": left,
        }
    }


def _round(bench: Bench, worker: Worker, kept: _Kept, samples: _Samples, round_index: int, rng: random.Random) -> None:
    pool = worker.warm[kept.name]
    session = _live(bench, worker, kept, samples)
    if session is None:
        return
    # Hibernate: memory before and after, the image it left.
    pool.wait_until_full(WARM_FILL_TIMEOUT_S)
    bench.settle()
    sandbox_id = session.sandbox_id
    assert sandbox_id is not None
    marker = f"--root={worker.runsc.root}"
    table = processes()
    session_kb = memory_kb(sandbox_pids(sandbox_id, table))["pss_kb"]
    worker_kb = memory_kb(sandbox_pids(marker, table))["pss_kb"]
    samples.hibernate_ms.append(session.hibernate())
    capacity = worker.capacity()
    if capacity.hibernated == 1:
        samples.image_bytes.append(capacity.hibernated_bytes)
        assert worker.images is not None
        samples.image_disk_bytes.append(_allocated_bytes(worker.images.store.root))  # its only entry
    else:
        samples.errors.append(f"{capacity.hibernated} images on disk, expected 1: bytes not sampled")
    if _wait_gone(sandbox_id):
        samples.session_pss_kb.append(session_kb)
        samples.freed_pss_kb.append(worker_kb - memory_kb(sandbox_pids(marker))["pss_kb"])
    else:
        samples.errors.append(f"sandbox {sandbox_id} still has processes {GONE_TIMEOUT_S} s after hibernating")

    # Resume vs a fresh session's first step, in a shuffled order.
    order = list(ARMS)
    rng.shuffle(order)
    for arm in order:
        pool.wait_until_full(WARM_FILL_TIMEOUT_S)
        bench.settle()
        if arm == "resume":
            kept.count += 1
            started = time.monotonic()
            step = session.run_step(kept.step)
            wall_ms = (time.monotonic() - started) * 1000
            problem = _problem(step.outcome, kept.expected(kept.count))
            if problem is None and step.resumed_ms is None:
                problem = "the step after a hibernation did not resume"
            if problem is not None:
                samples.errors.append(f"resume: {problem}")
                continue
            samples.resume[round_index] = wall_ms
            samples.resumed_ms.append(step.resumed_ms)
        elif arm == "fresh":
            started = time.monotonic()
            fresh, first = worker.open_session(CodeJob(checkpoint=kept.name, code=FRESH_STEP))
            wall_ms = (time.monotonic() - started) * 1000
            fresh.close()
            problem = _problem(first.outcome, "1\n")
            if problem is not None:
                samples.errors.append(f"fresh: {problem}")
                continue
            samples.fresh[round_index] = wall_ms
        elif arm == "restore":
            samples.restore_ms.append(measure_restore(bench, kept.name).ready_ms)
    if session.ended:
        return

    # Fork the live session, step the fork, then fork the (now hibernated) session again.
    pool.wait_until_full(WARM_FILL_TIMEOUT_S)
    bench.settle()
    fork, fork_ms = worker.fork_session(session)
    try:
        samples.fork_ms.append(fork_ms)
        bench.settle()
        started = time.monotonic()
        step = fork.run_step(kept.step)
        wall_ms = (time.monotonic() - started) * 1000
        problem = _problem(step.outcome, kept.expected(kept.count + 1))  # the fork goes on from the parent's state
        if problem is None and step.resumed_ms is not None:
            samples.fork_step_ms.append(wall_ms)
            samples.fork_resumed_ms.append(step.resumed_ms)
        else:
            samples.errors.append(f"fork's first step: {problem or 'did not resume'}")
        bench.settle()
        second, second_ms = worker.fork_session(session)
        second.close()
        samples.fork_hibernated_ms.append(second_ms)
    finally:
        fork.close()
    # The kept session is hibernated now; its next round starts from a live sandbox (untimed).
    kept.count += 1
    step = session.run_step(kept.step)
    problem = _problem(step.outcome, kept.expected(kept.count))
    if problem is not None:
        samples.errors.append(f"kept session after the forks: {problem}")


def _live(bench: Bench, worker: Worker, kept: _Kept, samples: _Samples) -> SandboxSession | None:
    """The kept session, opened again (with its state) if it ended; None if it cannot open."""
    if kept.session is not None and not kept.session.ended:
        return kept.session
    worker.warm[kept.name].wait_until_full(WARM_FILL_TIMEOUT_S)
    bench.settle()
    setup = PANDAS_SETUP if kept.pandas else BASE_SETUP
    session, first = worker.open_session(CodeJob(checkpoint=kept.name, code=setup))
    problem = _problem(first.outcome, "set\n")
    if problem is not None:
        session.close()
        samples.errors.append(f"opening the kept session: {problem}")
        return None
    kept.session, kept.count = session, 0
    return session


def _problem(outcome: Any, expected: str) -> str | None:
    if outcome.error is not None:
        return f"{outcome.error.type}: {outcome.error.message}"
    if outcome.exit != 0 or outcome.stdout != expected:
        return f"exit {outcome.exit!r}, stdout {outcome.stdout!r} != {expected!r}"
    return None


def _wait_gone(sandbox_id: str) -> bool:
    deadline = time.monotonic() + GONE_TIMEOUT_S
    while sandbox_pids(sandbox_id):
        if time.monotonic() > deadline:
            return False
        time.sleep(GONE_POLL_S)
    return True


def _allocated_bytes(root: Any) -> int:
    """Blocks the images take on disk (``du``), beside their apparent size: runsc may write sparse files."""
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_blocks * 512
            except OSError:
                continue
    return total


def _entry(bench: Bench, name: str, s: _Samples) -> dict[str, Any]:
    resume, fresh = summary(list(s.resume.values())), summary(list(s.fresh.values()))
    resumed, restore = summary(s.resumed_ms), summary(s.restore_ms)
    both = s.resume.keys() & s.fresh.keys()
    return {
        "checkpoint_image_mb": round(bench.checkpoint(name).size_bytes / MB, 1),
        "hibernate_ms": summary(s.hibernate_ms),
        "resume_step_ms": resume,  # the whole step after a hibernation, restore included
        "resumed_ms": resumed,  # of it, the restore (StepOutcome.resumed_ms)
        "fresh_first_step_ms": fresh,  # open_session on a warm sandbox, the same one-line step
        "resume_over_fresh": ratio(resume, fresh),
        "resume_over_fresh_paired": paired_ratio([(s.resume[r], s.fresh[r]) for r in sorted(both)]),
        "checkpoint_restore_ms": restore,  # a bare restore of the checkpoint, in the same shuffle
        "resumed_over_restore": ratio(resumed, restore),
        "fork_ms": summary(s.fork_ms),  # of a live session: its hibernation plus the image's links
        "fork_of_hibernated_ms": summary(s.fork_hibernated_ms, digits=2),  # the links alone
        "fork_first_step_ms": summary(s.fork_step_ms),
        "fork_resumed_ms": summary(s.fork_resumed_ms),
        "image_mb": summary([b / MB for b in s.image_bytes]),  # apparent size (capacity().hibernated_bytes)
        "image_disk_mb": summary([b / MB for b in s.image_disk_bytes]),  # blocks allocated
        "session_pss_mb": summary([kb / 1024 for kb in s.session_pss_kb]),  # the live session's sandbox
        "freed_pss_mb": summary([kb / 1024 for kb in s.freed_pss_kb]),  # the worker's PSS, before - after
        "errors": s.errors[:5],
    }
