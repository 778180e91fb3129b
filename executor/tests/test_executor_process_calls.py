"""Calls to the real executor (``python -u -m readie_executor``) over a real Unix socket.

Most tests share one executor on purpose: each ends by proving that the same
process still answers a fresh connection, so a call that could kill or wedge
the executor fails where it happens, and later tests run against an executor
that has survived everything before them. Start-up, capture mode and the
testing helpers: test_executor_process_startup.py.
"""

from __future__ import annotations

import hashlib
import json
import pickle
import random
import socket
import struct
import sys
import threading
from pathlib import Path

import cloudpickle
import pytest

from executor.tests._executor_process import add, assert_answers_fresh_connection, framed
from executor.tests._executor_process import executor, short_dir  # noqa: F401 - fixtures
from readie_executor.framing import MAX_CHUNK_SIZE
from readie_executor.testing import ExecutorProcess, request_bytes, start_executor


# The executor cannot import this module, so its functions must travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


def fail(value: int) -> None:
    raise ValueError(f"bad value {value}")


def chatty() -> str:
    print("to stdout")
    print("to stderr", file=sys.stderr)
    sys.stdout.write("no newline")
    return "done"


def chatty_then_fail() -> None:
    print("before the failure")
    raise RuntimeError("after printing")


# --- calls --------------------------------------------------------------------------------------


def test_call_returns_a_value(executor: ExecutorProcess) -> None:
    assert executor.call(add, 2, 3, c=4) == {"ok": True, "value": 9, "output": []}
    assert executor.call(lambda: {"nested": [1, (2, 3)], "bytes": b"\0\1"})["value"] == {
        "nested": [1, (2, 3)],
        "bytes": b"\0\1",
    }
    assert_answers_fresh_connection(executor)


def test_call_that_raises(executor: ExecutorProcess) -> None:
    envelope = executor.call(fail, 42)

    assert envelope["ok"] is False
    assert envelope["exc_type"] == "ValueError"
    assert envelope["message"] == "bad value 42"
    assert envelope["traceback"].startswith("Traceback (most recent call last):")
    assert "in fail" in envelope["traceback"]
    assert envelope["traceback"].rstrip().endswith("ValueError: bad value 42")
    assert envelope["output"] == []
    assert set(envelope) == {"ok", "exc_type", "message", "traceback", "output"}
    assert_answers_fresh_connection(executor)


def test_stdout_and_stderr_are_captured_in_order(executor: ExecutorProcess) -> None:
    assert executor.call(chatty) == {
        "ok": True,
        "value": "done",
        "output": ["to stdout\nto stderr\nno newline"],
    }
    # Nothing left over from the previous call.
    assert executor.call(add, 1, 1)["output"] == []
    assert_answers_fresh_connection(executor)


def test_output_is_kept_when_the_call_fails(executor: ExecutorProcess) -> None:
    envelope = executor.call(chatty_then_fail)

    assert envelope["ok"] is False
    assert envelope["exc_type"] == "RuntimeError"
    assert envelope["output"] == ["before the failure\n"]
    assert_answers_fresh_connection(executor)


def returns_a_lock() -> object:
    print("made a lock")
    return threading.Lock()


def returns_a_generator() -> object:
    return (n for n in range(3))


@pytest.mark.parametrize(
    ("func", "type_name", "pickle_error"),
    [
        (returns_a_lock, "lock", "TypeError: cannot pickle '_thread.lock' object"),
        (returns_a_generator, "generator", "TypeError: cannot pickle 'generator' object"),
    ],
)
def test_unpicklable_return_value(
    executor: ExecutorProcess, func, type_name: str, pickle_error: str
) -> None:
    envelope = executor.call(func)

    assert envelope["ok"] is False
    assert envelope["exc_type"] == "PicklingError"
    assert envelope["message"] == (
        f"the return value ({type_name}) cannot be pickled: {pickle_error}"
    )
    assert envelope["traceback"]
    if func is returns_a_lock:
        assert envelope["output"] == ["made a lock\n"]
    assert_answers_fresh_connection(executor)


