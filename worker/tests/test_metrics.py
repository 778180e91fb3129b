"""The Metrics object on its own: names, labels from closed sets, its own registry, the HTTP endpoint."""

from __future__ import annotations

import argparse
import dataclasses
import os
import socket
import time
from dataclasses import dataclass, field
from types import SimpleNamespace

import pytest
from readie_worker.errors import ErrorType
from readie_worker.jobs import JobOutcome
from readie_worker.metrics import OUTCOMES, Metrics, add_metrics_argument, outcome_label, serve_if_asked, split_listen
from readie_worker.testing import free_port, sample, scrape

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families


def _outcome(exit: int | None = 0, error: str | None = None, calls: int = 0, duration_us: int = 20_000) -> JobOutcome:
    failed = JobOutcome.failure(error or "unused", "m", duration_us, "gvisor")
    host = SimpleNamespace(calls=calls, refused=0)
    return dataclasses.replace(failed, exit=exit, error=failed.error if error else None, host=host)


def _samples(metrics: Metrics) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    text = generate_latest(metrics.registry).decode()
    return {(s.name, frozenset(s.labels.items())): s.value for f in text_string_to_metric_families(text) for s in f.samples}


def test_outcomes_come_from_a_closed_set_matching_the_pools_counters():
    assert outcome_label(_outcome(0)) == "ok"
    assert outcome_label(_outcome(1)) == "failed"
    assert outcome_label(_outcome(None, "ValueError")) == "failed"  # the job's own exception
    assert outcome_label(_outcome(None, ErrorType.TIMEOUT)) == "timeout"
    assert outcome_label(_outcome(None, ErrorType.SIGNAL)) == "signal"
    assert outcome_label(_outcome(None, ErrorType.REQUEST)) == "request_error"
    assert outcome_label(_outcome(None, ErrorType.SANDBOX_SETUP)) == "worker_error"
    assert outcome_label(_outcome(None, ErrorType.POOL_WORKER)) == "worker_error"
    assert set(OUTCOMES) == {"ok", "failed", "timeout", "signal", "request_error", "worker_error"}


def test_a_job_moves_its_counters_and_histograms_by_exactly_one():
    metrics = Metrics()
    metrics.job_finished("base", _outcome(0, calls=2, duration_us=30_000), queue_s=0.002)
    metrics.job_finished("base", _outcome(1), queue_s=0.0)
    got = _samples(metrics)
    assert sample(got, "readie_worker_jobs_total", checkpoint="base", outcome="ok") == 1
    assert sample(got, "readie_worker_jobs_total", checkpoint="base", outcome="failed") == 1
    assert sample(got, "readie_worker_host_calls_total", checkpoint="base") == 2
    assert sample(got, "readie_worker_job_duration_seconds_count", checkpoint="base") == 2
    assert sample(got, "readie_worker_job_duration_seconds_sum", checkpoint="base") == pytest.approx(0.05)
    assert sample(got, "readie_worker_job_duration_seconds_bucket", checkpoint="base", le="0.025") == 1
    assert sample(got, "readie_worker_job_queue_duration_seconds_count", checkpoint="base") == 2


@dataclass
class _Launcher:
    name: str


@dataclass
class _Sandbox:
    launcher: _Launcher
    ready_ms: float = field(default=150.0)


def test_restores_cold_fallbacks_and_failures_are_told_apart():
    metrics = Metrics()
    metrics.sandbox_made("base", _Sandbox(_Launcher("runsc-restore")))  # type: ignore[arg-type]
    metrics.sandbox_made("base", _Sandbox(_Launcher("runsc-cold"), 4000.0))  # type: ignore[arg-type]
    metrics.sandbox_failed("base")
    got = _samples(metrics)
    assert sample(got, "readie_worker_sandbox_start_duration_seconds_count", checkpoint="base", launcher="runsc-restore") == 1
    assert sample(got, "readie_worker_sandbox_start_duration_seconds_sum", checkpoint="base", launcher="runsc-restore") == 0.15
    assert sample(got, "readie_worker_cold_fallbacks_total", checkpoint="base") == 1
    assert sample(got, "readie_worker_sandbox_start_failures_total", checkpoint="base") == 1


