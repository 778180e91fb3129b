"""Scenario 8: what the router hop adds to a session step and a host-function call.

Scenarios 4 and 5 go through ``readie pool`` with its worker in-process. Behind
``readie pool --router`` the same requests cross two more gRPC hops (pool ->
router -> worker) on one ``Interact`` stream per session or per job with
functions (decision 0009), and every host call comes back the same way. Both
paths are measured in one run on the smallest checkpoint: ``local`` is the
pool the other scenarios use, ``routed`` a second pool in front of a
``readie router`` and two ``readie worker`` processes on loopback
(``start_cluster``; stopped at the end, which fails if a runsc container is
left). Each round, the arms take turns (the first one alternates, each
settled) at one session step (``x += 1; print(x)``, output checked) and one
host-function task (``host_calls`` calls timed inside the sandbox). The
machine is noisy, so the figures are routed/local ratios of p50 and p95 and
the median of per-round ratios, never absolute thresholds. Beside them, the
floor those ratios are held against (``bench._floors``): a bare round trip on
an open stream to the router, settled as a step is (a turn each round) and
back to back as a task's calls are.
"""

from __future__ import annotations

import statistics
from typing import Any

from readie_rpc.testing import start_cluster

from .._bench import Bench
from .._floors import UNMEASURED, StreamEcho, measured, timed
from .._pool_client import PoolClient
from .._stats import paired_ratio, ratio, summary
from .later import Refused, host_call_times, pool_request

ARMS = ("local", "routed")
WORKERS = 2
# The router's own default; start_cluster's 0.2 s suits tests that kill workers.
PROBE_INTERVAL = "--probe-interval=1"
STEP = "x += 1\nprint(x)\n"
# The floors' reflection stream stays open through the scenario (~25 s here, minutes when loaded).
STREAM_LIFETIME_S = 1800.0


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    name = bench.names[0]
    local = bench.pools.get(name)
    if local is None:
        return {"router_hop": {"available": False, "reason": bench.pool_problems.get(name, "no readie pool")}}
    # One warm sandbox per worker and `slots` each: the local pool's two warm, spread over two workers.
    cluster = start_cluster(
        bench.scratch / "cluster", bench.manifest_path, workers=WORKERS, warm=f"{name}=1",
        slots=bench.settings.slots, router_args=[PROBE_INTERVAL],
    )
    try:
        routed = PoolClient.start(
            bench.manifest_path, bench.checkpoint(name).preimport, bench.settings.slots,
            bench.scratch / "pool-routed.log", router=cluster.address,
        )
        try:
            with StreamEcho(cluster.channel, STREAM_LIFETIME_S) as echo:
                entry = _measure(bench, {"local": local, "routed": routed}, echo)
                bench.settle()
                hot = measured(lambda: timed(echo.round_trip, bench.settings.floor_samples, 1_000_000), digits=3)
            entry["grpc_stream_round_trip_ms"]["hot"] = hot
            entry["routed_over_local_floor"] = _floor(entry)
        finally:
            routed.close()
    finally:
        cluster.stop()
    return {"router_hop": {
        "available": True,
        "what": f"readie pool with its in-process worker (local) vs readie pool --router in front of "
        f"{WORKERS} readie workers on loopback (routed), taking turns",
        "checkpoint": name,
        **entry,
    }}


def _measure(bench: Bench, pools: dict[str, PoolClient], echo: StreamEcho) -> dict[str, Any]:
    sessions = {arm: f"bench-hop-{arm}" for arm in ARMS}
    steps: dict[str, list[float]] = {arm: [] for arm in ARMS}
    calls: dict[str, list[float]] = {arm: [] for arm in ARMS}
    step_pairs, call_pairs, problems = [], [], []
    settled_stream_ms = []  # the floor of a step's hops: a stream round trip, settled as each step is
    for _ in range(UNMEASURED):
        echo.once_ms()
    first_ms = {}
    try:
        for arm in ARMS:
            bench.settle()
            result, elapsed_s = pool_request(pools[arm], {"session": sessions[arm], "code": "x = 0\n"})
            if result.get("exit") != 0:
                raise Refused(f"{arm}: the session's first step failed: {result.get('error')}")
            first_ms[arm] = round(elapsed_s * 1000, 1)
        for round_ in range(bench.settings.rounds):
            order = ARMS if round_ % 2 == 0 else ARMS[::-1]
            step_ms, call_p50 = {}, {}
            for arm in order:
                bench.settle()
                result, elapsed_s = pool_request(pools[arm], {"session": sessions[arm], "code": STEP})
                if result.get("exit") == 0 and result.get("stdout") == f"{round_ + 1}\n":
                    step_ms[arm] = elapsed_s * 1000
                    steps[arm].append(step_ms[arm])
                else:
                    problems.append(f"{arm}: {result.get('error') or result.get('stdout')!r}")
            bench.settle()
            if (stream_ms := echo.once_ms()) is not None:
                settled_stream_ms.append(stream_ms)
            for arm in order:
                bench.settle()
                times = host_call_times(pools[arm], bench.settings.host_calls)
                calls[arm].extend(times)
                call_p50[arm] = statistics.median(times)
            if len(step_ms) == 2:
                step_pairs.append((step_ms["routed"], step_ms["local"]))
            call_pairs.append((call_p50["routed"], call_p50["local"]))
    finally:
        for arm in first_ms:  # the local pool is shared with other scenarios: leave no session open
            try:
                pool_request(pools[arm], {"session": sessions[arm], "close": True})
            except Refused:
                pass  # that pool is gone; the error that got us here is the one to report
    return {
        "session_first_step_ms": first_ms,
        "session_step_ms": _arms(steps, step_pairs, digits=1),
        "host_round_trip_ms": _arms(calls, call_pairs, digits=3),
        "grpc_stream_round_trip_ms": {"settled": {**summary(settled_stream_ms, digits=3),
                                                  **({"error": echo.error} if echo.error else {})}},
        "errors": problems[:3],
    }


def _floor(entry: dict[str, Any]) -> dict[str, float | None]:
    """Routed / local if each of the two gRPC hops cost a bare stream round trip and nothing else:
    a routed step or call crosses pool -> router -> worker and back, a local one neither. A step
    is settled before it, so its hops are held against settled round trips; a task's calls
    follow one another, so theirs against round trips back to back."""
    stream = entry["grpc_stream_round_trip_ms"]
    floors: dict[str, float | None] = {}
    for figure, key, kind in (("session_step", "session_step_ms", "settled"), ("host_call", "host_round_trip_ms", "hot")):
        local, hop = entry[key]["local"].get("p50"), stream[kind].get("p50")
        floors[figure] = round((local + 2 * hop) / local, 2) if local and hop is not None else None
    return floors


def _arms(samples: dict[str, list[float]], pairs: list[tuple[float, float]], digits: int) -> dict[str, Any]:
    local, routed = summary(samples["local"], digits), summary(samples["routed"], digits)
    return {
        "local": local,
        "routed": routed,
        "routed_over_local": {"p50": ratio(routed, local), "p95": ratio(routed, local, "p95"),
                              "paired": paired_ratio(pairs)},
    }
