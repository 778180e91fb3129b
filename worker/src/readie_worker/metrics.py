"""Every Prometheus metric readie exports, defined once; off unless ``--metrics-listen`` is given.

    metrics = Metrics()
    worker = Worker(config, metrics=metrics).start()
    metrics.watch_worker(worker)           # warm sandboxes, slots, sessions: read at scrape time
    endpoint = metrics.serve("127.0.0.1:9464")  # on a thread of its own (_metrics_http)

Each process owns its own :class:`~prometheus_client.CollectorRegistry`, never
the library's global one, so tests can run several in one process
(docs/decisions/0017-metrics.md). Label values come from closed sets only:
an outcome from :data:`OUTCOMES`, a checkpoint from the manifest (a job
naming another is refused before it is counted), a launcher from the three
launchers, gRPC methods and codes from the service definition and
``grpc.StatusCode``, a router's probe outcome and eviction reason from
:data:`PROBE_OUTCOMES` and :data:`EVICTION_REASONS`. docs/operations.md
lists the metrics and example alerts.

The endpoint has no authentication: metrics hold no secrets, but bind it to
loopback or a private network. It runs on one thread of its own with bounded
connections and a timeout (``_metrics_http``), never on a thread jobs need.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any, Protocol

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from ._metrics_http import MetricsEndpoint, render_registry
from .errors import ErrorType
from readie_policy.jobs import Capacity
from .runsc import RUNSC_COMMANDS

if TYPE_CHECKING:
    from .jobs import JobOutcome
    from .sandbox import Sandbox
    from .warm import WarmSandboxes

# The closed set a job's outcome label takes (the pool's stats counters, in the singular).
OUTCOMES = ("ok", "failed", "timeout", "signal", "request_error", "worker_error")
_OUTCOME_OF_ERROR = {
    ErrorType.TIMEOUT: "timeout",
    ErrorType.SIGNAL: "signal",
    ErrorType.REQUEST: "request_error",
    ErrorType.SANDBOX_SETUP: "worker_error",
    ErrorType.POOL_WORKER: "worker_error",
}
# The pool's Outcome values (readie_pool._events, the stats event's counter names) as labels.
_OUTCOME_OF_POOL_COUNTER = {
    "ok": "ok",
    "failed": "failed",
    "timeouts": "timeout",
    "signals": "signal",
    "request_errors": "request_error",
    "worker_errors": "worker_error",
}
# A router's Capacity probe of a worker: answered, or not (a refusal, a timeout, no connection).
PROBE_OUTCOMES = ("ok", "failed")
# Why a router stopped placing work on a worker: it missed EVICT_AFTER_FAILURES
# probes in a row; a call was lost with it (PoolWorkerError, a broken stream);
# its address left the DNS answer of --worker-dns (the work on it finishes).
EVICTION_REASONS = ("probes", "lost", "retired")
# The launcher a pool's restore factory falls back to when a restore fails (launchers.py).
COLD_LAUNCHER = "runsc-cold"

# Seconds. A job on a warm sandbox takes a few milliseconds to tens; real work
# seconds; a runaway one runs into its timeout (minutes at most): roughly
# 2.5x steps from 5 ms to 5 min keep each band distinguishable in a quantile.
JOB_BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
# Seconds. A job waits for a slot not at all when the worker keeps up, so the
# low buckets (1 ms) tell "no queue" from "some"; the top ones show saturation.
QUEUE_BUCKETS_S = (0.001, 0.005, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
# Seconds. A restore is ~0.1 s of runsc start and sentry boot plus loading its
# image (docs/benchmarks.md), a cold start 1.5-5x that, a struggling host
# seconds: fine steps where restores fall, coarse ones for cold starts and the tail.
SANDBOX_START_BUCKETS_S = (0.05, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 2.0, 5.0, 10.0, 30.0)
# Seconds. A destroy (SIGKILL of the sandbox, runsc delete) takes 57-130 ms here
# (_retire.py); a wedged sentry or a slow delete seconds, and runsc's own
# timeout (30 s) is the top.
SANDBOX_DESTROY_BUCKETS_S = (0.025, 0.05, 0.1, 0.15, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)


class Metrics:
    """One process's metrics, on a registry of its own. Every recording method is cheap and thread-safe."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.jobs = Counter("readie_worker_jobs", "Jobs the worker ran, by checkpoint and outcome.", ["checkpoint", "outcome"], registry=r)
        self.job_duration = Histogram(
            "readie_worker_job_duration_seconds", "Jobs' wall time on the worker's clock (sandbox acquired to answer).",
            ["checkpoint"], buckets=JOB_BUCKETS_S, registry=r,
        )
        self.queue_duration = Histogram(
            "readie_worker_job_queue_duration_seconds", "Time jobs waited for a slot.", ["checkpoint"], buckets=QUEUE_BUCKETS_S, registry=r
        )
        self.host_calls = Counter("readie_worker_host_calls", "Host-function calls jobs made.", ["checkpoint"], registry=r)
        self.sandbox_start = Histogram(
            "readie_worker_sandbox_start_duration_seconds",
            "Time to make a sandbox ready (a warm one, or one made for a job's own mounts or network); launcher runsc-restore is a restore.",
            ["checkpoint", "launcher"], buckets=SANDBOX_START_BUCKETS_S, registry=r,
        )
        self.cold_fallbacks = Counter(
            "readie_worker_cold_fallbacks", "Restores that failed and were replaced by a cold start.", ["checkpoint"], registry=r
        )
        self.sandbox_start_failures = Counter(
            "readie_worker_sandbox_start_failures", "Sandboxes that could not be made at all (restore and cold start failed).",
            ["checkpoint"], registry=r,
        )
        self.session_steps = Counter(
            "readie_worker_session_steps", "Session steps the worker ran (each session's first included), by checkpoint and outcome.",
            ["checkpoint", "outcome"], registry=r,
        )
        self.session_images = Histogram(
            "readie_worker_session_image_duration_seconds",
            "Hibernations of sessions to disk, their resumes and their forks, by operation (hibernate, resume, fork).",
            ["operation"], buckets=SANDBOX_START_BUCKETS_S, registry=r,
        )
        self.session_checkpoints = Histogram(
            "readie_worker_session_checkpoint_duration_seconds",
            "Per-step checkpoints of sessions (session_checkpoint = step), by result (ok, failed).",
            ["result"], buckets=SANDBOX_START_BUCKETS_S, registry=r,
        )
        # The session store (decision 32): sessions this worker handed on at a drain, took from
        # the store, and refused to take (unknown: no such session, or a wrong key; held: its live
        # holder did not let go in time; invalid: its entry failed verification).
        self.session_hand_overs = Counter(
            "readie_worker_session_hand_overs", "Sessions a drain hibernated into the shared store for another worker.", registry=r,
        )
        self.session_attaches = Counter(
            "readie_worker_session_attaches", "Sessions taken from the session store by key.", registry=r,
        )
        self.session_attach_refusals = Counter(
            "readie_worker_session_attach_refusals", "Attaches refused, by reason (unknown, held, invalid).", ["reason"], registry=r,
        )
        self.sandbox_destroy = Histogram(
            "readie_worker_sandbox_destroy_duration_seconds", "Time to kill and delete a sandbox (runsc).",
            buckets=SANDBOX_DESTROY_BUCKETS_S, registry=r,
        )
        self.egress_connections = Counter(
            "readie_worker_egress_connections",
            "New connections of networked jobs and steps, by checkpoint and verdict (allowed, refused by the egress policy).",
            ["checkpoint", "verdict"], registry=r,
        )
        self.egress_refused_lookups = Counter(
            "readie_worker_egress_refused_lookups",
            "DNS lookups the egress resolver refused (a name not allowed, or answers only in denied space), by checkpoint.",
            ["checkpoint"], registry=r,
        )
        self.runsc_failures = Counter(
            "readie_worker_runsc_command_failures", "runsc commands that exited non-zero or timed out, by subcommand.",
            ["command"], registry=r,
        )
        self.grpc_handled = Counter(
            "grpc_server_handled", "RPCs the gRPC server completed, by method and status code.", ["grpc_method", "grpc_code"], registry=r
        )
        self.probes = Counter(
            "readie_router_probes", "Capacity probes the router made of its workers, by outcome.", ["outcome"], registry=r
        )
        self.evictions = Counter(
            "readie_router_evictions", "Workers the router stopped placing new work on, by reason.", ["reason"], registry=r
        )

    # ---------------------------------------------------------------- recording

    def job_finished(self, checkpoint: str, outcome: JobOutcome, queue_s: float) -> None:
        self.jobs.labels(checkpoint, outcome_label(outcome)).inc()
        self.job_duration.labels(checkpoint).observe(outcome.duration_us / 1_000_000)
        self.queue_duration.labels(checkpoint).observe(queue_s)
        if outcome.host is not None and outcome.host.calls:
            self.host_calls.labels(checkpoint).inc(outcome.host.calls)
        self._egress(checkpoint, outcome)

    def sandbox_made(self, checkpoint: str, sandbox: Sandbox) -> None:
        """A warm sandbox is ready (``ready_ms`` is its launch on the worker's clock)."""
        launcher = sandbox.launcher.name
        self.sandbox_start.labels(checkpoint, launcher).observe(sandbox.ready_ms / 1000)
        if launcher == COLD_LAUNCHER:
            self.cold_fallbacks.labels(checkpoint).inc()

    def sandbox_failed(self, checkpoint: str) -> None:
        self.sandbox_start_failures.labels(checkpoint).inc()

    def step_finished(self, checkpoint: str, outcome: JobOutcome) -> None:
        self.session_steps.labels(checkpoint, outcome_label(outcome)).inc()
        self._egress(checkpoint, outcome)

    def _egress(self, checkpoint: str, outcome: JobOutcome) -> None:
        """What a networked job's (or step's) egress policy allowed and refused: its own report."""
        if outcome.network is None:
            return
        self.egress_connections.labels(checkpoint, "allowed").inc(outcome.network.allowed_connections)
        self.egress_connections.labels(checkpoint, "refused").inc(outcome.network.refused_connections)
        self.egress_refused_lookups.labels(checkpoint).inc(outcome.network.refused_lookups)

    def session_image(self, operation: str, seconds: float) -> None:
        self.session_images.labels(_closed(operation, ("hibernate", "resume", "fork"))).observe(seconds)

    def session_checkpointed(self, result: str, seconds: float) -> None:
        """A step's checkpoint ended (its count, failures and seconds are the histogram's)."""
        self.session_checkpoints.labels(_closed(result, ("ok", "failed"))).observe(seconds)

    def session_handed_over(self) -> None:
        self.session_hand_overs.inc()

    def session_attached(self) -> None:
        self.session_attaches.inc()

    def attach_refused(self, reason: str) -> None:
        self.session_attach_refusals.labels(_closed(reason, ("unknown", "held", "invalid"))).inc()

    def sandbox_destroyed(self, seconds: float) -> None:
        self.sandbox_destroy.observe(seconds)

    def runsc_failed(self, command: str) -> None:
        self.runsc_failures.labels(_closed(command, (*RUNSC_COMMANDS, "other"))).inc()

    def rpc_handled(self, method: str, code: str) -> None:
        self.grpc_handled.labels(method, code).inc()

    def placement_probed(self, outcome: str) -> None:
        self.probes.labels(_closed(outcome, PROBE_OUTCOMES)).inc()

    def worker_evicted(self, reason: str) -> None:
        self.evictions.labels(_closed(reason, EVICTION_REASONS)).inc()

    # ---------------------------------------------------------------- read at scrape time

    def watch_worker(self, worker: WatchedWorker) -> None:
        """Warm sandboxes ready vs target, slots and sessions, read from ``worker`` at each scrape."""
        self.registry.register(_WorkerCollector(worker))

    def watch_router(self, discovered: Callable[[], int]) -> None:
        """A router's: its workers found by DNS, read at each scrape; its probe and eviction
        counters shown at 0 from the start, so an alert's ``increase()`` sees the first one."""
        for outcome in PROBE_OUTCOMES:
            self.probes.labels(outcome)
        for reason in EVICTION_REASONS:
            self.evictions.labels(reason)
        self.registry.register(_RouterCollector(discovered))

    def watch_pool(self, stats: Callable[[], Any]) -> None:
        """``readie pool``'s own counters, from the engine's Stats (``stats()`` gives it, or None before start)."""
        self.registry.register(_PoolCollector(stats))

    # ---------------------------------------------------------------- serving

    def serve(self, listen: str) -> MetricsEndpoint:
        """Serve ``/metrics`` on ``listen`` ("HOST:PORT") from a thread of its own until ``close()``."""
        host, port = split_listen(listen)
        return MetricsEndpoint(host, port, render_registry(self.registry))