@pytest.mark.parametrize(
    ("request_payload", "complaint"),
    [
        (b"", "request cannot be unpickled: EOFError"),
        (b"not a pickle", "request cannot be unpickled: UnpicklingError"),
        (pickle.dumps(["func", "args", "kwargs"]), "request must be a dict, got list"),
        (pickle.dumps({"func": len, "args": ()}), "request lacks kwargs"),
        (pickle.dumps({}), "request lacks func, args, kwargs"),
        (pickle.dumps({"func": 42, "args": (), "kwargs": {}}), "func must be callable, got int"),
        (pickle.dumps({"func": len, "args": "ab", "kwargs": {}}), "args must be a tuple, got str"),
        (pickle.dumps({"func": len, "args": (), "kwargs": {1: 2}}), "kwargs must be a dict"),
        (pickle.dumps({"func": len, "args": (), "kwargs": [], "x": 1}), "kwargs must be a dict"),
    ],
    ids=[
        "empty",
        "not-a-pickle",
        "not-a-dict",
        "no-kwargs",
        "no-keys",
        "func-not-callable",
        "args-not-tuple",
        "kwargs-not-str-keys",
        "kwargs-not-dict",
    ],
)
def test_malformed_request(
    executor: ExecutorProcess, request_payload: bytes, complaint: str
) -> None:
    envelope = pickle.loads(executor.call_raw(request_payload))

    assert envelope["ok"] is False
    assert envelope["exc_type"] == "InvalidRequest"
    assert envelope["message"].startswith(complaint), envelope["message"]
    assert_answers_fresh_connection(executor)


def raise_system_exit() -> None:
    sys.exit(3)


def raise_keyboard_interrupt() -> None:
    raise KeyboardInterrupt


@pytest.mark.parametrize(
    ("func", "exc_type", "message"),
    [(raise_system_exit, "SystemExit", "3"), (raise_keyboard_interrupt, "KeyboardInterrupt", "")],
)
def test_system_exit_and_keyboard_interrupt_are_answers(
    executor: ExecutorProcess, func, exc_type: str, message: str
) -> None:
    envelope = executor.call(func)

    assert envelope["ok"] is False
    assert envelope["exc_type"] == exc_type
    assert envelope["message"] == message
    assert exc_type in envelope["traceback"]
    assert_answers_fresh_connection(executor)


def new_stderr(executor: ExecutorProcess, seen: str) -> str:
    text = executor.stderr_text()
    assert text.startswith(seen)
    return text[len(seen) :]


@pytest.mark.parametrize(
    ("sent", "logged"),
    [
        (
            struct.pack(">Q", 100) + b"x" * 10,
            "truncated message: stream ended inside a chunk: expected 100 bytes",
        ),
        (
            struct.pack(">Q", 4) + b"abcd",
            "truncated message: stream ended inside a length prefix (no terminator yet)",
        ),
        (
            b"\0\0\0",
            "truncated message: stream ended inside a length prefix: expected 8 bytes, received 3",
        ),
        (struct.pack(">Q", MAX_CHUNK_SIZE + 1), "chunk length 67108865 exceeds the limit"),
    ],
    ids=["partial-chunk", "no-terminator", "partial-prefix", "chunk-too-large"],
)
def test_client_hangs_up_mid_request(executor: ExecutorProcess, sent: bytes, logged: str) -> None:
    seen = executor.stderr_text()
    with executor.connect() as connection:
        connection.send_bytes(sent)
        if "exceeds" in logged:
            # Refused on the header alone: the executor hangs up without waiting for more.
            assert connection.receive() is None

    # Connections are served one at a time, so once a fresh one is answered the
    # broken one has been dealt with (and logged).
    assert_answers_fresh_connection(executor)
    assert f"dropping connection: {logged}" in new_stderr(executor, seen)


def test_the_log_still_reaches_stderr_after_a_job_took_fds_1_and_2(executor: ExecutorProcess) -> None:
    # A job's capture keeps fds 1 and 2 as its pipes between jobs (decision 33): the executor's
    # own messages go to the descriptor of its log it kept, and no job output lands there.
    from readie_executor.jobs import run_job

    job = {"code": "import os, sys\nprint('job out')\nos.write(2, b'job err\\n')", "limits": {"max_output": 100}}
    result = json.loads(executor.call_raw(request_bytes(run_job, job)))
    assert (result["exit"], result["stdout"], result["stderr"]) == (0, "job out\n", "job err\n")
    seen = executor.stderr_text()
    with executor.connect() as connection:
        connection.send_bytes(struct.pack(">Q", MAX_CHUNK_SIZE + 1))
        assert connection.receive() is None
    assert_answers_fresh_connection(executor)
    logged = new_stderr(executor, seen)
    assert "dropping connection: chunk length" in logged and "job" not in logged


