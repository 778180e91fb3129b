"""Forgery: a job writing its own result, framing garbage, or host-function calls by hand on the
executor's socket. The worker reads all of it as hostile: rebuilt if valid, refused if not,
and the client never sees a frame the job forged."""

from __future__ import annotations

import json
import textwrap

import pytest
from readie_worker.testing import CHANNEL_FORGER

from adversarial._target import target, unharmed  # noqa: F401 - fixtures

pytestmark = pytest.mark.runsc

# The forger's channel() finds the executor's connection to the worker; forge()
# writes raw bytes on it, as a job that wants to speak for the executor would.
# The caller then blocks, so that whatever the worker does comes from what was forged.
FORGE = CHANNEL_FORGER + textwrap.dedent(
    """
    import time
    from readie_executor.framing import encode_message

    def forge(payload, raw=False):
        sock.sendall(payload if raw else encode_message(payload))
    """
)
RESULT = {
    "exit": 0, "stdout": "forged\n", "stderr": "", "error": None, "stdout_truncated": False,
    "stderr_truncated": False, "duration_us": 1, "preloaded_modules": [], "python": "3.11.2",
    "policy_notes": [], "system_exit": False, "timed_out": False, "value": None,
}


def forge(target, body: str, **fields):
    return target.attack(FORGE + body + "\ntime.sleep(30)\n", timeout="10s", **fields)


def test_a_forged_pool_line_on_stdout_stays_the_job_s_output(target):
    line = json.dumps({"id": "someone-else", "exit": 0, "stdout": "hijacked"})
    result = target.attack(f"print({line!r})")
    assert result["stdout"] == line + "\n", result


def test_a_forged_but_valid_result_is_only_the_job_lying_about_itself(target):
    result = forge(target, f"forge(json.dumps({RESULT!r}).encode())".replace("json.dumps", "__import__('json').dumps"))
    assert (result["exit"], result["stdout"]) == (0, "forged\n"), result
    assert result["policy"]["backend"].startswith("gvisor:")  # the pool's account, not the job's


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        ("b'not json at all'", "invalid result"),
        ("b'{\"exit\": 0, \"stdout\": \"' + b'x' * (4 << 20) + b'\"}'", "exceeds the limit"),
        ("b'{\"exit\": NaN}'", "invalid result"),
        ("b'[' * 100000 + b']' * 100000", "invalid result"),
        ("b'{\"exit\": 0, \"exit\": 1}'", "invalid result"),
        ("b'\\xff\\xfe not utf-8'", "invalid result"),
        ("b'{\"exit\": 99999999999999999999999999}'", "invalid result"),
    ],
    ids=["garbage", "oversized-output", "nan", "deep", "duplicate-key", "not-utf8", "huge-int"],
)
def test_a_forged_invalid_result_is_a_worker_error(target, payload, why):
    result = forge(target, f"forge({payload})", max_output=65536)
    assert result["error"]["type"] == "PoolWorkerError" and why in result["error"]["message"], result


@pytest.mark.parametrize(
    "raw",
    ["b'\\xff' * 64", "b'\\x00\\x00\\x00\\x00\\x00\\x00\\x00\\x10partial'"],
    ids=["bad-framing", "truncated"],
)
def test_broken_framing_on_the_socket_is_a_worker_error(target, raw):
    result = forge(target, f"forge({raw}, raw=True)\nsock.shutdown(socket.SHUT_RDWR)")
    assert result["error"]["type"] == "PoolWorkerError", result


def test_a_job_that_hangs_up_the_socket_is_a_worker_error_not_a_hang(target):
    result = forge(target, "sock.shutdown(socket.SHUT_RDWR)")
    assert result["error"]["type"] == "PoolWorkerError" and result["duration_ms"] < 10_000, result


def test_a_forged_call_to_an_undeclared_function_never_reaches_the_client(target):
    code = (
        "from readie_executor import hostwire\nfrom readie_host import search\n"
        "forge(hostwire.encode_call(1, 'delete_everything', [], {}))\n"
        "print(search('ok'))\n"
    )
    rid = target.request_id()
    target.pool.send({"id": rid, "functions": ["search"], "code": FORGE + code})
    seen = []
    while True:
        line = target.pool.read(30)
        if line.get("event") == "call":
            seen.append(line["function"])
            target.pool.send({"reply": {"call_id": line["call_id"], "result": "answered"}})
            continue
        break
    # The worker answered the forged call itself (a refusal, which the job's own
    # bridge may take for its call's answer: the job confuses only itself).
    assert "delete_everything" not in seen, seen
    assert line["id"] == rid, line
    if line["error"] is not None:
        assert line["error"]["type"] == "HostError" and "not a declared host function" in line["error"]["message"], line


def test_a_flood_of_forged_calls_ends_the_job(target):
    code = (
        "from readie_executor import hostwire\n"
        "for i in range(5000):\n    sock.sendall(encode_message(hostwire.encode_call(i + 1, 'nope', [], {})))\n"
    )
    result = forge(target, code)
    assert result["error"]["type"] == "PoolWorkerError" and "the job was ended" in result["error"]["message"], result


def test_an_oversized_call_is_refused(target):
    code = (
        "from readie_host import echo, HostError\n"
        "try:\n    echo('x' * 2_000_000)\nexcept (HostError, ValueError, TypeError) as exc:\n    print(type(exc).__name__)\n"
    )
    result = target.attack(code, functions=["echo"])
    assert result["exit"] == 0 and result["stdout"].strip() in ("HostError", "ValueError", "TypeError"), result