def outcome_label(outcome: JobOutcome) -> str:
    """The :data:`OUTCOMES` member a job's outcome counts as (as the pool's stats count it)."""
    if outcome.error is None:
        return "ok" if outcome.exit == 0 else "failed"
    return _OUTCOME_OF_ERROR.get(outcome.error.type, "failed")  # anything else: the job's own exception


def split_listen(listen: str) -> tuple[str, int]:
    host, sep, port = listen.rpartition(":")
    if not sep or not port.isdigit() or not host:
        raise ValueError(f"wants HOST:PORT, got {listen!r}")
    return host.strip("[]"), int(port)


def _listen(text: str) -> str:
    try:
        split_listen(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def add_metrics_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--metrics-listen", type=_listen, metavar="HOST:PORT",
        help="serve Prometheus /metrics here, without auth: bind loopback or a private network (default: off)",
    )


def serve_if_asked(metrics: Metrics, listen: str | None) -> MetricsEndpoint | None:
    """The flag's one behaviour for every command: nothing without it; an unusable address raises OSError."""
    return None if listen is None else metrics.serve(listen)


class _PausedSessions(Protocol):
    @property
    def paused(self) -> int: ...


class WatchedWorker(Protocol):
    """What the worker gauges read at each scrape (a :class:`~readie_worker.core.Worker` has it)."""

    @property
    def warm(self) -> Mapping[str, WarmSandboxes]: ...

    @property
    def sessions(self) -> _PausedSessions: ...

    def capacity(self) -> Capacity: ...

    def session_store_usage(self) -> tuple[int, int]: ...


