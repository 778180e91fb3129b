"""``readie pool --metrics-listen``: a real pool, a few jobs and a session, then /metrics scraped.

The counters must move by exactly what ran: three jobs (one failing, one
calling a host function) and a two-step session; the pool's own counters
(every result it wrote) and its embedded worker's (one-shot jobs only,
sessions read at scrape time) are both checked.
"""

from __future__ import annotations

import json
import shutil
import socket
import tempfile
from pathlib import Path

import pytest
from readie_pool._events import Outcome, Stats
from readie_pool.testing import PoolProcess
from readie_worker.metrics import Metrics
from readie_worker.testing import free_port, idle_connections, runsc_in, sample, scrape, thread_count, wait_until

from conftest import CHECKPOINTS
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

WORKERS = 2
# Threads the pool may start meanwhile on its own (a refill, the asyncio executor's), far below
# the one per connection that the idle-connection check would see otherwise.
IDLE_THREAD_SLACK = 4
SEARCH = "from readie_host import search\nprint(search('readie'))"


def test_the_pool_collector_maps_the_stats_counters_and_zeros_before_start():
    stats: list[Stats] = []
    metrics = Metrics()
    metrics.watch_pool(lambda: stats[0] if stats else None)

    def got() -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
        text = generate_latest(metrics.registry).decode()
        return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}

    assert sample(got(), "readie_pool_jobs_total", outcome="ok") == 0
    stats.append(Stats())
    stats[0].counts[Outcome.TIMEOUT] += 2
    stats[0].host_calls = 5
    stats[0].session_started()
    now = got()
    assert sample(now, "readie_pool_jobs_total", outcome="timeout") == 2
    assert sample(now, "readie_pool_host_calls_total") == 5
    assert sample(now, "readie_pool_sessions_active") == 1


@pytest.mark.runsc
def test_pool_metrics_count_exactly_what_ran(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="rpm-", dir="/tmp"))
    state = base / "state"
    port = free_port()
    process = PoolProcess(
        ["--checkpoints", str(CHECKPOINTS), "--state-dir", str(state), "--workers", str(WORKERS),
         "--metrics-listen", f"127.0.0.1:{port}"],
        cwd=base,
        stderr_path=base / "stderr.log",
    )
    try:
        process.ready()
        checkpoint = served_checkpoint(port)
        before = scrape(port)
        assert sample(before, "readie_pool_jobs_total", outcome="ok") == 0
        assert sample(before, "readie_worker_warm_sandboxes_target", checkpoint=checkpoint) == WORKERS
        # Forty connections that never send a request take no thread of the pool's (prometheus_client's
        # server held one each), and a scrape beside them is answered at once.
        threads = thread_count(process.process.pid)
        with idle_connections(port, 40):
            assert sample(scrape(port, timeout=2.0), "readie_pool_jobs_total", outcome="ok") == 0
            assert thread_count(process.process.pid) <= threads + IDLE_THREAD_SLACK

        assert process.run({"id": "a", "code": "print(1)"})["exit"] == 0
        assert process.run({"id": "b", "code": "raise ValueError('no')"})["error"]["type"] == "ValueError"
        process.send({"id": "c", "functions": ["search"], "code": SEARCH})
        call = json.loads(process.read_line() or b"{}")
        process.send({"reply": {"call_id": call["call_id"], "result": "hit"}})
        assert process.read()["exit"] == 0
        assert process.run({"id": "s1", "session": "nb", "code": "x = 1"})["exit"] == 0
        assert process.run({"id": "s2", "session": "nb", "code": "print(x)"})["stdout"] == "1\n"

        during = scrape(port)
        assert sample(during, "readie_pool_sessions_active") == 1
        assert sample(during, "readie_worker_sessions_active") == 1
        assert process.run({"id": "s3", "session": "nb", "close": True})["closed"] is True

        after = scrape(port)
        # The pool: every result it wrote (two session steps among them).
        assert sample(after, "readie_pool_jobs_total", outcome="ok") == 4
        assert sample(after, "readie_pool_jobs_total", outcome="failed") == 1
        assert sum(sample(after, "readie_pool_jobs_total", outcome=o) for o in ("timeout", "signal", "request_error", "worker_error")) == 0
        assert sample(after, "readie_pool_host_calls_total") == 1
        assert sample(after, "readie_pool_sessions_active") == 0
        assert sample(after, "readie_worker_sessions_active") == 0
        # Its worker: the three one-shot jobs.
        assert sample(after, "readie_worker_jobs_total", checkpoint=checkpoint, outcome="ok") == 2
        assert sample(after, "readie_worker_jobs_total", checkpoint=checkpoint, outcome="failed") == 1
        assert sample(after, "readie_worker_job_duration_seconds_count", checkpoint=checkpoint) == 3
        assert sample(after, "readie_worker_job_queue_duration_seconds_count", checkpoint=checkpoint) == 3
        assert sample(after, "readie_worker_host_calls_total", checkpoint=checkpoint) == 1
        # Each one-shot job and the session took a warm sandbox; the pool restored its replacements.
        assert wait_until(lambda: sample(scrape(port), "readie_worker_warm_sandboxes_ready", checkpoint=checkpoint) == WORKERS, 30)
        final = scrape(port)
        restores = sample(final, "readie_worker_sandbox_start_duration_seconds_count", checkpoint=checkpoint, launcher="runsc-restore")
        assert restores >= WORKERS + 4
        assert sample(final, "readie_worker_cold_fallbacks_total", checkpoint=checkpoint) == 0
        assert process.close() == 0
    finally:
        process.stop()
        leftovers = runsc_in(state).list_ids()
        if leftovers:
            runsc_in(state).sweep()
        shutil.rmtree(base, ignore_errors=True)
    assert leftovers == []


def served_checkpoint(port: int) -> str:
    """The checkpoint the pool serves, as its worker's metrics name it (the one with a warm target)."""
    targets = [labels for (name, labels), value in scrape(port).items() if name == "readie_worker_warm_sandboxes_target" and value]
    assert len(targets) == 1, targets
    return dict(targets[0])["checkpoint"]


@pytest.mark.runsc
def test_a_metrics_port_in_use_stops_the_pool_before_it_is_ready(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="rpm-", dir="/tmp"))
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        process = PoolProcess(
            ["--checkpoints", str(CHECKPOINTS), "--state-dir", str(base / "state"), "--metrics-listen", f"127.0.0.1:{port}"],
            cwd=base,
            stderr_path=base / "stderr.log",
        )
        try:
            assert process.wait() == 1
            assert process.read_line() is None  # no ready event
            assert f"cannot serve metrics on 127.0.0.1:{port}" in process.stderr_text()
        finally:
            process.stop()
            shutil.rmtree(base, ignore_errors=True)
