"""Scenario 3: sustained jobs/s against the bound that restore CPU sets.

Every job in a warm pool consumes one sandbox: a restore before it and a
destroy after it. On C cores that caps the rate at C / (CPU seconds per
restore+destroy), however the work is scheduled. Sequential restore cycles
measured right before and right after the load window give that figure in
the same run; the ratio says how close the pool gets to it.
"""

from __future__ import annotations

from typing import Any

from readie_worker.errors import ReadieError

from .._bench import Bench
from .._jobs import PRINT
from .._load import drive
from .._stats import summary
from .latency import measure_restore


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    entries = {}
    for name in bench.load_names:
        entries[name] = _measure(bench, name)
    settings = bench.settings
    return {
        "throughput": {
            "what": f"print(1) jobs/s with {settings.throughput_clients} closed-loop clients on "
            f"{settings.slots} slots for {settings.throughput_s:.0f} s, vs cores / CPU-s per warm-pool sandbox "
            "(restore, warm-up, destroy)",
            "via": {name: bench.warm_path(name).via for name in bench.load_names},
            "cores": bench.cores,
            "checkpoints": entries,
        }
    }


def _measure(bench: Bench, name: str) -> dict[str, Any]:
    settings = bench.settings
    half = max(1, settings.restore_cpu_samples // 2)
    cycles, errors = [], []

    def restores() -> None:
        for _ in range(half):
            bench.settle()
            try:
                cycles.append(measure_restore(bench, name, warm_up=True))
            except ReadieError as exc:
                errors.append(str(exc))

    restores()
    bench.settle()
    window = drive(bench.warm_path(name), PRINT, settings.throughput_clients, settings.throughput_s)
    restores()
    jobs_per_s = window["completed"] / settings.throughput_s
    lifecycle = summary([c.lifecycle_cpu_s for c in cycles if c.lifecycle_cpu_s is not None], digits=3)
    ready = summary([c.cpu_s for c in cycles], digits=3)
    bound = _bound(bench.cores, lifecycle)
    ready_bound = _bound(bench.cores, ready)
    return {
        "jobs_per_s": round(jobs_per_s, 2),
        "completed": window["completed"],
        "errors": window["errors"],
        "first_error": window["first_error"],
        "latency_ms": summary(window["latencies_ms"]),
        "machine_busy": window["machine_busy"],
        "ours_busy": window["ours_busy"],
        "others_busy": window["others_busy"],
        "cpu_s_per_job": window["cpu_s_per_job"],
        "cpu_s_per_restore_and_destroy": lifecycle,
        "cpu_s_per_restore_to_ready": ready,
        "bound_jobs_per_s": bound,
        "bound_restore_only_jobs_per_s": ready_bound,
        "throughput_over_bound": round(jobs_per_s / bound, 2) if bound else None,
        "throughput_over_restore_only_bound": round(jobs_per_s / ready_bound, 2) if ready_bound else None,
        # The same bound on the cores other people's work left us during the window.
        "throughput_over_bound_given_others": _given_others(jobs_per_s, bound, window["others_busy"]),
        "restore_errors": errors[:3],
    }


def _given_others(jobs_per_s: float, bound: float | None, others_busy: float | None) -> float | None:
    if not bound or others_busy is None or others_busy >= 1:
        return None
    return round(jobs_per_s / (bound * (1 - others_busy)), 2)


def _bound(cores: int, cpu: dict[str, Any]) -> float | None:
    return round(cores / cpu["p50"], 2) if cpu.get("p50") else None