class _WorkerCollector(Collector):
    def __init__(self, worker: WatchedWorker) -> None:
        self._worker = worker

    def collect(self) -> Iterator[Any]:
        # Capacity is answered from memory under the worker's lock; the warm sets are fixed at start.
        capacity = self._worker.capacity()
        warm = dict(self._worker.warm)
        ready = GaugeMetricFamily("readie_worker_warm_sandboxes_ready", "Warm sandboxes ready to take a job.", labels=["checkpoint"])
        target = GaugeMetricFamily("readie_worker_warm_sandboxes_target", "Warm sandboxes the worker keeps ready.", labels=["checkpoint"])
        for name, counts in capacity.warm.items():
            ready.add_metric([name], counts["ready"])
            target.add_metric([name], counts["target"])
        hits = CounterMetricFamily("readie_worker_warm_hits", "Jobs served by a warm sandbox.", labels=["checkpoint"])
        misses = CounterMetricFamily("readie_worker_warm_misses", "Jobs that found no warm sandbox and waited for one.", labels=["checkpoint"])
        paused = GaugeMetricFamily(
            "readie_worker_warm_sandboxes_paused", "Warm sandboxes ready and paused (frozen: no CPU).", labels=["checkpoint"]
        )
        for name, pool in warm.items():
            hits.add_metric([name], pool.hits)
            misses.add_metric([name], pool.misses)
            paused.add_metric([name], pool.paused_count)
        yield from (ready, target, paused, hits, misses)
        yield _gauge("readie_worker_slots", "Jobs the worker runs at once.", capacity.slots)
        yield _gauge("readie_worker_slots_busy", "Slots running a job now.", capacity.busy)
        yield _gauge("readie_worker_sessions_active", "Sessions open (each holds a sandbox).", capacity.sessions)
        yield _gauge("readie_worker_sessions_max", "Sessions the worker keeps open at most.", capacity.max_sessions)
        yield _gauge("readie_worker_sessions_hibernated", "Sessions hibernated to disk (counted in sessions_active too).", capacity.hibernated)
        yield _gauge(
            "readie_worker_sessions_paused", "Open sessions whose sandbox waits paused between steps (session_pause).",
            self._worker.sessions.paused,
        )
        yield _gauge("readie_worker_hibernated_bytes", "Bytes of the hibernated sessions' images on disk.", capacity.hibernated_bytes)
        entries, stored = self._worker.session_store_usage()  # as last counted: no scan at a scrape
        yield _gauge("readie_worker_session_store_entries", "Sessions stored in the session store (every worker's).", entries)
        yield _gauge("readie_worker_session_store_bytes", "Bytes of the session store's images (every worker's).", stored)


