"""Pool protocol conformance: the real ``readie pool`` over pipes, against real gVisor sandboxes.

Every check is against the pool protocol spec (pool-protocol.txt, "pynox"
read as "readie"), with the expected lines written out (_conformance.py)
rather than built by the router's own code. Covered: the ready event and
refusals at start, the spec's requests, refused lines naming the field,
the 1 MiB line limit, completion order and job log lines. One
module-level pool (two workers) serves these tests, which count nothing;
a pool's configuration, counters, EOF drain, backpressure and signals:
test_pool_conformance_lifecycle.py.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator

import pytest
from readie_pool.testing import PoolProcess

from conftest import CHECKPOINTS
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


@pytest.fixture(scope="module")
def shared(python_version) -> Iterator[Pool]:
    """Two workers, --log=json: for the tests that do not count anything."""
    pool = Pool("--workers", "2", "--log=json")
    pool.ready = pool.process.ready()
    yield pool
    assert pool.process.close() == 0
    assert pool.containers() == []
    pool.cleanup()


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
        "allow_network: expected true, false or an array of destinations, got a string",
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
        # The one log schema's keys (decision 0021), after the spec's.
        "level",
        "process",
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
        "level": "info",
        "process": "pool",
    }
    assert "s3cr3t-token" not in shared.process.stderr_text()
