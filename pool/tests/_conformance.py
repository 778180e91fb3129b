"""What the ``test_pool_conformance_*`` modules share: pools of their own and the spec's lines.

A ``Pool`` is the real ``readie pool`` process, over pipes, in a project
dir and a runsc state dir of its own, checked clean at the end. The
expected lines of the pool protocol spec (pool-protocol.txt, "pynox" read
as "readie") are written out here rather than built by the router's own
code. Each test module imports the fixtures it uses.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from readie_worker.testing import runsc_in
from readie_pool.testing import PoolProcess, pool_placement
from readie_worker.manifest import read_manifest

from conftest import CHECKPOINTS

MANIFEST = CHECKPOINTS / "manifest.json"
MIB = 1024 * 1024
# The spec's result keys, in the spec's order.
RESULT_KEYS = [
    "id",
    "exit",
    "stdout",
    "stderr",
    "error",
    "stdout_truncated",
    "stderr_truncated",
    "duration_ms",
    "duration_us",
    "queue_us",
    "runtime",
    "policy",
]
POLICY_KEYS = [
    "allow_read",
    "allow_write",
    "network",
    "subprocesses",
    "timeout_ms",
    "memory_bytes",
    "backend",
]
RESTORED = "gvisor:runsc-restore"
APP_PY = """import os, sys
print(sys.argv[1:], os.environ["KEY"])
print(open("data/orders.csv").read().count("tea"))
"""
BROKEN_PY = "x = 1\n\nraise ValueError('bad value')\n"


CONFIG = """
[pool]
workers = 1

[pool.limits]
allow_read = ["../data"]
allow_write = ["../out"]
allow_network = false
timeout = "10s"
memory = "1g"
max_output = 1048576
max_file_size = "64k"

[profiles.analysis]
allow_read = ["../data"]
allow_write = ["../out"]
env = { MODE = "analysis" }

[profiles.fetch]
allow_network = true
"""


# --------------------------------------------------------------------------- fixtures and helpers


@pytest.fixture(scope="module")
def python_version(checkpoints) -> str:
    # `checkpoints` (conftest) fails loudly when the checkpoints are stale.
    version = read_manifest(MANIFEST).python
    assert re.fullmatch(r"3\.\d+\.\d+", version)
    return version


def make_project(root: Path) -> Path:
    for name in ("data", "out", "secret", "cfg"):
        (root / name).mkdir(parents=True)
    (root / "data" / "orders.csv").write_text("product,amount\ntea,3\ncake,5\ntea,4\n")
    (root / "app.py").write_text(APP_PY)
    (root / "broken.py").write_text(BROKEN_PY)
    (root / "cfg" / "readie.toml").write_text(CONFIG)
    return root


class Pool:
    """A PoolProcess in its own project dir and runsc state dir, checked clean at the end."""

    def __init__(self, *args: str, project: Path | None = None) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="rpc-", dir="/tmp"))
        self.project = project or make_project(self.base / "project")
        self.state = self.base / "state"
        self.process = PoolProcess(
            ["--checkpoints", str(CHECKPOINTS), "--state-dir", str(self.state), *args],
            cwd=self.project,
            stderr_path=self.base / "stderr.log",
        )

    def containers(self) -> list[str]:
        return runsc_in(self.state).list_ids()

    def cleanup(self) -> None:
        self.process.stop()
        leftovers = self.containers()
        if leftovers:
            runsc_in(self.state).sweep()
        shutil.rmtree(self.base, ignore_errors=True)
        assert leftovers == [], f"readie pool left runsc containers: {leftovers}"


@contextmanager
def placed_pool(kind: str, prefix: str, *args: str) -> Iterator[Pool]:
    """A ready :class:`Pool` placing its jobs the ``kind`` way (``pool_placement``: its own worker, or a
    router over two), closed cleanly and checked free of containers afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    try:
        with pool_placement(kind, base, MANIFEST) as placement:
            made = Pool(*args, *placement)
            made.process.ready()
            yield made
            assert made.process.close() == 0
            made.cleanup()
    finally:
        shutil.rmtree(base, ignore_errors=True)


def ready_event(
    workers: int, config: str | None = None, profiles: list[str] | None = None
) -> dict[str, Any]:
    return {
        "event": "ready",
        "workers": workers,
        "runtime": "readie",
        "preloaded_modules": [],
        "package_dirs": [],
        "config": config,
        "profiles": profiles or [],
        "protocol": 1,
    }


def runtime(python: str) -> dict[str, Any]:
    return {"name": "readie", "python": python, "mode": "pool", "preloaded_modules": []}


def policy(
    *, read=(), write=(), timeout_ms=30000, memory_bytes=None, backend=RESTORED
) -> dict[str, Any]:
    return {
        "allow_read": [str(p) for p in read],
        "allow_write": [str(p) for p in write],
        "network": "deny",
        "subprocesses": "deny",
        "timeout_ms": timeout_ms,
        "memory_bytes": memory_bytes,
        "backend": backend,
    }


def check_result(result: dict[str, Any], expected: dict[str, Any]) -> None:
    """Every field: ``expected`` holds all but the three timings, which are checked for shape.

    ``value`` (readie's, after the spec's keys) is there when inline code ends with an expression."""
    assert list(result) == RESULT_KEYS + (["value"] if "value" in result else []), result
    if result["policy"] is not None:
        assert list(result["policy"]) == POLICY_KEYS
    timings = {k: result[k] for k in ("duration_ms", "duration_us", "queue_us")}
    assert all(type(v) is int and v >= 0 for v in timings.values()), timings
    assert timings["duration_ms"] == timings["duration_us"] // 1000
    rest = {k: v for k, v in result.items() if k not in timings}
    assert rest == expected, json.dumps(result, indent=1)


def refusal(rid: Any, message: str, python: str) -> dict[str, Any]:
    return {
        "id": rid,
        "exit": -1,
        "stdout": "",
        "stderr": "",
        "error": {"type": "RequestError", "message": message, "file": None, "line": None},
        "stdout_truncated": False,
        "stderr_truncated": False,
        "runtime": runtime(python),
        "policy": None,
    }


def check_refusal(result: dict[str, Any], rid: Any, message: str, python: str) -> None:
    check_result(result, refusal(rid, message, python))
    assert (result["duration_us"], result["queue_us"]) == (0, 0)


def by_id(results: list[dict[str, Any]]) -> dict[Any, dict[str, Any]]:
    mapping = {r["id"]: r for r in results}
    assert len(mapping) == len(results), "ids answered twice"
    return mapping
