"""Scenarios 1 (a sandbox ready to run) and 2 (one job end to end), in shared rounds.

They share rounds because they share samples: a cold runsc start is both
scenario 1's cold arm (until the socket answers) and the first part of
scenario 2's cold arm (then the job runs in it). Each round takes, per
checkpoint, one bare restore and then, per job kind, the five job arms in a
shuffled order, with the machine settled before each arm. Checkpoint order
rotates from round to round. So every arm of a ratio is sampled across the
whole run, next to the others, and slow drift hits all of them alike.
"""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from typing import Any

from readie_worker.errors import ReadieError, SandboxSetupError
from readie_worker.jobs import CodeJob, run_in_sandbox
from readie_worker.sandbox import SandboxFactory

from .._bench import Bench
from .._jobs import JobKind, Sample, check, kinds_for
from .._procs import children_cpu_s, cpu_s, sandbox_pids
from .._stats import paired_ratio, ratio, summary

# Fixed, so two runs shuffle their arms the same way.
RANDOM_SEED = 20221219
ARMS = ("warm_pool", "read_grant", "empty_pool", "cold", "host")
MB = 1024 * 1024


@dataclass
class StartSample:
    ready_ms: float
    cpu_s: float  # runsc command + sandbox and gofer, until the socket answers
    lifecycle_cpu_s: float | None = None  # the same plus destroy (reaped): what one job consumes
    destroy_ms: float | None = None  # kill + delete + reap: on a job's response path today


@dataclass
class _Arm:
    samples: dict[int, Sample] = field(default_factory=dict)  # round -> sample
    errors: list[str] = field(default_factory=list)

    def add(self, round_index: int, sample: Sample) -> None:
        if sample.error is None:
            self.samples[round_index] = sample
        else:
            self.errors.append(sample.error)

    def values(self) -> list[float]:
        return [s.elapsed_ms for s in self.samples.values()]


def measure_restore(bench: Bench, name: str, *, warm_up: bool = False) -> StartSample:
    """One bare restore of checkpoint ``name`` (see :func:`restore_cycle`)."""
    return restore_cycle(bench.restore_factory(name), warm_up=warm_up)


def restore_cycle(factory: SandboxFactory, *, warm_up: bool = False) -> StartSample:
    """One bare restore to a ready socket, then destroy; CPU from rusage and /proc.

    ``warm_up``: also the warm-up call a pool makes before hand-out, so the
    cycle costs what each warm-pool sandbox costs (scenario 3's bound).

    The worker reaps its sandboxes (child subreaper), so once destroyed their
    CPU shows in RUSAGE_CHILDREN: the delta around create+destroy is the whole
    lifecycle. Before destroy, the live processes' own counters give the part
    spent getting ready.
    """
    before = children_cpu_s()
    sandbox = factory.create()
    try:
        command_cpu = children_cpu_s() - before  # `runsc restore --detach`, waited for
        ready_cpu = command_cpu + cpu_s(sandbox_pids(sandbox.id))
        problem = sandbox.warm_up() if warm_up else None
        if problem is not None:
            raise SandboxSetupError(f"warm-up failed: {problem}")
    finally:
        destroy_started = time.monotonic()
        sandbox.destroy()
    destroy_ms = (time.monotonic() - destroy_started) * 1000
    return StartSample(sandbox.ready_ms, ready_cpu, children_cpu_s() - before, destroy_ms)