def test_grpc_calls_by_method_and_code():
    metrics = Metrics()
    metrics.rpc_handled("RunJob", "OK")
    metrics.rpc_handled("RunJob", "INVALID_ARGUMENT")
    metrics.rpc_handled("RunJob", "OK")
    got = _samples(metrics)
    assert sample(got, "grpc_server_handled_total", grpc_method="RunJob", grpc_code="OK") == 2
    assert sample(got, "grpc_server_handled_total", grpc_method="RunJob", grpc_code="INVALID_ARGUMENT") == 1


def test_the_worker_collector_reads_the_pools_at_scrape_time():
    pool = SimpleNamespace(hits=3, misses=1, paused_count=1)
    capacity = SimpleNamespace(warm={"base": {"ready": 1, "target": 2}}, slots=4, busy=1, sessions=2, max_sessions=16,
                               hibernated=1, hibernated_bytes=50_000_000)
    worker = SimpleNamespace(capacity=lambda: capacity, warm={"base": pool}, session_store_usage=lambda: (3, 150_000_000),
                             sessions=SimpleNamespace(paused=1))
    metrics = Metrics()
    metrics.watch_worker(worker)  # type: ignore[arg-type]
    got = _samples(metrics)
    assert sample(got, "readie_worker_warm_sandboxes_ready", checkpoint="base") == 1
    assert sample(got, "readie_worker_warm_sandboxes_target", checkpoint="base") == 2
    assert sample(got, "readie_worker_warm_hits_total", checkpoint="base") == 3
    assert sample(got, "readie_worker_warm_sandboxes_paused", checkpoint="base") == 1
    assert sample(got, "readie_worker_sessions_paused") == 1
    assert sample(got, "readie_worker_sessions_active") == 2
    assert sample(got, "readie_worker_sessions_hibernated") == 1
    assert sample(got, "readie_worker_hibernated_bytes") == 50_000_000
    assert sample(got, "readie_worker_session_store_entries") == 3
    assert sample(got, "readie_worker_session_store_bytes") == 150_000_000
    capacity.warm["base"]["ready"] = 2
    assert sample(_samples(metrics), "readie_worker_warm_sandboxes_ready", checkpoint="base") == 2


def test_two_metrics_objects_share_nothing():
    one, two = Metrics(), Metrics()
    one.rpc_handled("Capacity", "OK")
    assert sample(_samples(two), "grpc_server_handled_total", grpc_method="Capacity", grpc_code="OK") == 0


def test_the_flag_is_off_by_default_and_serves_when_given():
    parser = argparse.ArgumentParser()
    add_metrics_argument(parser)
    assert parser.parse_args([]).metrics_listen is None
    with pytest.raises(SystemExit):
        parser.parse_args(["--metrics-listen", "nowhere"])
    assert split_listen("[::1]:9464") == ("::1", 9464)
    metrics = Metrics()
    assert serve_if_asked(metrics, None) is None
    port = free_port()
    server = serve_if_asked(metrics, f"127.0.0.1:{port}")
    try:
        metrics.rpc_handled("RunJob", "OK")
        assert sample(scrape(port), "grpc_server_handled_total", grpc_method="RunJob", grpc_code="OK") == 1
    finally:
        server.close()


def test_a_failed_runsc_command_is_counted_by_subcommand_and_a_destroy_timed(tmp_path):
    """A real runsc stand-in that fails every command (/bin/false): what the worker's runsc reports."""
    from readie_worker.runsc import Runsc, RunscError

    metrics = Metrics()
    runsc = Runsc(root=tmp_path, binary="/bin/false", flags=("--platform=systrap",), checkpoint_flags=(), observer=metrics)
    with pytest.raises(RunscError):
        runsc.run("list", "--quiet")
    with pytest.raises(RunscError):
        runsc.run("--debug", "something-else")
    with pytest.raises(RunscError):
        # kill's failure is expected (the sandbox may be gone) and not counted; delete's is,
        # and so is the list that asks whether the container is still there.
        runsc.destroy("rd-none")
    got = _samples(metrics)
    assert sample(got, "readie_worker_runsc_command_failures_total", command="list") == 2
    assert sample(got, "readie_worker_runsc_command_failures_total", command="other") == 1
    assert sample(got, "readie_worker_runsc_command_failures_total", command="delete") == 1
    assert sample(got, "readie_worker_runsc_command_failures_total", command="kill") == 0
    assert sample(got, "readie_worker_sandbox_destroy_duration_seconds_count") == 0  # it raised: not a destroy


