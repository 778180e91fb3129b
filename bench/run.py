"""``make bench``: run the scenarios, write the JSON, print the table.

    python -m bench.run [--smoke] [--output build/bench/latest.json]
                        [--checkpoints build/checkpoints] [--only latency,memory,...]
    python -m bench.run --show build/bench/latest.json

Exit status 1 when a scenario failed outright (its entry then carries the
error); "not available" scenarios (features not built yet) are not failures.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from readie_worker import enter_mount_namespace
from readie_worker.errors import ReadieError
from readie_policy.logs import configure_logging
from readie_worker.manifest import MANIFEST_NAME

from . import _machine
from ._bench import FULL, SMOKE, Bench
from ._table import render
from .scenarios import ON_DEMAND, SCENARIOS

SCHEMA_VERSION = 1
DEFAULT_OUTPUT = Path("build/bench/latest.json")
DEFAULT_CHECKPOINTS = Path("build/checkpoints")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.show is not None:
        print(render(json.loads(Path(args.show).read_text())))
        return 0
    # The worker logs a line per job at info; the report is the output here.
    configure_logging(level="warning")
    enter_mount_namespace()  # before any thread: the in-process workers' sandbox mounts live there
    checkpoints = Path(args.checkpoints or os.environ.get("READIE_CHECKPOINTS") or DEFAULT_CHECKPOINTS)
    manifest = checkpoints / MANIFEST_NAME if checkpoints.is_dir() else checkpoints
    only = set(args.only.split(",")) if args.only else None
    unknown = (only or set()) - {name for name, _, _ in SCENARIOS}
    if unknown:
        print(f"bench: unknown scenarios {sorted(unknown)}", file=sys.stderr)
        return 2
    result = measure(manifest, smoke=args.smoke, only=only)
    write_json(result, Path(args.output))
    print(render(result))
    print(f"\nwritten: {args.output}")
    failed = [k for k, v in result["scenarios"].items() if "error" in v]
    return 1 if failed else 0


def measure(manifest: Path, smoke: bool, only: set[str] | None) -> dict[str, Any]:
    settings = SMOKE if smoke else FULL
    started = time.monotonic()
    try:
        bench = Bench(settings, manifest, smoke).open()
    except (ReadieError, OSError, ValueError) as exc:  # no runsc, no or bad checkpoints
        raise SystemExit(f"bench: cannot start: {exc}") from None
    result: dict[str, Any] = {
        "schema": SCHEMA_VERSION,
        "mode": "smoke" if smoke else "full",
        "started_at": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "machine": {},
        "settings": dict(vars(settings)),
        "manifest": {
            "path": str(manifest.resolve()),
            "created_at": bench.manifest.created_at,
            "rootfs_fingerprint": bench.manifest.rootfs_fingerprint,
            "images_mb": {c.name: round(c.size_bytes / 2**20, 1) for c in bench.checkpoints},
        },
        "scenarios": {},
        "scenario_seconds": {},
    }
    try:
        result["machine"] = _machine.describe(bench.manifest)
        for name, module, entries in SCENARIOS:
            if (only is not None and name not in only) or (only is None and not smoke and name in ON_DEMAND):
                continue
            began = time.monotonic()
            try:
                result["scenarios"].update(module.run(bench, result["scenarios"]))
            except Exception as exc:  # one broken scenario must not cost the others their figures
                traceback.print_exc()
                for entry in entries:
                    result["scenarios"][entry] = {"error": f"{type(exc).__name__}: {exc}"}
            result["scenario_seconds"][name] = round(time.monotonic() - began, 1)
    finally:
        bench.close()
    result["settle"] = {"timeouts": bench.settle.timeouts, "waited_s": round(bench.settle.waited_s, 1)}
    result["loadavg_at_end"] = list(os.getloadavg())
    result["duration_s"] = round(time.monotonic() - started, 1)
    result["key_figures"] = key_figures(result["scenarios"], bench.names[-1])
    return result


def key_figures(scenarios: dict[str, Any], name: str) -> dict[str, Any]:
    """The handful of numbers the issue asks for, for the largest checkpoint (pandas)."""
    figures: dict[str, Any] = {}

    def pick(path: str) -> Any:
        node: Any = scenarios
        for part in path.split("/"):
            if not isinstance(node, dict) or part not in node:
                return None
            node = node[part]
        return node

    job = f"job/checkpoints/{name}/print"
    figures[f"{name}: warm-pool print(1) p50 ms"] = pick(f"{job}/warm_pool/p50")
    figures[f"{name}: job with a read grant p50 ms"] = pick(f"{job}/read_grant/p50")
    figures[f"{name}: job with a read grant / warm-pool job"] = pick(f"{job}/ratios/read_grant_over_warm")
    figures[f"{name}: cold runsc + import, print(1) p50 ms"] = pick(f"{job}/cold/p50")
    figures[f"{name}: cold job / warm-pool job"] = pick(f"{job}/ratios/cold_over_warm")
    figures[f"{name}: warm-pool job / host python -c"] = pick(f"{job}/ratios/warm_over_host")
    figures[f"{name}: cold start / restore (to socket)"] = pick(f"start/checkpoints/{name}/cold_over_restore")
    figures[f"{name}: restore+destroy CPU-s"] = pick(f"start/checkpoints/{name}/restore_lifecycle_cpu_s/p50")
    figures[f"{name}: sustained jobs/s"] = pick(f"throughput/checkpoints/{name}/jobs_per_s")
    figures[f"{name}: restore-CPU bound jobs/s"] = pick(f"throughput/checkpoints/{name}/bound_jobs_per_s")
    figures[f"{name}: throughput / bound"] = pick(f"throughput/checkpoints/{name}/throughput_over_bound")
    figures[f"{name}: PSS per idle warm sandbox MB"] = pick(f"memory/checkpoints/{name}/restored/pss_mb/p50")
    figures[f"{name}: session step p50 ms"] = pick(f"session_step/checkpoints/{name}/step_ms/p50")
    figures[f"{name}: warm-pool job / session step"] = pick(f"session_step/checkpoints/{name}/warm_job_over_step")
    figures[f"{name}: warm-pool job, not warmed up / warmed up"] = pick("phases/not_warmed_over_warmed")
    figures[f"{name}: restore+destroy CPU-s, Debian 12's runsc / default"] = pick("old_runsc/old_over_new_cpu")
    hibernate = f"hibernate/checkpoints/{name}"
    figures[f"{name}: session hibernate p50 ms"] = pick(f"{hibernate}/hibernate_ms/p50")
    figures[f"{name}: step after hibernation / fresh session's first step"] = pick(f"{hibernate}/resume_over_fresh")
    figures[f"{name}: fork of a live session p50 ms"] = pick(f"{hibernate}/fork_ms/p50")
    figures[f"{name}: MB on disk per hibernated session"] = pick(f"{hibernate}/image_mb/p50")
    figures[f"{name}: session step with per-step checkpoints / without, p50"] = pick("step_checkpoint/step_over_off")
    figures[f"{name}: CPU-s per session checkpoint"] = pick("step_checkpoint/checkpoint_cpu_s")
    if pick("handover/checkpoint") == name:  # a smoke run's drains the smallest checkpoint's sessions
        figures[f"{name}: worker SIGTERM until its last idle session is in the store, p50 ms"] = pick(
            "handover/drain_to_stored_ms/p50")
        figures[f"{name}: first step after a hand-over p50 ms"] = pick("handover/first_step_ms/p50")
        figures[f"{name}: step on a live session p50 ms (beside it)"] = pick("handover/live_step_ms/p50")
        figures[f"{name}: first step after a hand-over / live step"] = pick("handover/first_over_live")
    _hot_path_figures(figures, pick)
    for arm in ("local", "routed"):
        for way in ("upload", "download"):
            figures[f"128 MiB {way} MB/s, {arm}"] = pick(f"transfers/sizes/128MiB/{arm}/{way}_mb_s")
    figures["128 MiB cp on the host MB/s"] = pick("transfers/sizes/128MiB/cp_mb_s")
    base = pick("egress/checkpoint")
    figures[f"{base}: networked print(1) / plain, both warm, p50"] = pick("egress/networked_over_plain")
    figures[f"{base}: networked print(1) p50 ms"] = pick("egress/networked_ms/p50")
    return {key: value for key, value in figures.items() if value is not None}


def _hot_path_figures(figures: dict[str, Any], pick: Callable[[str], Any]) -> None:
    """Issue 31's host-call and router asks beside their floors (``bench._floors``), one run."""
    base = pick("host_function/checkpoint") or pick("router_hop/checkpoint")  # the same: the smallest
    hop = "router_hop"
    figures[f"{base}: host call p50 ms, local"] = pick("host_function/round_trip_ms/p50")
    figures[f"{base}: host call p50 ms, through a router"] = pick(f"{hop}/host_round_trip_ms/routed/p50")
    # The ratios are scenario 8's, whose local arm takes turns with the routed one.
    figures[f"{base}: session step through a router / local, p50"] = pick(f"{hop}/session_step_ms/routed_over_local/p50")
    figures[f"{base}: host call through a router / local, p50"] = pick(f"{hop}/host_round_trip_ms/routed_over_local/p50")
    echo_us = pick("host_function/breakdown_us/sandbox_echo_us/p50")
    process_us = pick("host_function/breakdown_us/process_round_trip_us/p50")
    if echo_us is not None and process_us is not None:
        figures["floor: sandbox echo + process round trip p50 ms (a host call's least, back to back)"] = round((echo_us + process_us) / 1000, 3)
    chained_us = pick("host_function/breakdown_us/chained_call_us/p50")
    if chained_us is not None:
        figures["floor: the two chained as a call chains them p50 ms (a host call's least)"] = round(chained_us / 1000, 3)
    figures["floor: gRPC stream round trip p50 ms, settled"] = pick(f"{hop}/grpc_stream_round_trip_ms/settled/p50")
    figures["floor: gRPC stream round trip p50 ms, back to back"] = pick(f"{hop}/grpc_stream_round_trip_ms/hot/p50")
    figures["floor: session step through a router / local, p50"] = pick(f"{hop}/routed_over_local_floor/session_step")
    figures["floor: host call through a router / local, p50"] = pick(f"{hop}/routed_over_local_floor/host_call")


def write_json(result: dict[str, Any], path: Path) -> None:
    """Atomically: a reader (or a crashed run) never leaves half a file behind."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".bench-", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as file:
            json.dump(result, file, indent=2)
            file.write("\n")
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m bench.run", description="readie's benchmarks")
    parser.add_argument("--smoke", action="store_true", help="one iteration of every scenario, short windows")
    parser.add_argument("--output", default=str(DEFAULT_OUTPUT), help=f"result JSON (default {DEFAULT_OUTPUT})")
    parser.add_argument("--checkpoints", help="manifest or its directory (default $READIE_CHECKPOINTS, "
                        f"else {DEFAULT_CHECKPOINTS})")
    parser.add_argument("--only", help="comma-separated: " + ",".join(name for name, _, _ in SCENARIOS))
    parser.add_argument("--show", metavar="JSON", help="print the table of a saved run and exit")
    return parser


if __name__ == "__main__":
    sys.exit(main())
