"""Scenario 7: latency and throughput with 1, 2 and 4 clients; restore time vs image size.

Client counts take turns in short windows (1, 2, 4, then rotated), with the
pool settled and full before each, so every level sees the same machine. With
one client the warm sandboxes are spent after a couple of jobs and the rest
wait on the refill, so even "1 client" shows the restore-bound steady state.
"""

from __future__ import annotations

from typing import Any

from .._bench import Bench
from .._jobs import PRINT
from .._load import drive
from .._stats import ratio, summary


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    settings = bench.settings
    levels = settings.scaling_levels
    names = bench.load_names
    windows: dict[str, dict[int, list[dict[str, Any]]]] = {n: {level: [] for level in levels} for n in names}
    for cycle in range(settings.scaling_cycles):
        for name in names:
            shift = cycle % len(levels)
            for level in levels[shift:] + levels[:shift]:
                bench.settle()
                windows[name][level].append(drive(bench.warm_path(name), PRINT, level, settings.scaling_window_s))
    return {
        "scaling": {
            "what": f"print(1) through the warm pool ({settings.slots} slots), "
            f"{settings.scaling_cycles} x {settings.scaling_window_s:.0f} s windows per client count",
            "clients": {name: _levels(windows[name]) for name in names},
            "restore_vs_image_size": _restore_vs_size(done.get("start")),
        }
    }


def _levels(by_level: dict[int, list[dict[str, Any]]]) -> dict[str, Any]:
    entries: dict[str, Any] = {}
    for level, runs in by_level.items():
        latencies = [ms for run in runs for ms in run["latencies_ms"]]
        seconds = sum(run["window_s"] for run in runs)
        entries[str(level)] = {
            "latency_ms": summary(latencies),
            "jobs_per_s": round(sum(run["completed"] for run in runs) / seconds, 2) if seconds else None,
            "errors": sum(run["errors"] for run in runs),
        }
    first = entries[str(min(by_level))]
    for level, entry in entries.items():
        entry["latency_over_1"] = ratio(entry["latency_ms"], first["latency_ms"])
        entry["throughput_over_1"] = (
            round(entry["jobs_per_s"] / first["jobs_per_s"], 2) if entry["jobs_per_s"] and first["jobs_per_s"] else None
        )
    return entries


def _restore_vs_size(start: dict[str, Any] | None) -> dict[str, Any]:
    """Restore p50 against image size, from scenario 1's interleaved samples."""
    if not start:
        return {"available": False, "reason": "scenario 1 (latency) did not run"}
    points = [
        (entry["image_mb"], entry["restore_ms"]["p50"])
        for entry in start["checkpoints"].values()
        if entry["restore_ms"].get("p50") is not None
    ]
    if len(points) < 2:
        return {"available": False, "reason": "fewer than two checkpoints restored"}
    base_mb, base_ms = points[0]
    return {
        "points": [{"image_mb": mb, "restore_p50_ms": ms, "size_over_smallest": round(mb / base_mb, 2),
                    "restore_over_smallest": round(ms / base_ms, 2)} for mb, ms in points],
        # Least squares: what each extra MB of image costs, and what restoring nothing costs.
        **_fit(points),
    }


def _fit(points: list[tuple[float, float]]) -> dict[str, float | None]:
    n = len(points)
    mean_x = sum(x for x, _ in points) / n
    mean_y = sum(y for _, y in points) / n
    spread = sum((x - mean_x) ** 2 for x, _ in points)
    if not spread:
        return {"ms_per_mb": None, "intercept_ms": None}
    slope = sum((x - mean_x) * (y - mean_y) for x, y in points) / spread
    return {"ms_per_mb": round(slope, 2), "intercept_ms": round(mean_y - slope * mean_x, 1)}