class _RouterCollector(Collector):
    def __init__(self, discovered: Callable[[], int]) -> None:
        self._discovered = discovered

    def collect(self) -> Iterator[Any]:
        yield _gauge(
            "readie_router_discovered_workers", "Workers found by --worker-dns and not retired (static --worker ones aside).",
            self._discovered(),
        )


class _PoolCollector(Collector):
    def __init__(self, stats: Callable[[], Any]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        jobs = CounterMetricFamily("readie_pool_jobs", "Results the pool wrote, refusals included, by outcome.", labels=["outcome"])
        counts: Mapping[Any, int] = stats.counts if stats is not None else {}
        by_label = dict.fromkeys(OUTCOMES, 0)
        for outcome, count in counts.items():
            by_label[_OUTCOME_OF_POOL_COUNTER[outcome.value]] += count
        for label, count in by_label.items():
            jobs.add_metric([label], count)
        yield jobs
        yield _gauge("readie_pool_sessions_active", "Sessions open in the pool.", stats.sessions_active if stats else 0)
        host = CounterMetricFamily("readie_pool_host_calls", "Host-function call events the pool wrote.")
        host.add_metric([], stats.host_calls if stats else 0)
        yield host


def _closed(value: str, allowed: tuple[str, ...]) -> str:
    """``value`` if it is one of the label set ``allowed``: a label outside it is a bug here, not data."""
    if value not in allowed:
        raise ValueError(f"{value!r} is not one of {allowed}")
    return value


def _gauge(name: str, documentation: str, value: float) -> GaugeMetricFamily:
    return GaugeMetricFamily(name, documentation, value=value)
