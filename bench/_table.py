"""The printed report, rendered from the result JSON alone, so a saved run reprints
identically (``python -m bench.run --show build/bench/latest.json``)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def render(result: dict[str, Any]) -> str:
    out: list[str] = []
    machine = result.get("machine", {})
    out.append(
        f"readie bench ({result.get('mode')}), {result.get('started_at')}, {result.get('duration_s')} s; "
        f"{machine.get('cores')} cores, {machine.get('memory_mib', 0) / 1024:.1f} GiB, kernel {machine.get('kernel')}, "
        f"{machine.get('runsc_version')}, platform {machine.get('runsc_platform')}, "
        f"load {_load(machine.get('loadavg_at_start'))} -> {_load(result.get('loadavg_at_end'))}"
    )
    scenarios = result.get("scenarios", {})
    for title, key, section in (
        ("1. sandbox ready to run, ms p50 (p95)", "start", _start),
        ("2. one job end to end, ms p50 (p95)", "job", _job),
        ("3. sustained throughput", "throughput", _throughput),
        ("4. session step latency, ms p50 (p95)", "session_step", _sessions),
        ("5. host-function round trip", "host_function", _host_function),
        ("6. memory per idle sandbox, MB", "memory", _memory),
        ("7. scaling: print(1) through the warm pool, ms p50 (p95)", "scaling", _scaling),
        ("8. router hop: readie pool local vs --router, ms p50 (p95)", "router_hop", _router_hop),
        ("9. a warm-pool job's and a session step's phases, ms p50 (p95), in process", "phases", _phases),
        ("10. Debian 12's runsc beside the default one", "old_runsc", _old_runsc),
        ("11. streamed output, ms p50 (p95)", "stream", _stream),
        ("12. soak: what the pool holds as jobs and sessions go by", "soak", _soak),
        ("13. session hibernation: hibernate, resume, fork, ms p50 (p95); image and memory, MB p50", "hibernate",
         _hibernate),
        ("14. files into and out of a session, MB/s (and of cp on the host)", "transfers", _transfers),
        ("16. drain hand-over: a worker's SIGTERM until its sessions are in the store, and the step after, "
         "ms p50 (p95)", "handover", _handover),
        ("17. a networked print(1) beside a plain one, both warm, ms p50 (p95)", "egress", _egress),
    ):
        entry = scenarios.get(key)
        out.append("")
        if entry is None:
            out.append(f"{title}: not run")
        elif entry.get("available") is False or "error" in entry:
            out.append(f"{title}: not available: {entry.get('reason') or entry.get('error')}")
        else:
            out.append(title)
            out.extend(section(entry))
    figures = result.get("key_figures") or {}
    if figures:
        out.append("")
        out.append("key figures")
        width = max(len(k) for k in figures)
        out.extend(f"  {k.ljust(width)}  {v}" for k, v in figures.items())
    settle = result.get("settle") or {}
    if settle.get("timeouts"):
        out.append(f"\nnote: the machine did not settle {settle['timeouts']} times (someone else's load?)")
    return "\n".join(out)


def _start(entry: dict[str, Any]) -> list[str]:
    rows = [
        [name, e["image_mb"], _ms(e["restore_ms"]), _ms(e["cold_ms"]), _x(e["cold_over_restore"]),
         _p50(e["restore_cpu_s"]), _p50(e["cold_cpu_s"]), _p50(e["restore_lifecycle_cpu_s"]),
         _ms(e.get("destroy_ms"))]
        for name, e in entry["checkpoints"].items()
    ]
    return _grid(["checkpoint", "image MB", "restore", "cold", "cold/restore", "CPU-s restore",
                  "CPU-s cold", "CPU-s restore+destroy", "destroy"], rows)


def _job(entry: dict[str, Any]) -> list[str]:
    rows = []
    for name, kinds in entry["checkpoints"].items():
        for kind, e in kinds.items():
            r = e["ratios"]
            rows.append([name, kind, _ms(e["warm_pool"]), _ms(e["read_grant"]), _ms(e["empty_pool"]), _ms(e["cold"]),
                         _ms(e["host"]), _x(r["read_grant_over_warm"]), _x(r["cold_over_warm"]), _x(r["empty_over_warm"]),
                         _x(r["warm_over_host"])])
    via = entry["via"]
    warm_via = sorted(set(via["warm_pool"].values()))
    lines = _grid(["checkpoint", "job", "warm pool", "read grant", "empty pool", "cold runsc", "host python",
                   "grant/warm", "cold/warm", "empty/warm", "warm/host"], rows)
    lines.append(f"  warm pool via {', '.join(warm_via)}; empty pool via {via['empty_pool']}")
    return lines


def _throughput(entry: dict[str, Any]) -> list[str]:
    rows = [
        [name, e["jobs_per_s"], e["bound_jobs_per_s"], _x(e["throughput_over_bound"]),
         _p50(e["cpu_s_per_restore_and_destroy"]), _ms(e["latency_ms"]), e.get("ours_busy"), e.get("others_busy"),
         _x(e.get("throughput_over_bound_given_others")), _split(e.get("cpu_s_per_job")), e["errors"]]
        for name, e in entry["checkpoints"].items()
    ]
    lines = _grid(["checkpoint", "jobs/s", "bound jobs/s", "ratio", "CPU-s/restore+destroy", "latency ms",
                   "busy: ours", "others", "ratio on cores left", "CPU-s/job: bench+pool py+sandboxes",
                   "errors"], rows)
    lines.append(f"  {entry['what']}")
    return lines


def _split(per_job: dict[str, float] | None) -> str:
    if not per_job:
        return "-"
    return f"{per_job['bench']:.3f}+{per_job['pool_python']:.3f}+{per_job['sandboxes']:.3f}"


def _sessions(entry: dict[str, Any]) -> list[str]:
    rows = [
        [name, e["first_step_ms"], _ms(e["step_ms"]), _ms(e["warm_job_ms"]), _x(e["warm_job_over_step"])]
        for name, e in entry["checkpoints"].items()
    ]
    lines = _grid(["checkpoint", "first step", "step", "warm-pool job", "job/step"], rows)
    lines.append(f"  {entry['what']}")
    return lines


def _host_function(entry: dict[str, Any]) -> list[str]:
    figure = entry["round_trip_ms"]
    lines = [f"  {entry['what']} ({entry['checkpoint']}): p50 {figure.get('p50')} ms, "
             f"p95 {figure.get('p95')} ms, n {figure.get('n')}"]
    split = entry.get("breakdown_us", {})
    if "in_sandbox_p50" in split:
        parts = ", ".join(f"{part} {us}" for part, us in split["in_sandbox_p50"].items())
        lines.append(f"  in the sandbox, µs p50: {parts}; pool and client alone (no sandbox): "
                     f"p50 {split['pool_and_client'].get('p50')} µs")
        if "sandbox_echo_us" in split:
            lines.append(f"  floors, p50 µs: a byte into a sandbox and back {_floor(split['sandbox_echo_us'])}, "
                         f"to a child process and back {_floor(split['process_round_trip_us'])}, "
                         f"the two chained as a call chains them {_floor(split.get('chained_call_us', {}))}")
    elif split:
        lines.append(f"  breakdown: {split.get('reason')}")
    return lines


def _stream(entry: dict[str, Any]) -> list[str]:
    return [f"  {entry['what']} ({entry['checkpoint']}): plain {_ms(entry['plain_ms'])}, stream "
            f"{_ms(entry['stream_ms'])}, stream/plain {_x(entry['stream_over_plain'])}, "
            f"{entry['output_events_per_job']} events a job"]


def _soak(entry: dict[str, Any]) -> list[str]:
    rows = [
        [
            sample["jobs_done"], sample["sessions_done"], f"{sample['elapsed_s']:.0f}",
            sample["processes"]["pool"]["fds"], sample["processes"]["pool"]["threads"],
            f"{sample['processes']['pool']['rss_kib'] / 1024:.1f}",
            sample["containers"], sample["sandbox_dirs"], sample["cgroups"], sample["empty_cgroups"], sample["netns"],
        ]
        for sample in entry["curve"]
    ]
    headers = ("jobs", "sessions", "s", "fds", "threads", "RSS MiB", "containers", "sandbox dirs", "cgroups", "empty", "netns")
    failures = f", {len(entry['failures'])} failed requests (first: {entry['failures'][0]})" if entry["failures"] else ""
    return [f"  {entry['what']}{failures}; first and last rows at rest", *_grid(headers, rows)]


def _hibernate(entry: dict[str, Any]) -> list[str]:
    times, forks = [], []
    for name, e in entry["checkpoints"].items():
        times.append([name, _ms(e["hibernate_ms"]), _ms(e["resume_step_ms"]), _ms(e["resumed_ms"]),
                      _ms(e["checkpoint_restore_ms"]), _x(e["resumed_over_restore"]), _ms(e["fresh_first_step_ms"]),
                      _x(e["resume_over_fresh"]), _x(e["resume_over_fresh_paired"])])
        forks.append([name, _ms(e["fork_ms"]), _ms(e["fork_of_hibernated_ms"], 1), _ms(e["fork_first_step_ms"]),
                      _p50(e["image_mb"]), _p50(e["image_disk_mb"]), _p50(e["session_pss_mb"]),
                      _p50(e["freed_pss_mb"])])
    errors = [error for e in entry["checkpoints"].values() for error in e["errors"]]
    note = f"; errors (first: {errors[0]})" if errors else ""
    return [
        *_grid(["checkpoint", "hibernate", "resume step", "of it restore", "checkpoint restore", "ratio",
                "fresh 1st step", "resume/fresh", "paired"], times),
        *_grid(["checkpoint", "fork", "fork of hibernated", "fork's 1st step", "image MB", "on disk",
                "session PSS", "PSS freed"], forks),
        f"  {entry['what']}; containers left: {entry['containers_left']}{note}",
    ]


def _handover(entry: dict[str, Any]) -> list[str]:
    row = [entry["sessions_per_drain"], _ms(entry["drain_to_stored_ms"]), _ms(entry["drain_to_exit_ms"]),
           _ms(entry["attach_ms"]), _ms(entry["first_step_ms"]), _ms(entry["resumed_ms"]), _ms(entry["live_step_ms"]),
           _x(entry["first_over_live"]), _x(entry["first_over_live_paired"])]
    note = f"; errors (first: {entry['errors'][0]})" if entry["errors"] else ""
    return [
        *_grid(["sessions", "SIGTERM to stored", "to exit", "attach", "1st step after", "of it restore", "live step",
                "1st/live", "paired"], [row]),
        f"  {entry['what']}; store entries left: {entry['store_entries_left']}, workers left: "
        f"{entry['workers_left']}{note}",
    ]


def _egress(entry: dict[str, Any]) -> list[str]:
    row = [entry["checkpoint"], _ms(entry["plain_ms"]), _ms(entry["networked_ms"]), _x(entry["networked_over_plain"]),
           _x(entry["networked_over_plain_paired"])]
    note = f"; errors (first: {entry['errors'][0]})" if entry["errors"] else ""
    return [
        *_grid(["checkpoint", "plain", "networked", "networked/plain", "paired"], [row]),
        f"  {entry['what']}; warm hits {entry['warm_hits']}, wiring left: {entry['wiring_left']}{note}",
    ]


def _transfers(entry: dict[str, Any]) -> list[str]:
    rows = [
        [size, e["cp_mb_s"], e["local"]["upload_mb_s"], e["local"]["download_mb_s"], e["routed"]["upload_mb_s"],
         e["routed"]["download_mb_s"], _x(e["local"]["upload_over_cp"]), _x(e["routed"]["upload_over_cp"])]
        for size, e in entry["sizes"].items()
    ]
    return [
        *_grid(["size", "cp", "local up", "local down", "routed up", "routed down", "local up/cp", "routed up/cp"], rows),
        f"  {entry['what']}",
    ]


def _memory(entry: dict[str, Any]) -> list[str]:
    rows = []
    for name, e in entry["checkpoints"].items():
        cold, host = e.get("cold") or {}, e.get("host_python") or {}
        rows.append([name, _p50(e["restored"]["rss_mb"]), _p50(e["restored"]["pss_mb"]),
                     _p50(e["restored"]["gofer_pss_mb"]), cold.get("pss_mb"), host.get("pss_mb"),
                     _x(e["restored_over_cold_pss"]), _x(e["restored_over_host_pss"])])
    lines = _grid(["checkpoint", "restored RSS", "restored PSS", "of it gofer", "cold PSS", "host python PSS",
                   "restored/cold", "restored/host"], rows)
    lines.append(f"  {entry['what']}")
    return lines


def _scaling(entry: dict[str, Any]) -> list[str]:
    rows = []
    for name, levels in entry["clients"].items():
        for level, e in levels.items():
            rows.append([name, level, _ms(e["latency_ms"]), e["jobs_per_s"], _x(e["latency_over_1"]),
                         _x(e["throughput_over_1"]), e["errors"]])
    lines = _grid(["checkpoint", "clients", "latency", "jobs/s", "latency vs 1", "jobs/s vs 1", "errors"], rows)
    size = entry.get("restore_vs_image_size") or {}
    if size.get("points"):
        points = ", ".join(f"{p['image_mb']} MB {p['restore_p50_ms']} ms" for p in size["points"])
        lines.append(f"  restore vs image size: {points}; fit {size['ms_per_mb']} ms/MB + {size['intercept_ms']} ms")
    return lines


def _router_hop(entry: dict[str, Any]) -> list[str]:
    rows = []
    for label, key, digits in (("session step", "session_step_ms", 1), ("host-function call", "host_round_trip_ms", 3)):
        e = entry[key]
        r = e["routed_over_local"]
        rows.append([label, _ms(e["local"], digits), _ms(e["routed"], digits), _x(r["p50"]), _x(r["p95"]),
                     _x(r["paired"])])
    lines = _grid(["figure", "local", "routed", "routed/local p50", "p95", "paired"], rows)
    first = entry["session_first_step_ms"]
    lines.append(f"  {entry['what']} ({entry['checkpoint']}); "
                 f"first step {first.get('local')} / {first.get('routed')} ms")
    if "routed_over_local_floor" in entry:
        floor = entry["routed_over_local_floor"]
        stream = entry["grpc_stream_round_trip_ms"]
        lines.append(f"  floor: a gRPC stream round trip p50 {_floor(stream.get('settled', {}))} ms settled, "
                     f"{_floor(stream.get('hot', {}))} back to back; routed/local if each hop cost that alone: "
                     f"step {_x(floor.get('session_step'))}, call {_x(floor.get('host_call'))}")
    return lines


def _floor(figure: dict[str, Any]) -> Any:
    """A floor's p50, or why it has none."""
    return figure.get("p50", f"none ({figure.get('error', 'not measured')})")


