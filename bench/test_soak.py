"""Leak accounting over a soak (issue 17), at CI size: through ``readie pool`` and through a router.

Each arm runs :data:`JOBS` jobs and :data:`SESSIONS` concurrent session
clients (each opening, stepping and closing sessions until the jobs are
done) and compares two samples taken at rest, after a warm-up and at the
end, against the allowances below; then stops everything and checks that
no container, sandbox dir, cgroup or network namespace is left. The bench
runs the same soak at its own size and prints the curve (``python -m
bench.run --only soak``, docs/benchmarks.md).
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import pytest
from readie_rpc.testing import start_cluster
from readie_worker.state_dir import RUN
from readie_worker.testing import runsc_in, wait_until

from bench._pool_client import PoolClient
from bench._soak import Sample, SoakResult, Watched, empty_sandbox_cgroups, netns_entries, soak
from conftest import CHECKPOINTS

# 1,000 jobs cost ~150 s of restores on two idle cores; a loaded machine takes twice that.
pytestmark = [pytest.mark.runsc, pytest.mark.timeout(900)]

JOBS = 1000  # the CI size: at least 1,000 jobs and 16 sessions
SESSIONS = 16
CLIENTS = 2  # closed-loop job clients: the pool's slots, kept busy
# Allowances, growth between the two samples at rest. At rest a process holds
# a fixed set of descriptors and threads (its warm sandboxes' sockets, gRPC
# channels, pools of threads that grow to their bound in the warm-up); a leak
# of one per job or per session would be hundreds here, so a small margin
# tells the two apart while letting a lazily started thread or a log file in.
FD_ALLOWANCE = 8
THREAD_ALLOWANCE = 4
# Python keeps freed arenas and gRPC its buffers: RSS moves by megabytes at
# rest. 32 MiB over 1,000 jobs catches a leak of 32 KiB or more per job; the
# bench's 20,000 jobs show smaller slopes in its curve.
RSS_ALLOWANCE_KIB = 32 * 1024
# runsc delete removes a sandbox's cgroups; one being torn down right now is empty for a moment.
CGROUP_SETTLE_S = 10.0


def check(result: SoakResult, watched: Watched) -> None:
    assert not result.failures, result.failures[:5]
    assert result.jobs == JOBS and result.sessions >= SESSIONS  # every session client opened one at least
    before, after = result.rest_before, result.rest_after
    report = "\n".join(str(sample.to_json()) for sample in (before, after))
    for name in watched.pids:
        grown = after.processes[name], before.processes[name]
        assert grown[0].fds - grown[1].fds <= FD_ALLOWANCE, f"{name} descriptors grew:\n{report}"
        assert grown[0].threads - grown[1].threads <= THREAD_ALLOWANCE, f"{name} threads grew:\n{report}"
        assert grown[0].rss_kib - grown[1].rss_kib <= RSS_ALLOWANCE_KIB, f"{name} RSS grew:\n{report}"
    # At rest exactly the warm sandboxes exist: each a container, a sandbox dir and a cgroup.
    assert (after.containers, after.sandbox_dirs) == (watched.warm, watched.warm), report
    assert after.netns <= before.netns, report


def nothing_left(cgroups: frozenset[str], netns: int) -> None:
    """No sandbox's cgroup newly left empty and no namespace more than before the test: the
    machine's, so another process's sandbox being torn down is waited out, not counted."""
    assert wait_until(lambda: not empty_sandbox_cgroups() - cgroups, CGROUP_SETTLE_S), sorted(empty_sandbox_cgroups() - cgroups)
    assert netns_entries() <= netns


def test_a_soak_through_readie_pool_leaks_nothing(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="soak-", dir="/tmp"))
    state = base / "state"
    cgroups, netns = empty_sandbox_cgroups(), netns_entries()
    pool = PoolClient.start(
        CHECKPOINTS / "manifest.json", (), CLIENTS, base / "pool.log",
        args=[f"--state-dir={state}", f"--max-sessions={SESSIONS}"],
    )
    try:
        watched = Watched(
            {"pool": pool.process.pid}, lambda: len(runsc_in(state).list_ids()), (state / RUN,), CLIENTS
        )
        check(soak(pool, watched, jobs=JOBS, sessions=SESSIONS, clients=CLIENTS), watched)
    finally:
        code = pool.close()
    assert code == 0
    assert runsc_in(state).list_ids() == [] and not state.exists()
    nothing_left(cgroups, netns)
    shutil.rmtree(base, ignore_errors=True)


def test_a_soak_through_a_router_leaks_nothing(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="soakr-", dir="/tmp"))
    cgroups, netns = empty_sandbox_cgroups(), netns_entries()
    cluster = start_cluster(base, CHECKPOINTS / "manifest.json", workers=2, warm="base=1", slots=2)
    try:
        pool = PoolClient.start(
            CHECKPOINTS / "manifest.json", (), CLIENTS, base / "pool.log", router=cluster.address,
            args=[f"--max-sessions={SESSIONS}"],
        )
        try:
            pids = {"pool": pool.process.pid, "router": cluster.router.pid}
            pids.update({f"worker-{i}": worker.process.pid for i, worker in enumerate(cluster.workers)})
            watched = Watched(
                pids,
                lambda: sum(len(worker.containers()) for worker in cluster.workers),
                tuple(worker.state_dir / RUN for worker in cluster.workers),
                len(cluster.workers),
            )
            check(soak(pool, watched, jobs=JOBS, sessions=SESSIONS, clients=CLIENTS), watched)
        finally:
            assert pool.close() == 0
    finally:
        cluster.stop()  # raises if a worker fails to drain or leaves a container
    nothing_left(cgroups, netns)
    shutil.rmtree(base, ignore_errors=True)


def test_the_samples_are_what_proc_says():
    """The sampler itself: this process's descriptors move when a file is opened."""
    from bench._soak import usage

    before = usage(os.getpid())
    with open(__file__) as _:
        assert usage(os.getpid()).fds == before.fds + 1
    assert isinstance(Sample(0, 0, 0.0, {}, 0, 0, 0, 0, 0).to_json(), dict)
