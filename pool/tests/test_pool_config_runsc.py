"""A real pool started with a ceiling no job could be served with: lowered at start, and jobs run.

Before, `timeout = "100000000h"` loaded and then every job that got it failed with an
OverflowError from the worker's own timers (a worker error), and `memory = "64g"` turned
every job naming no memory into a RequestError. The loader's own checks are policy/tests/test_config.py.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest
from readie_protocol.requests import MAX_TIMEOUT_MS
from readie_pool.testing import PoolProcess, containers_left
from readie_worker.launchers import JOB_MEMORY_SLACK
from readie_policy.sandbox_memory import MAX_JOB_MEMORY, SANDBOX_OVERHEAD

from conftest import CHECKPOINTS


@pytest.mark.runsc
def test_a_ceiling_past_what_jobs_can_have_is_lowered_and_every_job_runs(checkpoints):
    # A worker gives a job its backstop less a checkpoint's measured share, when there is one:
    # for every checkpoint that is at least MAX_JOB_MEMORY, the bound the config lowers to.
    for name, checkpoint in checkpoints.usable.items():
        assert (checkpoint.idle_memory_bytes or 0) + JOB_MEMORY_SLACK <= SANDBOX_OVERHEAD, name
    base = Path(tempfile.mkdtemp(prefix="rpc-", dir="/tmp"))
    state = base / "state"
    (base / "readie.toml").write_text('[pool.limits]\ntimeout = "100000000h"\nmemory = "64g"\n')
    process = PoolProcess(
        ["--checkpoints", str(CHECKPOINTS), "--state-dir", str(state), "--workers", "1", "--config", "readie.toml"],
        cwd=base,
        stderr_path=base / "stderr.log",
    )
    try:
        process.ready()
        plain = process.run({"id": "plain", "code": "print(1)"})  # names no memory: gets the lowered ceiling
        assert (plain["exit"], plain["stdout"], plain["error"]) == (0, "1\n", None)
        assert (plain["policy"]["memory_bytes"], plain["policy"]["timeout_ms"]) == (MAX_JOB_MEMORY, 30_000)
        longest = process.run({"id": "longest", "code": "print(2)", "timeout": "24h"})
        assert (longest["exit"], longest["policy"]["timeout_ms"]) == (0, MAX_TIMEOUT_MS)
        past = process.run({"id": "past", "code": "print(3)", "timeout": "100000000h"})
        assert past["error"]["type"] == "RequestError" and "too large: at most 24h" in past["error"]["message"]
        assert process.close() == 0
        lowered = [line for line in process.stderr_text().splitlines() if "config value lowered" in line]
        assert len(lowered) == 2 and "pool.limits.timeout" in lowered[0] and "pool.limits.memory" in lowered[1]
    finally:
        process.stop()
        leftovers = containers_left(state)
        shutil.rmtree(base, ignore_errors=True)
    assert leftovers == []
