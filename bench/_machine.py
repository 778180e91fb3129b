"""The machine a run measured: numbers only compare between like machines."""

from __future__ import annotations

import os
import platform
import subprocess
from pathlib import Path
from typing import Any

from readie_worker import runsc as runsc_module
from readie_worker.manifest import Manifest


def describe(manifest: Manifest) -> dict[str, Any]:
    platform_flag = next((f.split("=", 1)[1] for f in manifest.runsc_flags if f.startswith("--platform=")), None)
    return {
        "cores": len(os.sched_getaffinity(0)),
        "cpu_model": _cpu_model(),
        "memory_mib": _meminfo_kb("MemTotal") // 1024,
        "kernel": platform.release(),
        "os": _os_release(),
        "runsc_version": runsc_module.version(),
        "runsc_platform": platform_flag,
        "runsc_flags": list(manifest.runsc_flags),
        "sandbox_python": manifest.python,
        "bench_python": platform.python_version(),
        "loadavg_at_start": list(os.getloadavg()),
        "commit": _commit(),
    }


def _cpu_model() -> str | None:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return None


def _meminfo_kb(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return 0


def _os_release() -> str | None:
    try:
        for line in Path("/etc/os-release").read_text().splitlines():
            if line.startswith("PRETTY_NAME="):
                return line.split("=", 1)[1].strip('"')
    except OSError:
        pass
    return None


def _commit() -> str | None:
    """HEAD of the checkout, read-only (rev-parse never writes to the repository)."""
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() or None if done.returncode == 0 else None