def cold_job(bench: Bench, name: str, kind: JobKind) -> tuple[Sample, StartSample | None]:
    """A cold runsc start (imports included) and one job in it, as the worker runs jobs:
    the sandbox is destroyed before the caller has its result."""
    started = time.monotonic()
    before = children_cpu_s()
    try:
        sandbox = bench.cold_factory(name).create()
    except ReadieError as exc:
        return Sample((time.monotonic() - started) * 1000, f"cold start: {exc}"), None
    # Reading /proc takes a few ms; the clock stops for it (the sandbox is idle meanwhile).
    paused = time.monotonic()
    start = StartSample(sandbox.ready_ms, children_cpu_s() - before + cpu_s(sandbox_pids(sandbox.id)))
    paused = time.monotonic() - paused
    try:
        outcome = run_in_sandbox(sandbox, CodeJob(checkpoint=name, code=kind.code), ())
    finally:
        sandbox.destroy()
    elapsed_ms = (time.monotonic() - started - paused) * 1000
    if outcome.error is not None:
        return Sample(elapsed_ms, f"{outcome.error.type}: {outcome.error.message}"), start
    problem = check(kind, outcome.exit, outcome.stdout, outcome.backend, "gvisor:runsc-cold")
    return Sample(elapsed_ms, problem, outcome.duration_us / 1000), start


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    rng = random.Random(RANDOM_SEED)
    starts: dict[str, dict[str, list]] = {
        name: {"restore": [], "cold": [], "pairs": [], "errors": []} for name in bench.names
    }
    jobs: dict[tuple[str, str], dict[str, _Arm]] = {}
    paths = {
        name: {
            "warm_pool": bench.warm_path(name),
            "read_grant": bench.grant_path(name),
            "empty_pool": bench.empty_path(name),
            "host": bench.host_path(name),
        }
        for name in bench.names
    }
    for round_index in range(bench.settings.rounds):
        shift = round_index % len(bench.names)
        for name in bench.names[shift:] + bench.names[:shift]:
            start = starts[name]
            bench.settle()
            try:
                restored: StartSample | None = measure_restore(bench, name)
                start["restore"].append(restored)
            except ReadieError as exc:
                restored = None
                start["errors"].append(f"restore: {exc}")
            for kind in kinds_for(bench.checkpoint(name).preimport):
                arms = jobs.setdefault((name, kind.name), {arm: _Arm() for arm in ARMS})
                order = list(ARMS)
                rng.shuffle(order)
                for arm in order:
                    bench.settle()
                    if arm == "cold":
                        sample, cold = cold_job(bench, name, kind)
                        if cold is not None:
                            start["cold"].append(cold)
                            if restored is not None:
                                start["pairs"].append((cold.ready_ms, restored.ready_ms))
                    else:
                        sample = paths[name][arm].run(kind)
                    arms[arm].add(round_index, sample)
    names = bench.names
    return {
        "start": {
            "what": "runsc start until the executor's socket answers: restore from the checkpoint "
            "vs cold `runsc run` importing the same modules (Sandbox.ready_ms)",
            "checkpoints": {name: _start_entry(bench, name, starts[name]) for name in names},
        },
        "job": {
            "what": "one job, request to result, as the caller sees it (sandbox destroy included: "
            "the worker destroys before it answers)",
            "via": {
                "warm_pool": {name: paths[name]["warm_pool"].via for name in names},
                "read_grant": "as warm_pool, the job granted an empty directory to read (allow_read)",
                "empty_pool": paths[names[0]]["empty_pool"].via + ", pool target 0: each job restores its own",
                "cold": "launch(RunscCold) + run_in_sandbox + destroy: a cold runsc start per job",
                "host": paths[names[0]]["host"].via,
            },
            "pool_problems": dict(bench.pool_problems),
            "checkpoints": {
                name: {
                    kind: _job_entry(arms)
                    for (job_name, kind), arms in jobs.items()
                    if job_name == name
                }
                for name in names
            },
        },
    }


def _start_entry(bench: Bench, name: str, start: dict[str, list]) -> dict[str, Any]:
    checkpoint = bench.checkpoint(name)
    restore = summary([s.ready_ms for s in start["restore"]])
    cold = summary([s.ready_ms for s in start["cold"]])
    restore_cpu = summary([s.cpu_s for s in start["restore"]], digits=3)
    cold_cpu = summary([s.cpu_s for s in start["cold"]], digits=3)
    return {
        "preimport": list(checkpoint.preimport),
        "image_mb": round(checkpoint.size_bytes / MB, 1),
        "restore_ms": restore,
        "cold_ms": cold,
        "cold_over_restore": ratio(cold, restore),
        "cold_over_restore_paired": paired_ratio(start["pairs"]),
        "restore_cpu_s": restore_cpu,
        "cold_cpu_s": cold_cpu,
        "cold_over_restore_cpu": ratio(cold_cpu, restore_cpu),
        "restore_lifecycle_cpu_s": summary([s.lifecycle_cpu_s for s in start["restore"]], digits=3),
        "destroy_ms": summary([s.destroy_ms for s in start["restore"]]),
        "capture_p50_ms": {  # what `make capture` measured, for comparison across runs
            "restore_to_socket": checkpoint.restore_to_socket_p50_ms,
            "cold_start": checkpoint.cold_start_p50_ms,
        },
        "errors": start["errors"][:5],
    }


def _job_entry(arms: dict[str, _Arm]) -> dict[str, Any]:
    entry: dict[str, Any] = {arm: summary(arms[arm].values()) for arm in ARMS}
    calls = [s.call_ms for s in arms["warm_pool"].samples.values() if s.call_ms is not None]
    entry["warm_pool_call_ms"] = summary(calls)  # the in-sandbox call alone, by the worker's clock

    def paired(top: str, bottom: str) -> float | None:
        a, b = arms[top].samples, arms[bottom].samples
        return paired_ratio([(a[r].elapsed_ms, b[r].elapsed_ms) for r in a.keys() & b.keys()])

    entry["ratios"] = {
        "cold_over_warm": ratio(entry["cold"], entry["warm_pool"]),
        "empty_over_warm": ratio(entry["empty_pool"], entry["warm_pool"]),
        "read_grant_over_warm": ratio(entry["read_grant"], entry["warm_pool"]),
        "warm_over_host": ratio(entry["warm_pool"], entry["host"]),
        "cold_over_host": ratio(entry["cold"], entry["host"]),
    }
    entry["paired_ratios"] = {
        "cold_over_warm": paired("cold", "warm_pool"),
        "empty_over_warm": paired("empty_pool", "warm_pool"),
        "read_grant_over_warm": paired("read_grant", "warm_pool"),
        "warm_over_host": paired("warm_pool", "host"),
    }
    entry["errors"] = {arm: arms[arm].errors[:3] for arm in ARMS if arms[arm].errors}
    return entry