def test_session_steps_and_destroys_are_counted():
    metrics = Metrics()
    metrics.step_finished("base", _outcome(0))
    metrics.step_finished("base", _outcome(1))
    metrics.sandbox_destroyed(0.08)
    got = _samples(metrics)
    assert sample(got, "readie_worker_session_steps_total", checkpoint="base", outcome="ok") == 1
    assert sample(got, "readie_worker_session_steps_total", checkpoint="base", outcome="failed") == 1
    assert sample(got, "readie_worker_sandbox_destroy_duration_seconds_bucket", le="0.1") == 1


def test_idle_connections_hold_no_thread_and_a_scrape_still_answers():
    """Forty connections that never send a request (the attack battery's case, which held forty
    threads of prometheus_client's server): the endpoint keeps its one thread, a scrape on a fresh
    connection is answered at once, the oldest silent ones make room for it, and every silent one
    is closed at the exchange timeout."""
    from readie_worker._metrics_http import MAX_CONNECTIONS, MetricsEndpoint, render_registry
    from readie_worker.testing import closed_by_peer, idle_connections, thread_count, wait_until

    metrics = Metrics()
    metrics.rpc_handled("RunJob", "OK")
    endpoint = MetricsEndpoint("127.0.0.1", 0, render_registry(metrics.registry), exchange_timeout_s=1.0)
    port = endpoint.address[1]
    threads = thread_count(os.getpid())
    try:
        with idle_connections(port, 40) as held:
            # The first ones are closed as later ones arrive; the last MAX_CONNECTIONS wait.
            assert wait_until(lambda: sum(map(closed_by_peer, held)) == 40 - MAX_CONNECTIONS, 2.0)
            assert thread_count(os.getpid()) == threads
            started = time.monotonic()
            assert sample(scrape(port, timeout=3.0), "grpc_server_handled_total", grpc_method="RunJob", grpc_code="OK") == 1
            assert time.monotonic() - started < 1.0  # not behind the silent ones
            assert sum(map(closed_by_peer, held)) == 40 - MAX_CONNECTIONS + 1  # one made room for the scrape
            assert wait_until(lambda: all(map(closed_by_peer, held)), 3.0)  # the timeout (1 s here)
    finally:
        endpoint.close()
    # close() ended the endpoint's thread (the kernel lets its task go a moment after join returns).
    assert wait_until(lambda: thread_count(os.getpid()) == threads - 1, 1.0)


def test_the_endpoint_answers_only_get_of_metrics_and_refuses_oversized_requests():
    metrics = Metrics()
    endpoint = metrics.serve(f"127.0.0.1:{free_port()}")
    port = endpoint.address[1]
    try:
        for method, path, status in (("GET", "/", 200), ("GET", "/metrics?x=1", 200), ("GET", "/other", 404),
                                     ("POST", "/metrics", 405)):
            with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
                connection.sendall(f"{method} {path} HTTP/1.1\r\nHost: x\r\n\r\n".encode())
                assert connection.makefile("rb").readline().split()[1] == str(status).encode(), (method, path)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as connection:
            connection.sendall(b"GET /" + b"a" * 10_000 + b" HTTP/1.1\r\n\r\n")
            assert connection.recv(100) == b""  # over MAX_REQUEST_BYTES: closed without an answer
    finally:
        endpoint.close()
    with pytest.raises(OSError):  # the port is free again, and a bad address fails at once
        metrics.serve("256.0.0.1:1")
