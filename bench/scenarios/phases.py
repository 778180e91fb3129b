"""Scenario 9: where a warm-pool job's time goes, and what the warm-up saves.

Two in-process workers with one warm sandbox each take turns, settled before
each job: one warms its sandboxes up before hand-out (the default), one does
not (and so pings each sandbox before its job, as every worker did before
the warm-up existed): the before/after pair of that change, in one run.
Every job is split on the worker's own clocks (``JobOutcome``):

* ``acquire``: taking the warm sandbox (its liveness check);
* ``runner``: the exchange with the executor minus the job's own code: two
  socket hops, unpickling the request, the runner's set-up (links, seccomp,
  output capture, limits) and encoding the result;
* ``code``: the job's code itself, as the executor reports it;
* ``worker``: the rest of ``Worker.run_job`` (slot, request, result parsing).

``readie pool`` adds its JSONL hop on top; scenario 4 has that total beside a
session step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob

from .._bench import WARM_FILL_TIMEOUT_S, Bench
from .._jobs import PRINT, check
from .._stats import ratio, summary

ARMS = ("warmed", "not_warmed")


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    name = bench.load_names[-1]  # the largest image: where first-touch costs are largest
    workers = {
        arm: Worker(WorkerConfig.in_temp(bench.manifest_path, warm={name: 1}, slots=1, warm_up=arm == "warmed")).start()
        for arm in ARMS
    }
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    errors: list[str] = []
    try:
        for _ in range(bench.settings.session_steps):
            for arm, worker in workers.items():
                worker.warm[name].wait_until_full(WARM_FILL_TIMEOUT_S)
                bench.settle()
                sample = _one_job(worker, name)
                if isinstance(sample, str):
                    errors.append(f"{arm}: {sample}")
                else:
                    samples[arm].append(sample)
    finally:
        for worker in workers.values():
            worker.close()
    arms = {arm: _phases(values) for arm, values in samples.items()}
    return {
        "phases": {
            "what": f"one print(1) job on a warm {name} sandbox, Worker.run_job in process, split on the "
            "worker's clocks; warmed (default) vs not warmed up before hand-out, taking turns",
            "checkpoint": name,
            "arms": arms,
            "not_warmed_over_warmed": ratio(arms["not_warmed"]["total_ms"], arms["warmed"]["total_ms"]),
            "errors": errors[:3],
        }
    }


def _one_job(worker: Worker, name: str) -> dict[str, float] | str:
    started = time.monotonic()
    outcome = worker.run_job(CodeJob(checkpoint=name, code=PRINT.code))
    total_ms = (time.monotonic() - started) * 1000
    if outcome.error is not None:
        return f"{outcome.error.type}: {outcome.error.message}"
    problem = check(PRINT, outcome.exit, outcome.stdout, outcome.backend, "gvisor:runsc-restore")
    if problem is not None or outcome.acquire_us is None or outcome.code_us is None:
        return problem or "no timings"
    exchange_ms, acquire_ms, code_ms = outcome.duration_us / 1000, outcome.acquire_us / 1000, outcome.code_us / 1000
    return {
        "total_ms": total_ms,
        "acquire_ms": acquire_ms,
        "runner_ms": max(0.0, exchange_ms - code_ms),
        "code_ms": code_ms,
        "worker_ms": max(0.0, total_ms - acquire_ms - exchange_ms),
    }


def _phases(values: list[dict[str, float]]) -> dict[str, Any]:
    if not values:
        return {"total_ms": summary([])}
    phases: dict[str, Any] = {key: summary([v[key] for v in values], digits=2) for key in values[0]}
    # The medians of the parts need not add up to the median of the whole; their share of the mean does.
    mean_total = statistics.fmean(v["total_ms"] for v in values)
    phases["share_of_mean"] = {
        key: round(statistics.fmean(v[key] for v in values) / mean_total, 3) for key in values[0] if key != "total_ms"
    }
    return phases
