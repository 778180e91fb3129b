"""What the ``test_jobs_*`` modules share: code jobs run in a fresh ``python -c`` child.

run_job changes process-wide state that cannot be undone (rlimits, a seccomp
filter, an audit hook), so every job runs in a child that reads a JSON list
of jobs on stdin and prints one result per line; ``job`` builds a job spec,
with defaults for the fields a test leaves out.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Any

from readie_executor.jobs._bounds import RUNNER_PHASES

CHILD_TIMEOUT_SECONDS = 30
RESULT_KEYS = {
    "exit",
    "system_exit",
    "timed_out",
    "stdout",
    "stderr",
    "stdout_truncated",
    "stderr_truncated",
    "error",
    "duration_us",
    "preloaded_modules",
    "python",
    "policy_notes",
    "value",
}
# Reads a JSON list of jobs on stdin, runs them in order, writes one result per line on stdout.
CHILD = """
import json, os, sys
from readie_executor.jobs import dedicate_stdio, run_job
jobs = json.load(sys.stdin)
results = os.fdopen(os.dup(1), "wb")  # fds 0, 1 and 2 are the jobs' from here on, as in the executor
dedicate_stdio()
for job in jobs:
    results.write(run_job(job) + b"\\n")
    results.flush()
"""


def job(code: str | None = None, **fields: Any) -> dict[str, Any]:
    limits = {
        "memory_bytes": None,
        "max_file_size": None,
        "max_output": 65536,
        "subprocesses": False,
    }
    limits.update(fields.pop("limits", {}))
    spec: dict[str, Any] = {
        "name": "step.py",
        "args": [],
        "env": {},
        "links": [],
        "limits": limits,
        "session": False,
    }
    if code is not None:
        spec["code"] = code
    spec.update(fields)
    return spec


def run_in_child(*jobs: dict[str, Any], env: dict[str, str] | None = None) -> list[dict[str, Any]]:
    child_env = {**os.environ, **(env or {})}
    done = subprocess.run(
        [sys.executable, "-c", CHILD],
        input=json.dumps(jobs).encode(),
        capture_output=True,
        env=child_env,
        timeout=CHILD_TIMEOUT_SECONDS,
    )
    assert done.returncode == 0, done.stderr.decode(errors="replace")
    lines = done.stdout.splitlines()
    assert len(lines) == len(jobs), done.stdout
    results = [json.loads(line) for line in lines]
    for result in results:
        # "phases" is optional: a job that did not start has none.
        assert set(result) - {"phases"} == RESULT_KEYS
        phases = result.get("phases", {})
        assert set(phases) <= set(RUNNER_PHASES) and all(type(us) is int and us >= 0 for us in phases.values())
    return results


def run_one(code: str, **fields: Any) -> dict[str, Any]:
    return run_in_child(job(code, **fields))[0]
