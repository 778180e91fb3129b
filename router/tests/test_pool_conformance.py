"""Conformance: the real ``readie pool`` process, over pipes, against real gVisor sandboxes.

Every check is against the pool protocol spec (pool-protocol.txt, "pynox"
read as "readie"), with the expected lines written out here rather than
built by the router's own code. Pools stay small (one or two workers); one
module-level pool serves the tests that count nothing, the others start their own.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from readie_router.testing import PoolProcess
from readie_worker.manifest import read_manifest
from readie_worker.runsc import Runsc

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

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
        return Runsc(root=self.state).list_ids() if self.state.exists() else []

    def cleanup(self) -> None:
        self.process.stop()
        leftovers = self.containers()
        if leftovers:
            Runsc(root=self.state).sweep()
        shutil.rmtree(self.base, ignore_errors=True)
        assert leftovers == [], f"readie pool left runsc containers: {leftovers}"


@pytest.fixture
def pool_factory(python_version) -> Iterator[Any]:
    made: list[Pool] = []

    def make(*args: str) -> Pool:
        pool = Pool(*args)
        made.append(pool)
        return pool

    yield make
    for pool in made:
        pool.cleanup()


@pytest.fixture(scope="module")
def shared(python_version) -> Iterator[Pool]:
    """Two workers, --log=json: for the tests that do not count anything."""
    pool = Pool("--workers", "2", "--log=json")
    pool.ready = pool.process.ready()
    yield pool
    assert pool.process.close() == 0
    assert pool.containers() == []
    pool.cleanup()


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
    """Every field: ``expected`` holds all but the three timings, which are checked for shape."""
    assert list(result) == RESULT_KEYS, result
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


# --------------------------------------------------------------------------- start-up


def test_ready_event_has_every_field(shared):
    assert shared.ready == ready_event(workers=2)
    assert list(shared.ready) == list(ready_event(workers=2))


def test_a_preload_set_without_a_checkpoint_is_refused_with_how_to_capture_it(
    tmp_path, checkpoints
):
    process = PoolProcess(
        ["--checkpoints", str(CHECKPOINTS), "--preload", "scipy,numpy"],
        cwd=tmp_path,
        stderr_path=tmp_path / "stderr.log",
    )
    assert process.read_line(30) is None  # no ready event
    assert process.finish() == 1
    message = process.stderr_text()
    assert "no checkpoint" in message and "[numpy, scipy]" in message
    assert "pipeline/src/readie_pipeline/checkpoints.toml" in message and "make capture" in message
    assert '[checkpoints.NAME]\n    preimport = ["numpy", "scipy"]' in message


def test_an_unreachable_router_is_refused_at_start(tmp_path):
    with socket.socket() as probe:  # a port nobody listens on
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    process = PoolProcess(
        ["--router", f"127.0.0.1:{port}", "--checkpoints", str(CHECKPOINTS)], cwd=tmp_path, stderr_path=tmp_path / "stderr.log"
    )
    assert process.read_line(30) is None
    assert process.finish() == 1
    assert f"cannot reach the router at 127.0.0.1:{port}" in process.stderr_text()


# --------------------------------------------------------------------------- the spec's requests


def test_spec_task_1_inline_code_with_a_write_grant(shared, python_version):
    out = shared.project / "out"
    task_1 = {
        "id": "task-1",
        "code": "import json\nprint(json.dumps({'ok': True}))",
        "name": "step.py",
        "allow_write": ["out"],
    }
    check_result(
        shared.process.run(task_1),
        {
            "id": "task-1",
            "exit": 0,
            "stdout": '{"ok": true}\n',
            "stderr": "",
            "error": None,
            "stdout_truncated": False,
            "stderr_truncated": False,
            "runtime": runtime(python_version),
            "policy": policy(write=[out]),
        },
    )
    # Relative paths in the code mean what the request's relative grants meant.
    written = shared.process.run(
        {
            "id": "task-1b",
            "code": "open('out/r.txt', 'w').write('in gvisor')",
            "allow_write": ["out"],
        }
    )
    assert (written["exit"], written["error"]) == (0, None), written
    assert (out / "r.txt").read_text() == "in gvisor"


def test_spec_task_2_script_with_every_field(shared, python_version):
    task_2 = {
        "id": "task-2",
        "script": "app.py",
        "args": ["one"],
        "allow_read": ["data"],
        "package_dirs": [],
        "env": {"KEY": "value"},
        "allow_network": False,
        "timeout": "5s",
        "memory": "512m",
        "max_output": 65536,
    }
    check_result(
        shared.process.run(task_2),
        {
            "id": "task-2",
            "exit": 0,
            "stdout": "['one'] value\n2\n",
            "stderr": "",
            "error": None,
            "stdout_truncated": False,
            "stderr_truncated": False,
            "runtime": runtime(python_version),
            "policy": policy(
                read=[shared.project / "data"], timeout_ms=5000, memory_bytes=512 * MIB
            ),
        },
    )


def test_errors_point_at_the_script_or_the_inline_name(shared, python_version):
    shared.process.send(
        {"id": "s", "script": "broken.py"},
        {"id": "n", "code": "x = 1\nraise KeyError('k')", "name": "step.py"},
    )
    results = by_id(shared.process.results(2))
    for rid, file, line, kind, message in (
        ("s", "broken.py", 3, "ValueError", "bad value"),
        ("n", "step.py", 2, "KeyError", "'k'"),
    ):
        result = results[rid]
        assert (
            result["stderr"].startswith("Traceback")
            and f'File "{file}", line {line}' in result["stderr"]
        )
        check_result(
            result,
            {
                "id": rid,
                "exit": 1,
                "stdout": "",
                "stderr": result["stderr"],
                "error": {"type": kind, "message": message, "file": file, "line": line},
                "stdout_truncated": False,
                "stderr_truncated": False,
                "runtime": runtime(python_version),
                "policy": policy(),
            },
        )


def test_max_output_truncates(shared):
    result = shared.process.run({"id": "big", "code": "print('x' * 100000)", "max_output": 65536})
    assert (result["exit"], result["stdout_truncated"], result["stderr_truncated"]) == (
        0,
        True,
        False,
    )
    assert 0 < len(result["stdout"]) <= 65536 and set(result["stdout"]) == {"x"}


# --------------------------------------------------------------------------- refusals


REFUSED_LINES = [
    (b'{"id": "r1"}', "r1", "code: required: give exactly one of code and script"),
    (
        b'{"id": "r2", "code": "x", "script": "app.py"}',
        "r2",
        "script: give exactly one of code and script, not both",
    ),
    (b'{"id": "r3", "code": "x", "colour": "red"}', "r3", "colour: unknown field"),
    (b'{"id": "r4", "code": 1}', "r4", "code: expected a string, got a number"),
    (b'{"id": "r5", "code": "x", "args": "one"}', "r5", "args: expected an array, got a string"),
    (
        b'{"id": "r6", "code": "x", "timeout": true}',
        "r6",
        "timeout: expected a duration, got a boolean",
    ),
    (
        b'{"id": "r7", "code": "x", "allow_network": "no"}',
        "r7",
        "allow_network: expected true or false, got a string",
    ),
    (
        b'{"id": "r8", "code": "x", "env": {"A": 1}}',
        "r8",
        "env: 'A': expected a string, got a number",
    ),
    (
        b'{"id": "r9", "code": oops}',
        "r9",
        "line is not valid JSON: Expecting value: line 1 column 22 (char 21)",
    ),
    (b"[1, 2]", None, "a request must be a JSON object, got an array"),
    (b'{"id": true, "code": "x"}', None, "id: must be a string or an integer, got a boolean"),
    (
        b'{"id": "u1", "session": "nb", "script": "app.py"}',
        "u1",
        "script: sessions take inline code, not script",
    ),
    (
        b'{"id": "u2", "functions": ["HostError"], "code": "x"}',
        "u2",
        "functions: item 0: 'HostError' is reserved in readie_host",
    ),
    (
        b'{"reply": {"call_id": 7, "result": 1}}',
        None,
        "reply.call_id: no call waits for a reply with call_id 7 (it was answered already, "
        "its task ended or ran out of time, or it was never made)",
    ),
]


def test_refusals_name_the_field_and_recover_the_id(shared, python_version):
    shared.process.send_raw(b"".join(line + b"\n" for line, _, _ in REFUSED_LINES))
    results = shared.process.results(len(REFUSED_LINES))
    # Refusals are answered as they are read, so in order here.
    for result, (_, rid, message) in zip(results, REFUSED_LINES, strict=True):
        check_refusal(result, rid, message, python_version)


def test_a_line_over_one_mib_is_refused_and_the_next_line_is_read(shared, python_version):
    head = b'{"id": "edge", "code": "#'
    edge = head + b"x" * (MIB - len(head) - 2) + b'"}'  # exactly 1 MiB: accepted
    big = b'{"id": "big", "code": "#' + b"x" * MIB + b'"}'
    assert len(edge) == MIB
    shared.process.send_raw(
        big + b"\n" + b'{"id": "after", "code": "print(\'after\')"}\n' + edge + b"\n"
    )
    results = by_id(shared.process.results(3))
    check_refusal(
        results["big"],
        "big",
        f"line of {len(big)} bytes is longer than the 1048576-byte limit; discarded",
        python_version,
    )
    assert (results["after"]["exit"], results["after"]["stdout"]) == (0, "after\n")
    assert (results["edge"]["exit"], results["edge"]["error"]) == (0, None)


def test_results_come_in_completion_order(shared):
    shared.process.send(
        {"id": "slow", "code": "import time\ntime.sleep(2)\nprint('slow')"},
        {"id": "fast", "code": "print('fast')"},
    )
    first, second = shared.process.results(2)
    assert (first["id"], first["stdout"]) == ("fast", "fast\n")
    assert (second["id"], second["stdout"]) == ("slow", "slow\n")


def test_job_log_lines_carry_no_output(shared):
    result = shared.process.run({"id": "quiet", "code": "print('s3cr3t-token')"})
    assert result["stdout"] == "s3cr3t-token\n"
    line = next(line for line in shared.process.job_logs() if line["id"] == "quiet")
    assert list(line) == [
        "ts_ms",
        "event",
        "id",
        "session",
        "step",
        "exit",
        "error",
        "message",
        "duration_ms",
        "queue_us",
        "network",
        "truncated",
    ]
    assert abs(line["ts_ms"] - time.time() * 1000) < 60_000
    assert {k: v for k, v in line.items() if k != "ts_ms"} == {
        "event": "job",
        "id": "quiet",
        "session": None,
        "step": None,
        "exit": 0,
        "error": None,
        "message": None,
        "duration_ms": result["duration_ms"],
        "queue_us": result["queue_us"],
        "network": "deny",
        "truncated": False,
    }
    assert "s3cr3t-token" not in shared.process.stderr_text()


# --------------------------------------------------------------------------- configuration


def test_config_ceiling_and_profiles(pool_factory, python_version):
    pool = pool_factory("--config", "cfg/readie.toml")
    project = pool.project
    data, out = project / "data", project / "out"
    ceiling_paths = f"{data}, {out}"
    assert pool.process.ready() == ready_event(
        workers=1, config=str(project / "cfg" / "readie.toml"), profiles=["analysis", "fetch"]
    )
    write_100k = "with open('out/big.bin', 'wb') as f:\n    f.write(b'x' * 100000)\n"
    pool.process.send(
        {"id": "c1", "code": "print(1)", "allow_read": ["secret"]},
        {"id": "c2", "code": "print(1)", "allow_network": True},
        {"id": "c3", "code": "print(1)", "timeout": "11s"},
        {"id": "c4", "code": "print(1)", "profile": "nope"},
        {"id": "c5", "code": "print(1)", "profile": "fetch"},
        {"id": "c6", "script": "app.py", "allow_read": ["data"]},
        {"id": "c7", "code": write_100k, "allow_write": ["out"]},
        {
            "id": "c8",
            "profile": "analysis",
            "env": {"EXTRA": "1"},
            "timeout": "5s",
            "code": "import os\nprint(os.environ['MODE'], os.environ['EXTRA'])\n"
            "print(open('data/orders.csv').read().count('tea'))\nopen('out/p.txt', 'w').write('ok')\n",
        },
    )
    results = by_id(pool.process.results(8, timeout=60))
    messages = {
        # Quoted as the request wrote it, never resolved.
        "c1": f"allow_read: 'secret' is not beneath a path the pool's [pool.limits] allow ({ceiling_paths})",
        "c2": "allow_network: the pool's [pool.limits] do not allow the network",
        "c3": "timeout: 11000 ms exceeds the pool's [pool.limits] timeout of 10000 ms",
        "c4": "profile: unknown profile 'nope' (known: analysis, fetch)",
        "c5": "allow_network: the pool's [pool.limits] do not allow the network (from profile 'fetch')",
        "c6": f"script: 'app.py' is not beneath a path the pool's [pool.limits] allow ({ceiling_paths})",
    }
    for rid, message in messages.items():
        check_refusal(results[rid], rid, message, python_version)
    # max_file_size from the ceiling applies to a request that sets none; the
    # timeout and memory not set take the ceiling's (under the defaults).
    c7 = results["c7"]
    assert (c7["exit"], c7["error"]["type"], c7["error"]["file"], c7["error"]["line"]) == (
        1,
        "OSError",
        "<string>",
        2,
    )
    assert "File too large" in c7["error"]["message"]
    assert c7["policy"] == policy(write=[out], timeout_ms=10000, memory_bytes=1024 * MIB)
    assert not (out / "big.bin").exists() or (out / "big.bin").stat().st_size <= 64 * 1024
    # profile fields, with the request's own on top, under the ceiling
    check_result(
        results["c8"],
        {
            "id": "c8",
            "exit": 0,
            "stdout": "analysis 1\n2\n",
            "stderr": "",
            "error": None,
            "stdout_truncated": False,
            "stderr_truncated": False,
            "runtime": runtime(python_version),
            "policy": policy(read=[data], write=[out], timeout_ms=5000, memory_bytes=1024 * MIB),
        },
    )
    assert (out / "p.txt").read_text() == "ok"
    assert pool.process.close() == 0


# --------------------------------------------------------------------------- counters, logs, EOF


def test_stats_logs_and_eof_drain(pool_factory, python_version):
    pool = pool_factory("--workers", "2", "--log=json")
    pool.process.ready()
    pool.process.send(
        {"id": "ok1", "code": "print('s3cr3t-a')"},
        {"id": "ok2", "code": "import sys; sys.exit(0)"},
        {"id": "raise", "code": "raise ValueError('no')"},
        {"id": "exit3", "code": "import sys; sys.exit(3)"},
        {"id": "spin", "code": "while True:\n    pass\n", "timeout": "1s"},
        {"id": "unknown", "code": "x", "colour": 1},
    )
    pool.process.send_raw(b'{"id": "garbled", \n')
    results = by_id(pool.process.results(7, timeout=60))
    assert {rid: (r["exit"], r["error"] and r["error"]["type"]) for rid, r in results.items()} == {
        "ok1": (0, None),
        "ok2": (0, None),
        "raise": (1, "ValueError"),
        "exit3": (3, None),
        "spin": (124, "TimeoutError"),
        "unknown": (-1, "RequestError"),
        "garbled": (-1, "RequestError"),
    }
    assert results["spin"]["policy"]["timeout_ms"] == 1000 and results["spin"]["stdout"] == ""
    stats = pool.process.run({"id": "s1", "stats": True})
    assert list(stats) == [
        "id",
        "event",
        "uptime_ms",
        "workers",
        "sessions_active",
        "jobs",
        "ok",
        "failed",
        "timeouts",
        "signals",
        "request_errors",
        "worker_errors",
        "duration_ms_total",
        "queue_us_total",
        "errors",
        "host",
    ]
    assert type(stats["uptime_ms"]) is int and stats["uptime_ms"] > 0
    assert {k: v for k, v in stats.items() if k != "uptime_ms"} == {
        "id": "s1",
        "event": "stats",
        "workers": 2,
        "sessions_active": 0,
        "jobs": 7,
        "ok": 2,
        "failed": 2,
        "timeouts": 1,
        "signals": 0,
        "request_errors": 2,
        "worker_errors": 0,
        "duration_ms_total": sum(r["duration_us"] for r in results.values()) // 1000,
        "queue_us_total": sum(r["queue_us"] for r in results.values()),
        "errors": {"ValueError": 1, "TimeoutError": 1, "RequestError": 2},
        "host": {"calls": 0, "replies": 0, "late_replies": 0, "refused_frames": 0},
    }
    assert sorted(stats["errors"].items()) == [
        ("RequestError", 2),
        ("TimeoutError", 1),
        ("ValueError", 1),
    ]

    # EOF drains: every accepted job is answered, then the pool exits 0 and leaves no sandbox.
    pool.process.send(
        *({"id": f"d{i}", "code": f"import time\ntime.sleep(0.5)\nprint({i})"} for i in range(3))
    )
    pool.process.close_stdin()
    drained = by_id(pool.process.results(3, timeout=60))
    assert {rid: r["stdout"] for rid, r in drained.items()} == {
        "d0": "0\n",
        "d1": "1\n",
        "d2": "2\n",
    }
    assert pool.process.read_line(30) is None
    assert pool.process.finish() == 0
    assert pool.containers() == []

    # One --log=json line per result (stats excluded), matching it, never its output.
    logs = by_id(pool.process.job_logs())
    assert sorted(logs, key=str) == sorted([*results, *drained], key=str)
    for rid, result in {**results, **drained}.items():
        line = logs[rid]
        assert (
            line["exit"],
            line["error"],
            line["duration_ms"],
            line["queue_us"],
            line["truncated"],
        ) == (
            result["exit"],
            result["error"] and result["error"]["type"],
            result["duration_ms"],
            result["queue_us"],
            False,
        )
        assert line["message"] == (result["error"] and result["error"]["message"])
        assert line["network"] == (None if result["policy"] is None else "deny")
    stderr = pool.process.stderr_text()
    assert "s3cr3t-a" not in stderr
    assert stderr.count('"event": "job"') == len(
        logs
    )  # the worker's own job lines are not repeated


# --------------------------------------------------------------------------- backpressure


def test_backpressure_stops_intake_while_results_are_unread(pool_factory):
    """workers=1: two accepted lines at most until their results are written.

    Each job prints 100 kB, so its result line alone overfills the 64 KiB
    stdout pipe we do not read: the first result blocks the pool's writer,
    the second waits behind it, and the pool must stop reading stdin. We
    then see (a) exactly two jobs finished, however long we wait, and (b)
    our non-blocking writes to its stdin hit a full pipe, having got no
    further than what two lines, one read chunk and the pipe can hold.
    """
    pool = pool_factory("--workers", "1", "--log=json")
    pool.process.ready()
    count, size = 12, 32 * 1024
    lines = []
    for i in range(count):
        head = json.dumps({"id": i, "code": "print('x' * 100000)\n#"})[:-2].encode()
        lines.append(head + b"p" * (size - len(head) - 3) + b'"}\n')
    stream = b"".join(lines)
    assert all(len(line) == size for line in lines)

    fd = pool.process.stdin_fd
    os.set_blocking(fd, False)
    written = 0
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline and len(pool.process.job_logs()) < 2:
        try:
            written += os.write(fd, stream[written:])
        except BlockingIOError:
            time.sleep(0.05)
    assert len(pool.process.job_logs()) == 2
    time.sleep(1.5)  # a pool that kept reading would have taken everything by now
    with pytest.raises(BlockingIOError):
        os.write(fd, stream[written:])
    assert len(pool.process.job_logs()) == 2
    pipe_size = fcntl.fcntl(fd, fcntl.F_GETPIPE_SZ)
    read_chunk = 64 * 1024
    assert written <= 3 * size + read_chunk + pipe_size < len(stream)

    # Reading the results releases the pool; the rest of the lines go through.
    os.set_blocking(fd, True)
    feeder = threading.Thread(target=pool.process.send_raw, args=(stream[written:],))
    feeder.start()
    results = pool.process.results(count, timeout=90)
    feeder.join()
    assert sorted(r["id"] for r in results) == list(range(count))
    assert all(r["exit"] == 0 and r["stdout"] == "x" * 100000 + "\n" for r in results)
    assert pool.process.close() == 0


# --------------------------------------------------------------------------- signals


def test_sigint_drains_like_eof(pool_factory):
    pool = pool_factory("--workers", "1")
    pool.process.ready()
    pool.process.send(
        {"id": "slow", "code": "import time\ntime.sleep(1)\nprint('done')"},
        {"id": "next", "code": "print('next')"},
    )
    time.sleep(0.5)  # both lines read (one chunk); the first is running
    pool.process.signal(signal.SIGINT)
    results = by_id(pool.process.results(2, timeout=60))
    assert {rid: (r["exit"], r["stdout"]) for rid, r in results.items()} == {
        "slow": (0, "done\n"),
        "next": (0, "next\n"),
    }
    assert pool.process.read_line(30) is None
    assert pool.process.finish() == 0
    assert pool.containers() == []


def test_a_second_sigterm_stops_running_jobs(pool_factory):
    pool = pool_factory("--workers", "1")
    pool.process.ready()
    pool.process.send({"id": "forever", "code": "import time\ntime.sleep(60)"})
    time.sleep(1.0)
    started = time.monotonic()
    pool.process.signal(signal.SIGTERM)
    time.sleep(0.3)
    pool.process.signal(signal.SIGTERM)
    result = pool.process.read(30)
    assert (result["id"], result["exit"], result["error"]["type"]) == (
        "forever",
        -1,
        "PoolWorkerError",
    )
    assert pool.process.read_line(30) is None
    assert pool.process.finish() == 0
    assert time.monotonic() - started < 20
    assert pool.containers() == []
