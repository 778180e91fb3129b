"""One log schema (decision 0021): every line a worker, a router and a pool write with ``--log=json``.

Each is a JSON object that starts with ``ts_ms`` and ``event`` and ends with
``level`` and ``process``; the pool's per-job line is one of them. The
processes are real: two workers and a router under runsc, and a ``readie pool``.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from readie_rpc.stubs import worker_pb2 as pb
from readie_rpc.testing import start_cluster
from readie_policy.logs import LEVELS

from conftest import CHECKPOINTS
from pool.tests._conformance import Pool

pytestmark = pytest.mark.runsc


def check_schema(text: str, process: str) -> list[dict]:
    """Every line of ``text`` in the schema, written by ``process``; returns them parsed."""
    lines = []
    now_ms = time.time() * 1000
    for raw in text.splitlines():
        line = json.loads(raw)  # a line that is not JSON fails here, naming it
        assert list(line)[:2] == ["ts_ms", "event"] and list(line)[-2:] == ["level", "process"], raw
        assert isinstance(line["ts_ms"], int) and abs(line["ts_ms"] - now_ms) < 600_000, raw
        assert isinstance(line["event"], str) and line["level"] in LEVELS, raw
        assert line["process"] == process, raw
        lines.append(line)
    assert lines, f"{process} wrote no line"
    return lines


def test_worker_and_router_lines_share_one_schema(checkpoints):
    base = Path(tempfile.mkdtemp(prefix="rls-", dir="/tmp"))
    cluster = start_cluster(base, CHECKPOINTS / "manifest.json", workers=1, router_args=["--log=json"])
    try:
        reply = cluster.stub.RunJob(pb.RunJobRequest(checkpoint="base", code="print(1)"), timeout=30)
        assert reply.stdout == "1\n"
    finally:
        cluster.stop()
    try:
        routed = check_schema(cluster.log_path.read_text(), "router")
        worked = check_schema(cluster.workers[0].log_path.read_text(), "worker")
        assert any(line["event"] == "router serving" for line in routed)
        assert any(line["event"] == "job" for line in worked)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_the_pools_job_line_is_in_the_schema_too(checkpoints):
    pool = Pool("--workers", "1", "--log=json")
    try:
        pool.process.ready()
        assert pool.process.run({"id": "j", "code": "print(2)"})["stdout"] == "2\n"
        assert pool.process.close() == 0
        lines = check_schema(pool.process.stderr_text(), "pool")
        jobs = [line for line in lines if line["event"] == "job"]
        assert [(line["id"], line["exit"], line["level"]) for line in jobs] == [("j", 0, "info")]
    finally:
        pool.cleanup()
