"""Issue 32 through `readie pool`: the operator's `[pool] egress_netns` / `egress_dns` and a
ceiling of destinations; a job and a session step reach what their list allows, are refused
the rest (told in the result's `network`), a request beyond the ceiling is a RequestError
before anything runs, and after the pool exits none of its wiring is left.

The egress namespace and the world behind it are the tests' own (worker/tests/_egress_world.py),
behind host blackhole routes for every test address."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import pytest

from readie_pool.testing import PoolProcess, containers_left
from worker.tests import _egress_world as w

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

CONFIG = f"""
[pool]
egress_netns = "{w.EGRESS}"
egress_dns = ["{w.UPSTREAM_DNS}"]

[pool.limits]
allow_network = ["10.199.1.0/24:{w.PORT}", "allowed.test"]
"""
# One connect, as a job's library would: an error name, or "ok".
CONNECT = """
import socket
def reach(host, port):
    try:
        socket.create_connection((host, port), timeout=5).close()
        return "ok"
    except OSError as exc:
        return type(exc).__name__
"""


def test_a_pool_with_egress_serves_a_job_and_a_session_by_their_lists_and_leaves_nothing():
    base = Path(tempfile.mkdtemp(prefix="rpe-", dir="/tmp"))
    state = base / "state"
    (base / "readie.toml").write_text(CONFIG)
    with w.world():
        process = PoolProcess(
            ["--checkpoints", str(CHECKPOINTS), "--state-dir", str(state), "--workers", "1", "--config", "readie.toml"],
            cwd=base, stderr_path=base / "stderr.log",
        )
        try:
            process.ready()
            job = process.run({
                "id": "job", "allow_network": True,  # true: what the ceiling allows
                "code": CONNECT + f"print(reach('allowed.test', {w.PORT}), reach({w.METADATA!r}, 80))",
            })
            assert (job["exit"], job["stdout"]) == (0, "ok ConnectionRefusedError\n"), job
            assert job["network"]["refused"] == [{"address": w.METADATA, "port": 80, "count": 1}], job["network"]
            assert job["network"]["allowed_connections"] == 1
            beyond = process.run({"id": "beyond", "allow_network": ["denied.test"], "code": "print(1)"})
            assert beyond["error"]["type"] == "RequestError" and beyond.get("network") is None, beyond
            opened = process.run({"id": "s1", "session": "net", "allow_network": [f"{w.ALLOWED}:{w.PORT}"], "code": CONNECT})
            assert opened["exit"] == 0, opened
            step = process.run({"id": "s2", "session": "net", "code": f"print(reach({w.ALLOWED!r}, {w.PORT}), reach({w.DENIED!r}, {w.PORT}))"})
            assert (step["stdout"], step["network"]["refused_connections"]) == ("ok ConnectionRefusedError\n", 1), step
            plain = process.run({"id": "plain", "code": "print(1)"})
            assert plain["exit"] == 0 and "network" not in plain
            assert process.close() == 0
        finally:
            process.stop()
            leftovers = containers_left(state)
            shutil.rmtree(base, ignore_errors=True)
        assert leftovers == []
        assert w.leftovers("rdie", "readie") == []  # namespaces, veths, chains, sets, the table
