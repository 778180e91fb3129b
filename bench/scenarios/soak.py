"""Scenario 12: the soak (issue 17): many jobs and sessions through one pool, and the curve of what it holds.

The same driver as the leak test (``bench/test_soak.py``, at CI size with
its allowances asserted), at the bench's size: ``soak_jobs`` print jobs and
``soak_sessions`` session clients opening, stepping and closing sessions,
through a fresh ``readie pool`` on the smallest checkpoint. The entry is
the curve: the pool's descriptors, threads and RSS, runsc containers,
sandbox dirs, cgroups and network namespaces at 20 points of the run, and
the two samples at rest (after a warm-up, at the end) the test compares.
"""

from __future__ import annotations

from typing import Any

from readie_worker.state_dir import RUN
from readie_worker.testing import runsc_in

from .._bench import Bench
from .._pool_client import PoolClient
from .._soak import STEPS_PER_SESSION, Watched, soak


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    settings, name = bench.settings, bench.names[0]
    state = bench.scratch / "soak-state"
    pool = PoolClient.start(
        bench.manifest_path, bench.checkpoint(name).preimport, settings.slots, bench.scratch / "pool-soak.log",
        args=[f"--state-dir={state}", f"--max-sessions={settings.soak_sessions}"],
    )
    try:
        watched = Watched(
            {"pool": pool.process.pid},
            lambda: len(runsc_in(state).list_ids()),
            (state / RUN,),
            settings.slots,
        )
        result = soak(
            pool, watched, jobs=settings.soak_jobs, sessions=settings.soak_sessions, clients=settings.slots,
            session_rounds=settings.soak_session_rounds,
        )
    finally:
        pool.close()
    return {"soak": {
        "what": f"{settings.soak_jobs} print jobs by {settings.slots} clients and {settings.soak_sessions} session "
        f"clients (open, {STEPS_PER_SESSION} steps, close; {settings.soak_session_rounds} times) through one readie pool ({name})",
        "checkpoint": name,
        **result.to_json(),
    }}