def _phases(entry: dict[str, Any]) -> list[str]:
    parts = ("acquire_ms", "runner_ms", "code_ms", "worker_ms")
    rows = [
        [arm, _ms(e.get("total_ms"), 1), *(_ms(e.get(part), 2) for part in parts)]
        for arm, e in entry["arms"].items()
    ]
    # The runner's own phases and the worker's around the exchange, p50 ms, an arm a line.
    finer = [
        f"  {arm}: " + "; ".join(
            f"{group} " + ", ".join(f"{phase} {ms}" for phase, ms in e.get(f"{group}_phases_p50_ms", {}).items())
            for group in ("runner", "worker")
        )
        for arm, e in entry["arms"].items()
    ]
    return [
        *_grid(["arm", "total", "acquire", "runner", "code", "worker"], rows),
        f"  {entry['checkpoint']}: not warmed up / warmed up {_x(entry.get('not_warmed_over_warmed'))}",
        *finer,
    ]


def _old_runsc(entry: dict[str, Any]) -> list[str]:
    rows = [
        [arm, e["runsc_version"], e["platform"], e["image_mb"], _ms(e["ready_ms"]), _p50(e["lifecycle_cpu_s"]),
         _ms(e["warm_job_ms"], 1)]
        for arm, e in entry["arms"].items()
    ]
    return [
        *_grid(["arm", "runsc", "platform", "image MB", "restore", "CPU-s restore+destroy", "warm job"], rows),
        f"  {entry['checkpoint']}: old / new restore+destroy CPU {_x(entry.get('old_over_new_cpu'))}, "
        f"warm job {_x(entry.get('old_over_new_job'))}",
    ]


def _grid(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> list[str]:
    cells = [list(map(str, headers))] + [["-" if v is None else str(v) for v in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    return ["  " + "  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]


def _ms(s: dict[str, Any] | None, digits: int = 0) -> str:
    if not s or not s.get("n"):
        return "-"
    return f"{s['p50']:.{digits}f} ({s['p95']:.{digits}f})" if s["n"] > 1 else f"{s['p50']:.{digits}f}"


def _p50(s: dict[str, Any] | None) -> Any:
    return s.get("p50") if s else None


def _x(value: float | None) -> str:
    return "-" if value is None else f"{value}x"


def _load(values: Sequence[float] | None) -> str:
    return "/".join(f"{v:.1f}" for v in values) if values else "?"
