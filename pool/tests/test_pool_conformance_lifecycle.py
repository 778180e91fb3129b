"""A pool's life, for conformance: the real ``readie pool`` over pipes, against real gVisor.

Every check is against the pool protocol spec (pool-protocol.txt, "pynox"
read as "readie"), with the expected lines written out (_conformance.py)
rather than built by the router's own code. Each test starts a small pool
of its own (one or two workers), as each counts something: the config's
ceiling and profiles, the stats counters and job logs with the EOF drain,
backpressure while results are unread, and SIGINT and SIGTERM. The spec's
requests and refusals: test_pool_conformance_protocol.py.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from pool.tests._conformance import (
    MIB,
    Pool,
    by_id,
    check_refusal,
    check_result,
    policy,
    ready_event,
    runtime,
)
from pool.tests._conformance import python_version  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc


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
            # Its last line is an expression (write's count), shown as a notebook shows it.
            "value": {"text": "2", "truncated": False, "data": {}, "omitted": []},
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
        "sessions_hibernated",
        "session_images",
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
        "sessions_hibernated": 0,
        "session_images": {"hibernations": 0, "hibernation_ms_total": 0, "resumes": 0, "resume_ms_total": 0,
                           "forks": 0, "fork_ms_total": 0},
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
