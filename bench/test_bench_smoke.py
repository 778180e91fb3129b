"""`python -m bench.run --smoke` end to end: every scenario runs once and the JSON has its shape."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import CHECKPOINTS, REPO
from readie_executor.jobs import bounds

pytestmark = pytest.mark.runsc

# The budget for the smoke run inside `make test`.
SMOKE_BUDGET_S = 60.0
SCENARIOS = (
    "start", "job", "throughput", "session_step", "host_function", "memory", "scaling", "router_hop", "phases",
    "old_runsc", "stream", "soak", "hibernate", "transfers", "step_checkpoint", "handover", "egress",
)


def test_smoke_run_measures_every_scenario_within_budget(tmp_path: Path) -> None:
    output = tmp_path / "smoke.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "bench.run", "--smoke", f"--checkpoints={CHECKPOINTS}", f"--output={output}"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=SMOKE_BUDGET_S * 2,  # fail with output rather than hang; the budget is asserted below
    )
    elapsed = time.monotonic() - started
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert elapsed < SMOKE_BUDGET_S, f"smoke run took {elapsed:.0f} s"
    result = json.loads(output.read_text())

    assert result["mode"] == "smoke"
    assert {"cores", "memory_mib", "runsc_version", "runsc_platform", "kernel"} <= result["machine"].keys()
    scenarios = result["scenarios"]
    assert set(SCENARIOS) <= scenarios.keys()
    for name in SCENARIOS:
        entry = scenarios[name]
        assert "error" not in entry, (name, entry)
        assert entry.get("available", True), (name, entry.get("reason"))  # sessions and host functions have landed
    names = list(scenarios["start"]["checkpoints"])
    assert len(names) >= 2  # the smallest and the largest: two points for restore vs image size
    for name in names:
        start = scenarios["start"]["checkpoints"][name]
        assert start["restore_ms"]["n"] == 1 and start["cold_ms"]["n"] >= 1
        assert start["cold_over_restore"] > 0
        for kind, job in scenarios["job"]["checkpoints"][name].items():
            for arm in ("warm_pool", "read_grant", "empty_pool", "cold", "host"):
                assert job[arm]["n"] == 1, (name, kind, arm, job["errors"])
    assert "groupby" in scenarios["job"]["checkpoints"][names[-1]]  # the largest preloads pandas
    assert len(scenarios["scaling"]["restore_vs_image_size"]["points"]) == len(names)
    # The sustained and resident scenarios run on the smallest checkpoint in a smoke run.
    for name, throughput in scenarios["throughput"]["checkpoints"].items():
        assert throughput["completed"] > 0 and throughput["errors"] == 0, name
        assert throughput["bound_jobs_per_s"] > 0
    for name, memory in scenarios["memory"]["checkpoints"].items():
        assert memory["restored"]["pss_mb"]["p50"] > 0, name
    for name, levels in scenarios["scaling"]["clients"].items():
        assert set(levels) == {"1", "2", "4"}, name
    for name, session in scenarios["session_step"]["checkpoints"].items():
        assert session["step_ms"]["n"] >= 1, (name, session["errors"])
    # The host call's split: the sandbox's own steps, and the pool and client's share alone.
    breakdown = scenarios["host_function"]["breakdown_us"]
    assert breakdown.get("available", True) and breakdown["pool_and_client"]["n"] >= 1, breakdown
    hop = scenarios["router_hop"]  # the same step and host call, local and through a router, side by side
    for figure in ("session_step_ms", "host_round_trip_ms"):
        assert hop[figure]["local"]["n"] >= 1 and hop[figure]["routed"]["n"] >= 1, (figure, hop["errors"])
        assert hop[figure]["routed_over_local"]["p50"] > 0, figure
    # The floors those asks are held against, in the same run (bench._floors).
    assert breakdown["sandbox_echo_us"]["n"] >= 1 and breakdown["process_round_trip_us"]["n"] >= 1, breakdown
    assert breakdown["chained_call_us"]["n"] >= 1, breakdown
    assert hop["grpc_stream_round_trip_ms"]["settled"]["n"] >= 1 and hop["grpc_stream_round_trip_ms"]["hot"]["n"] >= 1
    assert {"session_step", "host_call"} == hop["routed_over_local_floor"].keys()
    assert all(floor > 1 for floor in hop["routed_over_local_floor"].values()), hop["routed_over_local_floor"]
    assert "floor: sandbox echo + process round trip p50 ms (a host call's least, back to back)" in result["key_figures"]
    assert "floor: the two chained as a call chains them p50 ms (a host call's least)" in result["key_figures"]
    # A warm job's phases, warmed up and not (the before/after pair of that change), and a session
    # step's, each down to the runner's own phases.
    for arm in ("warmed", "not_warmed", "session_step"):
        phases = scenarios["phases"]["arms"][arm]
        assert phases["total_ms"]["n"] >= 1, (arm, scenarios["phases"]["errors"])
        assert {"acquire_ms", "runner_ms", "code_ms", "worker_ms"} <= phases.keys()
        assert list(phases["runner_phases_p50_ms"]) == [*bounds.RUNNER_PHASES, "wire"], arm
        assert list(phases["worker_phases_p50_ms"]) == ["request", "exchange", "validate"], arm
    # Debian 12's runsc beside the default one, each arm naming its version and platform.
    old = scenarios["old_runsc"]
    assert old["arms"]["old"]["platform"] == "ptrace" and old["arms"]["new"]["platform"] == "systrap", old["errors"]
    assert old["arms"]["old"]["warm_job_ms"]["n"] >= 1 and old["old_over_new_cpu"] > 0, old["errors"]
    # A file up and down through a local pool and a routed one, beside cp on the host.
    transfer = scenarios["transfers"]["sizes"]["1MiB"]
    assert transfer["cp_mb_s"] > 0
    for arm in ("local", "routed"):
        assert transfer[arm]["upload_mb_s"] > 0 and transfer[arm]["download_mb_s"] > 0, arm
    # A worker's SIGTERM hands its session to the store; its first step on the other worker beside a live one.
    handover = scenarios["handover"]
    assert handover["drain_to_stored_ms"]["n"] == 1 and handover["first_step_ms"]["n"] == 1, handover["errors"]
    assert handover["live_step_ms"]["n"] == 1 and handover["resumed_ms"]["p50"] >= 0
    assert handover["store_entries_left"] == 0 and handover["workers_left"] == 0
    egress = scenarios["egress"]
    assert egress["plain_ms"]["n"] == 1 and egress["networked_ms"]["n"] == 1, egress["errors"]
    assert egress["wiring_left"] == [] and egress["networked_over_plain"] > 0
    # The table renders from the JSON alone.
    assert "key figures" in done.stdout
