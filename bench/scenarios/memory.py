"""Scenario 6: host memory per idle warm sandbox, per checkpoint.

Several restored sandboxes of one checkpoint sit idle at once (as in a warm
pool), next to one cold-started sandbox and a host Python with the same
imports (the floor). Each sandbox's figure sums smaps_rollup over its
runsc-sandbox, runsc-gofer and their descendants (the platform's stub processes).
"""

from __future__ import annotations

import subprocess
import time
from typing import Any

from readie_worker.errors import ReadieError
from readie_worker.sandbox import Sandbox

from .._bench import Bench
from .._procs import cmdline, memory_kb, processes, sandbox_pids
from .._stats import summary

# After the socket answers, a sandbox still faults in pages for a moment.
IDLE_SETTLE_S = 1.0


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    entries = {}
    for name in bench.load_names:
        bench.settle()
        entries[name] = _measure(bench, name)
    return {
        "memory": {
            "what": "host RSS and PSS (MB) per idle sandbox: sentry + stubs + gofer; "
            f"{bench.settings.memory_sandboxes} restored sandboxes of a checkpoint alive at once",
            "checkpoints": entries,
        }
    }


def _measure(bench: Bench, name: str) -> dict[str, Any]:
    restored: list[Sandbox] = []
    cold: Sandbox | None = None
    host: subprocess.Popen[str] | None = None
    errors = []
    try:
        for _ in range(bench.settings.memory_sandboxes):
            restored.append(bench.restore_factory(name).create())
        try:
            cold = bench.cold_factory(name).create() if bench.settings.memory_cold else None
        except ReadieError as exc:
            errors.append(f"cold start: {exc}")
        host = _idle_host_python(bench, name)
        bench.settle()
        time.sleep(IDLE_SETTLE_S)
        table = processes()
        per_restored = [_sandbox_memory(s.id, table) for s in restored]
        per_cold = _sandbox_memory(cold.id, table) if cold is not None else None
        host_mem = _mb(memory_kb([host.pid])) if host is not None else None
    finally:
        for sandbox in [*restored, *([cold] if cold else [])]:
            sandbox.destroy()
        if host is not None:
            host.kill()
            host.wait()
    restored_pss = summary([m["pss_mb"] for m in per_restored])
    return {
        "restored": {
            "rss_mb": summary([m["rss_mb"] for m in per_restored]),
            "pss_mb": restored_pss,
            "gofer_pss_mb": summary([m["gofer_pss_mb"] for m in per_restored]),
            "processes": per_restored[0]["processes"] if per_restored else None,
        },
        "cold": per_cold,
        "host_python": host_mem,
        "restored_over_cold_pss": _over(restored_pss, per_cold),
        "restored_over_host_pss": _over(restored_pss, host_mem),
        "errors": errors,
    }


def _sandbox_memory(sandbox_id: str, table: dict) -> dict[str, Any]:
    pids = sandbox_pids(sandbox_id, table)
    gofer = [pid for pid in pids if cmdline(pid).startswith(b"runsc-gofer")]
    total, gofer_mem = _mb(memory_kb(pids)), _mb(memory_kb(gofer))
    return {**total, "gofer_pss_mb": gofer_mem["pss_mb"], "processes": len(pids)}


def _idle_host_python(bench: Bench, name: str) -> subprocess.Popen[str] | None:
    """The host floor: the same interpreter and imports, blocked on stdin like an idle executor."""
    path = bench.host_path(name)
    code = "import sys\nsys.stdout.write('ready\\n'); sys.stdout.flush(); sys.stdin.read()\n"
    process = subprocess.Popen(
        path.command(code), env=path.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert process.stdout is not None
    if process.stdout.readline() != "ready\n":  # written after the imports, or EOF if they failed
        process.kill()
        process.wait()
        return None
    return process


def _over(restored_pss: dict[str, Any], other: dict[str, Any] | None) -> float | None:
    if other is None or not other["pss_mb"] or "p50" not in restored_pss:
        return None
    return round(restored_pss["p50"] / other["pss_mb"], 2)


def _mb(kb: dict[str, int]) -> dict[str, float]:
    return {"rss_mb": round(kb["rss_kb"] / 1024, 1), "pss_mb": round(kb["pss_kb"] / 1024, 1)}
