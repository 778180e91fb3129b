"""Scenario 9: where a warm-pool job's and a session step's time goes, and what the warm-up saves.

Two in-process workers with one warm sandbox each take turns, settled before
each job: one warms its sandboxes up before hand-out (the default), one does
not (and so pings each sandbox before its job, as every worker did before
the warm-up existed): the before/after pair of that change, in one run. The
warmed worker also keeps one session open, and a step of it takes its turn
too. Every job and step is split on the worker's own clocks (``JobOutcome``):

* ``acquire``: taking the warm sandbox (its liveness check; none for a step);
* ``runner``: the exchange with the executor minus the job's own code: two
  socket hops, unpickling the request, the runner's set-up (links, seccomp,
  output capture, limits) and encoding the result;
* ``code``: the job's code itself, as the executor reports it;
* ``worker``: the rest of ``Worker.run_job`` or ``run_step`` (slot, request, result parsing).

and finer, in ``runner_phases`` (the runner's own account of its phases,
``readie_executor.jobs.bounds.RUNNER_PHASES``, plus ``wire``: the exchange
minus all of them, i.e. the socket hops, the framing and the result's final
JSON encoding) and ``worker_phases`` (pickling the request, the exchange,
validating the answer).

Only this scenario's jobs ask the runner to time its phases (``CodeJob.phases``):
its totals include the dozen clock reads that costs, which every other job is
spared (in a sandbox's first second after restore each is a system call).

``readie pool`` adds its JSONL hop on top; scenario 4 has that total beside a
session step.
"""

from __future__ import annotations

import statistics
import time
from typing import Any

from readie_executor.jobs import bounds
from readie_policy.jobs import JobOutcome, Step
from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob
from readie_worker.sessions import SandboxSession

from .._bench import WARM_FILL_TIMEOUT_S, Bench
from .._jobs import PRINT, check
from .._stats import ratio, summary

ARMS = ("warmed", "not_warmed", "session_step")
WORKER_PHASES = ("request", "exchange", "validate")


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    name = bench.load_names[-1]  # the largest image: where first-touch costs are largest
    workers = {
        arm: Worker(WorkerConfig.in_temp(bench.manifest_path, warm={name: 1}, slots=2, warm_up=arm == "warmed")).start()
        for arm in ARMS[:2]
    }
    samples: dict[str, list[dict[str, float]]] = {arm: [] for arm in ARMS}
    errors: list[str] = []
    session: SandboxSession | None = None
    try:
        workers["warmed"].warm[name].wait_until_full(WARM_FILL_TIMEOUT_S)
        session, _ = workers["warmed"].open_session(CodeJob(checkpoint=name, code=PRINT.code, phases=True))
        for _ in range(bench.settings.session_steps):
            for arm in ARMS:
                worker = workers["warmed" if arm == "session_step" else arm]
                worker.warm[name].wait_until_full(WARM_FILL_TIMEOUT_S)
                bench.settle()
                sample = _one_step(session) if arm == "session_step" else _one_job(worker, name)
                if isinstance(sample, str):
                    errors.append(f"{arm}: {sample}")
                else:
                    samples[arm].append(sample)
    finally:
        if session is not None:
            session.close()
        for worker in workers.values():
            worker.close()
    arms = {arm: _phases(values) for arm, values in samples.items()}
    return {
        "phases": {
            "what": f"one print(1) job on a warm {name} sandbox, Worker.run_job in process, split on the "
            "worker's clocks; warmed (default) vs not warmed up before hand-out, and a step of a session "
            "open on the warmed worker, taking turns",
            "checkpoint": name,
            "arms": arms,
            "not_warmed_over_warmed": ratio(arms["not_warmed"]["total_ms"], arms["warmed"]["total_ms"]),
            "errors": errors[:3],
        }
    }


def _one_job(worker: Worker, name: str) -> dict[str, float] | str:
    started = time.monotonic()
    outcome = worker.run_job(CodeJob(checkpoint=name, code=PRINT.code, phases=True))
    return _split(outcome, (time.monotonic() - started) * 1000)


def _one_step(session: SandboxSession) -> dict[str, float] | str:
    started = time.monotonic()
    outcome = session.run_step(Step(code=PRINT.code)).outcome
    return _split(outcome, (time.monotonic() - started) * 1000)


def _split(outcome: JobOutcome, total_ms: float) -> dict[str, float] | str:
    if outcome.error is not None:
        return f"{outcome.error.type}: {outcome.error.message}"
    problem = check(PRINT, outcome.exit, outcome.stdout, outcome.backend, "gvisor:runsc-restore")
    if problem is not None or outcome.code_us is None or outcome.runner_us is None or outcome.worker_us is None:
        return problem or "no timings"
    exchange_ms, code_ms = outcome.duration_us / 1000, outcome.code_us / 1000
    acquire_ms = (outcome.acquire_us or 0) / 1000
    sample = {
        "total_ms": total_ms,
        "acquire_ms": acquire_ms,
        "runner_ms": max(0.0, exchange_ms - code_ms),
        "code_ms": code_ms,
        "worker_ms": max(0.0, total_ms - acquire_ms - exchange_ms),
    }
    runner = {f"runner.{phase}": outcome.runner_us.get(phase, 0) / 1000 for phase in bounds.RUNNER_PHASES}
    runner["runner.wire"] = max(0.0, outcome.worker_us["exchange"] / 1000 - sum(runner.values()))
    worker = {f"worker.{phase}": outcome.worker_us.get(phase, 0) / 1000 for phase in WORKER_PHASES}
    return sample | runner | worker


def _phases(values: list[dict[str, float]]) -> dict[str, Any]:
    if not values:
        return {"total_ms": summary([])}
    coarse = [key for key in values[0] if "." not in key]
    phases: dict[str, Any] = {key: summary([v[key] for v in values], digits=2) for key in coarse}
    # The medians of the parts need not add up to the median of the whole; their share of the mean does.
    mean_total = statistics.fmean(v["total_ms"] for v in values)
    phases["share_of_mean"] = {
        key: round(statistics.fmean(v[key] for v in values) / mean_total, 3) for key in coarse if key != "total_ms"
    }
    # Finer, as p50 in ms: the runner's own phases (and the wire) and the worker's around the exchange.
    for group in ("runner", "worker"):
        phases[f"{group}_phases_p50_ms"] = {
            key.split(".", 1)[1]: round(statistics.median(v[key] for v in values), 3)
            for key in values[0] if key.startswith(group + ".")
        }
    return phases
