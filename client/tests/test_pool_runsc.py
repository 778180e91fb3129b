"""``readie.Pool`` driving a real ``readie pool``: jobs in gVisor sandboxes restored from the checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import readie
from readie.testing import temp_pool

from conftest import CHECKPOINTS, REPO

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module")
def pool():
    with temp_pool(workers=2, checkpoints=CHECKPOINTS) as pool:
        (pool.cwd / "data").mkdir()
        (pool.cwd / "data" / "orders.csv").write_text("product,amount\ntea,3\ncake,5\ntea,4\n")
        (pool.cwd / "out").mkdir()
        yield pool
    # temp_pool's close checked that the pool drained and exited 0


def test_a_job_and_what_its_result_says(pool):
    result = pool.run("import sys\nprint(sys.version_info[:2])")
    assert result.ok and result.stdout == "(3, 11)\n" and result.error is None
    assert result.runtime.name == "readie" and result.runtime.python.startswith("3.11.")
    assert result.policy.backend.startswith("gvisor:") and result.policy.network == "deny"
    assert result.duration_us > 0 and result.duration_ms == result.duration_us // 1000
    assert pool.ready.workers == 2 and pool.ready.runtime == "readie"


def test_grants_relative_to_the_pools_directory(pool):
    code = (
        "import csv\n"
        "rows = list(csv.DictReader(open('data/orders.csv')))\n"
        "total = sum(int(r['amount']) for r in rows if r['product'] == 'tea')\n"
        "open('out/tea.txt', 'w').write(str(total))\n"
        "print(total)\n"
    )
    result = pool.run(code, allow_read=["data"], allow_write=["out"]).raise_for_error()
    assert result.stdout == "7\n"
    assert result.policy.allow_read == (str(pool.cwd / "data"),)
    assert (pool.cwd / "out" / "tea.txt").read_text() == "7"


def test_job_failures_are_results(pool):
    denied = pool.run("open('data/orders.csv', 'a').write('x')", allow_read=["data"], name="step.py")
    assert denied.exit == 1 and denied.error.type == "PermissionError"
    assert denied.error.file == "step.py" and denied.error.line == 1
    assert "Read-only grants: " + str(pool.cwd / "data") in denied.error.hint
    with pytest.raises(readie.JobError, match="step.py, line 1"):
        denied.raise_for_error()
    raised = pool.run("def f():\n    raise ValueError('no')\nf()")
    assert (raised.exit, raised.error.type, raised.error.message) == (1, "ValueError", "no")
    assert "Traceback" in raised.stderr
    timed_out = pool.run("import time\ntime.sleep(30)", timeout=1)
    assert (timed_out.exit, timed_out.error.type) == (124, "TimeoutError")


def test_refusals_raise_request_error(pool):
    with pytest.raises(readie.RequestError, match="allow_write: '/.*/missing' does not exist") as refused:
        pool.run("pass", allow_write=["missing"])
    assert refused.value.result.exit == -1 and refused.value.result.policy is None
    with pytest.raises(readie.RequestError, match="1 MiB"):
        pool.run("#" * readie.MAX_LINE_BYTES)
    # Destinations (decision 35): the grammar is the pool's; a pool without egress_netns refuses the network.
    with pytest.raises(readie.RequestError, match="allow_network: 'a_b.example.com' is not a destination"):
        pool.run("pass", allow_network=["a_b.example.com"])
    with pytest.raises(readie.RequestError, match="allow_network: this worker has no egress for networked jobs"):
        pool.run("pass", allow_network=["api.example.com:443"])


def test_threads_share_one_pool(pool):
    outputs: dict[int, str] = {}

    def job(n: int) -> None:
        outputs[n] = pool.run(f"import time\ntime.sleep(0.5)\nprint({n} * {n})").stdout

    started = time.monotonic()
    threads = [threading.Thread(target=job, args=(n,)) for n in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert outputs == {n: f"{n * n}\n" for n in range(4)}
    # Two workers: the four half-second sleeps overlap in pairs at least.
    assert time.monotonic() - started < 4 * 0.5 + 4 * 0.6


def test_stats_count_what_ran(pool):
    before = pool.stats()
    pool.run("print('counted')")
    after = pool.stats()
    assert after["event"] == "stats" and after["workers"] == 2
    assert after["jobs"] == before["jobs"] + 1 and after["ok"] == before["ok"] + 1


def test_close_drains_jobs_in_flight(tmp_path):
    pool = readie.Pool(workers=1, cwd=tmp_path, checkpoints=CHECKPOINTS)
    answers: list[str] = []
    running = threading.Thread(target=lambda: answers.append(pool.run("import time\ntime.sleep(1)\nprint('done')").stdout))
    running.start()
    time.sleep(0.3)
    pool.close()  # raises unless the pool exited 0
    running.join(30)
    assert answers == ["done\n"]
    with pytest.raises(readie.PoolError, match="closed"):
        pool.run("pass")


def test_the_agent_tool_example_runs(tmp_path):
    env = {**os.environ, "READIE_CHECKPOINTS": str(CHECKPOINTS)}
    completed = subprocess.run(
        [sys.executable, str(Path(REPO) / "examples" / "agent_tool.py")],
        capture_output=True, text=True, timeout=120, env=env, cwd=tmp_path, check=False,
    )
    assert completed.returncode == 0, completed.stderr[-3000:]
    out = completed.stdout
    assert "- search_orders(product: str, limit: int = 10) -> list[dict[str, int]]" in out  # the description
    assert "2 tea orders\n" in out  # a host function's value, kept in a variable
    assert "Error: NameError: name 'tee' is not defined (line 1)" in out
    assert "7 msg-1\n" in out  # the variable survived, and the host was called again
    assert "the owner's outbox (filled by the sandbox's calls, in this process): ['7 units of tea ordered']" in out


def test_a_session_keeps_its_variables_and_grants(pool):
    with pool.session(allow_read=["data"], timeout="10s") as session:
        first = session.run("import csv\nrows = list(csv.DictReader(open('data/orders.csv')))")
        assert (first.ok, first.step, first.session_ended) == (True, 1, False)
        assert first.policy.allow_read == (str(pool.cwd / "data"),)
        second = session.run("print(len(rows))")
        assert (second.stdout, second.step, second.session) == ("3\n", 2, session.name)
        spun = session.run("while True:\n    pass\n", timeout=0.5)
        assert spun.session_ended and spun.error.type == "TimeoutError" and not session.open
        again = session.run("print('rows' in globals(), len(open('data/orders.csv').readlines()))")
        assert (again.step, again.stdout) == (1, "False 4\n")  # a new process, the same grants
    assert pool.stats()["sessions_active"] == 0


def test_a_stateful_tool(pool):
    with readie.tool(pool=pool, session=True, allow_read=["data"]) as tool:
        assert "persist between calls" in tool.description and "data/" in tool.description
        assert tool("total = 3 + 4") == "(no output)"
        assert tool("print(total)") == "7"
        assert tool("print(nope)").startswith("Error: NameError: name 'nope' is not defined")
        assert tool("print(total * 2)") == "14"  # an exception keeps the state


def test_the_last_expression_comes_back_as_value_and_output_streams(pool):
    seen: list[str] = []
    result = pool.run("import time\nprint('working', flush=True)\ntime.sleep(0.2)\n6 * 7", on_stdout=seen.append)
    assert seen == ["working\n"] and result.stdout == "working\n"
    assert result.value == readie.Value("42") and result.value.data == {}
    with pool.session() as session:
        session.run("items = [1, 2, 3]")
        step = session.run("len(items)")
    assert step.value is not None and step.value.text == "3"
    assert readie.format_result(step) == "3"  # what a model reads back