def test_a_connection_never_takes_a_descriptor_a_job_s_leftover_stream_freed(executor: ExecutorProcess) -> None:
    # The job's own stream on fd 1 (closefd) closes it when collected, after the job's end
    # (decision 33): the next connection must not get fd 1, where the next capture's pipe goes.
    from readie_executor.jobs import run_job

    limits = {"max_output": 100}
    leave = {"code": "import os, sys\nsys.stdout = os.fdopen(1, 'w')\nprint('one')", "limits": limits, "session": True}
    first = json.loads(executor.call_raw(request_bytes(run_job, leave)))
    after = {"code": "import os\nprint('two', os.path.exists('/proc/self/fd/1'))", "limits": limits, "session": True}
    second = json.loads(executor.call_raw(request_bytes(run_job, after)))  # a new connection
    assert (first["stdout"], second["stdout"]) == ("one\n", "two True\n"), (first, second)
    assert_answers_fresh_connection(executor)


def big_value() -> bytes:
    return bytes(20_000_000)


def test_client_leaves_before_the_response(executor: ExecutorProcess) -> None:
    seen = executor.stderr_text()
    with executor.connect() as connection:
        connection.send_bytes(framed(request_bytes(big_value)))

    assert_answers_fresh_connection(executor)
    assert "peer left before the response was sent" in new_stderr(executor, seen)


def length_and_hash(data: bytes) -> tuple[int, str]:
    return len(data), hashlib.sha256(data).hexdigest()


def test_100_mb_argument_across_many_chunks(executor: ExecutorProcess) -> None:
    # Random, so that a lost, repeated or reordered chunk changes the hash.
    data = random.Random(2).randbytes(100 * 1024 * 1024)

    envelope = executor.call(length_and_hash, data)

    assert envelope == {"ok": True, "value": length_and_hash(data), "output": []}
    assert_answers_fresh_connection(executor)


def test_old_clients_packages_key_is_ignored(executor: ExecutorProcess) -> None:
    request = cloudpickle.dumps(
        {"func": add, "args": (1, 2), "kwargs": {}, "packages": ["numpy==1.26.4", "no-such-pkg"]}
    )

    assert pickle.loads(executor.call_raw(request)) == {"ok": True, "value": 3, "output": []}
    assert_answers_fresh_connection(executor)


def test_several_calls_on_one_connection(executor: ExecutorProcess) -> None:
    with executor.connect() as connection:
        first = connection.call(add, 1, 2)
        failed = connection.call(fail, 7)
        invalid = pickle.loads(connection.call_raw(b"garbage"))
        # The request's own chunking does not matter to the executor.
        last = pickle.loads(connection.call_raw(request_bytes(add, 40, 2), chunk_size=3))

    assert first["value"] == 3
    assert (failed["ok"], failed["exc_type"]) == (False, "ValueError")
    assert (invalid["ok"], invalid["exc_type"]) == (False, "InvalidRequest")
    assert last == {"ok": True, "value": 42, "output": []}
    assert_answers_fresh_connection(executor)


def test_response_after_the_client_half_closes(executor: ExecutorProcess) -> None:
    with executor.connect() as connection:
        connection.send_bytes(framed(request_bytes(add, 5, 6)))
        connection.socket.shutdown(socket.SHUT_WR)
        assert pickle.loads(connection.receive()) == {"ok": True, "value": 11, "output": []}
        assert connection.receive() is None
    assert_answers_fresh_connection(executor)


def use_resolv_conf(path: str) -> None:
    # Runs inside the executor: points its resolver setup at a scratch file instead of /etc.
    import readie_executor._calls

    readie_executor._calls.RESOLV_CONF = path


def read_text(path: str) -> str:
    with open(path, encoding="utf-8") as file:
        return file.read()


def _host_has_a_nameserver() -> bool:
    try:
        with open("/etc/resolv.conf", encoding="utf-8") as conf:
            return any(line.split()[:1] == ["nameserver"] for line in conf)
    except OSError:
        return False


@pytest.mark.skipif(
    not _host_has_a_nameserver(),
    reason="the first call, made before the redirect, would write this host's /etc/resolv.conf",
)
def test_dns_is_set_up_before_each_call_when_no_resolver_is_configured(short_dir: Path) -> None:
    conf = short_dir / "resolv.conf"
    with start_executor(short_dir, env={"READIE_NAMESERVER": "192.0.2.53"}) as executor:
        assert executor.call(use_resolv_conf, str(conf))["ok"]

        assert executor.call(read_text, str(conf))["value"] == "nameserver 192.0.2.53\n"
        conf.write_text("# managed elsewhere\n")
        assert executor.call(read_text, str(conf))["value"] == "nameserver 192.0.2.53\n"
        configured = "search example\nnameserver 10.1.1.1\n"
        conf.write_text(configured)
        assert executor.call(read_text, str(conf))["value"] == configured
