"""Scenario 10: Debian 12's own runsc (2022, ptrace, compressed images) beside the default one.

Where setup kept the old binary (``readie_worker.testing.DEBIAN_12_RUNSC``),
the largest checkpoint is captured with it too, and two in-process workers,
one per runsc, take turns: a bare restore+destroy cycle (CPU from rusage) and
a print(1) job on a warm sandbox, settled before each. The old figures stay
measurable next to the new ones, in one run.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from readie_pipeline.capture import CaptureOptions, capture
from readie_pipeline.plan import load_plan
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ReadieError
from readie_worker.runsc import features
from readie_worker.testing import DEBIAN_12_RUNSC

from .._bench import WARM_FILL_TIMEOUT_S, Bench
from .._jobs import PRINT, WorkerPath
from .._stats import ratio, summary
from .latency import restore_cycle


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    if not DEBIAN_12_RUNSC.exists():
        return {"old_runsc": {"available": False, "reason": f"{DEBIAN_12_RUNSC} is not installed (make setup)"}}
    name = bench.load_names[-1]
    old_dir = bench.scratch / "checkpoints-debian12"
    plan = load_plan()
    capture(plan, CaptureOptions(old_dir, runs=1, only=(name,), runsc=str(DEBIAN_12_RUNSC)), lambda line: None)
    manifests = {"new": (bench.manifest_path, "runsc"), "old": (old_dir / "manifest.json", str(DEBIAN_12_RUNSC))}
    workers = {
        arm: Worker(WorkerConfig.in_temp(manifest, warm={name: 1}, slots=1, runsc=binary)).start()
        for arm, (manifest, binary) in manifests.items()
    }
    cycles: dict[str, list[Any]] = {arm: [] for arm in workers}
    jobs: dict[str, list[float]] = {arm: [] for arm in workers}
    errors: list[str] = []
    try:
        for _ in range(max(2, bench.settings.restore_cpu_samples)):
            for arm, worker in workers.items():
                bench.settle()
                try:
                    cycles[arm].append(restore_cycle(dataclasses.replace(worker.factories[name], fallback=None)))
                except ReadieError as exc:
                    errors.append(f"{arm} restore: {exc}")
                worker.warm[name].wait_until_full(WARM_FILL_TIMEOUT_S)
                bench.settle()
                sample = WorkerPath(worker, name).run(PRINT)
                if sample.error is None:
                    jobs[arm].append(sample.elapsed_ms)
                else:
                    errors.append(f"{arm} job: {sample.error}")
        arms = {arm: _arm(worker, name, cycles[arm], jobs[arm]) for arm, worker in workers.items()}
    finally:
        for worker in workers.values():
            worker.close()
    return {
        "old_runsc": {
            "what": f"{name}: bare restore+destroy and a warm-pool print(1) job, Debian 12's runsc vs the "
            "default one, taking turns (Worker.run_job in process)",
            "checkpoint": name,
            "arms": arms,
            "old_over_new_cpu": ratio(arms["old"]["lifecycle_cpu_s"], arms["new"]["lifecycle_cpu_s"]),
            "old_over_new_job": ratio(arms["old"]["warm_job_ms"], arms["new"]["warm_job_ms"]),
            "errors": errors[:3],
        }
    }


def _arm(worker: Worker, name: str, cycles: list[Any], jobs: list[float]) -> dict[str, Any]:
    checkpoint = worker.checkpoints.usable[name] if worker.checkpoints else None
    return {
        "runsc_version": features(worker.runsc.binary).version.removeprefix("runsc version "),
        "platform": features(worker.runsc.binary).platform,
        "flags": list(worker.runsc.family_flags),
        "image_mb": round(checkpoint.size_bytes / 2**20, 1) if checkpoint else None,
        "ready_ms": summary([c.ready_ms for c in cycles]),
        "lifecycle_cpu_s": summary([c.lifecycle_cpu_s for c in cycles if c.lifecycle_cpu_s is not None], digits=3),
        "warm_job_ms": summary(jobs),
    }
