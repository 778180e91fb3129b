"""The real executor (``python -u -m readie_executor``) over a real Unix socket.

Most tests share one executor on purpose: each ends by proving that the same
process still answers a fresh connection, so a call that could kill or wedge
the executor fails where it happens, and later tests run against an executor
that has survived everything before them.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import random
import socket
import struct
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import cloudpickle
import pytest

from readie_executor._checkpoint import PROC_CHECKPOINT, READY_MARKER
from readie_executor.protocol import MAX_CHUNK_SIZE
from readie_executor.testing import (
    ExecutorExited,
    ExecutorProcess,
    executor_environ,
    request_bytes,
    run_executor,
    short_tempdir,
    start_capture,
    start_executor,
)

# The executor cannot import this module, so its functions must travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


@pytest.fixture(scope="module")
def executor() -> Iterator[ExecutorProcess]:
    with short_tempdir() as directory, start_executor(directory) as running:
        yield running


@pytest.fixture
def short_dir() -> Iterator[Path]:
    with short_tempdir() as directory:
        yield directory


def assert_answers_fresh_connection(executor: ExecutorProcess) -> None:
    # The pid proves it is the same process, not merely a socket that still accepts.
    assert executor.process.poll() is None, executor.stderr_text()
    assert executor.call(os.getpid) == {"ok": True, "value": executor.pid, "output": []}


def add(a: int, b: int, *, c: int = 0) -> int:
    return a + b + c


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


def environ() -> dict[str, str]:
    return dict(os.environ)


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


def framed(payload: bytes) -> bytes:
    """One message in a single chunk, framed by hand rather than by the code under test."""
    return struct.pack(">Q", len(payload)) + payload + bytes(8)


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


# --- startup ------------------------------------------------------------------------------------


def test_missing_executor_dir_exits_2_with_one_line() -> None:
    result = run_executor(None)

    assert result.returncode == 2
    assert result.stderr.splitlines() == [
        "readie_executor: EXECUTOR_DIR is not set: it must name the directory for executor.sock"
    ]


def test_unknown_mode_serves_as_sandbox(short_dir: Path) -> None:
    with start_executor(short_dir, mode="no-such-mode") as executor:
        assert executor.call(add, 1, 2)["value"] == 3
        assert executor.call(environ)["value"]["EXECUTOR_MODE"] == "no-such-mode"


@pytest.mark.parametrize("chunk_size", ["0", "-5", "abc", "1.5", str(MAX_CHUNK_SIZE + 1)])
def test_bad_chunk_size_exits_2(short_dir: Path, chunk_size: str) -> None:
    result = run_executor(short_dir, env={"EXECUTOR_CHUNK_SIZE": chunk_size})

    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert line.startswith("readie_executor: EXECUTOR_CHUNK_SIZE must be")
    assert not (short_dir / "executor.sock").exists()


def test_socket_path_too_long_exits_2(short_dir: Path) -> None:
    deep = short_dir / ("d" * 100)
    deep.mkdir()

    result = run_executor(deep)

    assert result.returncode == 2
    [line] = result.stderr.splitlines()
    assert f"socket path {deep}/executor.sock is" in line
    assert "at most 107: use a shorter EXECUTOR_DIR" in line


def test_socket_path_of_exactly_107_bytes_is_served(short_dir: Path) -> None:
    room = 107 - len(os.fsencode(short_dir / "x" / "executor.sock"))
    deep = short_dir / ("x" * (1 + room))
    deep.mkdir()
    assert len(os.fsencode(deep / "executor.sock")) == 107

    with start_executor(deep) as executor:
        assert executor.call(add, 2, 2)["value"] == 4


def test_missing_executor_dir_directory_exits_2(short_dir: Path) -> None:
    result = run_executor(short_dir / "absent")

    assert result.returncode == 2
    assert "cannot listen on" in result.stderr


def test_stale_socket_is_replaced(short_dir: Path) -> None:
    stale = short_dir / "executor.sock"
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as old:
        old.bind(os.fsencode(stale))
    # A second link keeps the stale inode alive, so its number cannot be reused by the new socket.
    held = short_dir / "held"
    os.link(stale, held)
    with pytest.raises(ConnectionRefusedError), socket.socket(socket.AF_UNIX) as probe:
        probe.connect(os.fsencode(stale))

    with start_executor(short_dir) as executor:
        assert stale.stat().st_ino != held.stat().st_ino
        assert executor.call(add, 3, 4)["value"] == 7


def read_raw_frames(sock: socket.socket) -> list[bytes]:
    """One message's chunks, parsed here rather than by the code under test."""

    def exactly(count: int) -> bytes:
        data = b""
        while len(data) < count:
            piece = sock.recv(count - len(data))
            assert piece, "the executor closed the connection mid-message"
            data += piece
        return data

    chunks = []
    while length := struct.unpack(">Q", exactly(8))[0]:
        chunks.append(exactly(length))
    return chunks


def test_chunk_size_setting_is_honoured_on_responses(short_dir: Path) -> None:
    with start_executor(short_dir, env={"EXECUTOR_CHUNK_SIZE": "7"}) as executor:
        with executor.connect() as connection:
            connection.send_bytes(framed(request_bytes(bytes, 100)))
            chunks = read_raw_frames(connection.socket)

    assert len(chunks) > 10
    assert {len(chunk) for chunk in chunks[:-1]} == {7}
    assert 1 <= len(chunks[-1]) <= 7
    assert pickle.loads(b"".join(chunks)) == {"ok": True, "value": bytes(100), "output": []}


# --- capture mode (the stdio trigger) -----------------------------------------------------------

needs_stdio_trigger = pytest.mark.skipif(
    PROC_CHECKPOINT.exists(), reason="inside gVisor the capture would checkpoint this very sandbox"
)


@needs_stdio_trigger
def test_capture_with_a_bad_preimport_names_the_package(short_dir: Path) -> None:
    result = run_executor(
        short_dir, mode="capture", env={"READIE_PREIMPORT": "json,readie_no_such_package"}
    )

    assert result.returncode != 0
    assert "cannot pre-import 'readie_no_such_package'" in result.stderr
    assert "ModuleNotFoundError" in result.stderr
    # The failure comes before the announcement: the pipeline must not checkpoint this template.
    assert READY_MARKER not in result.stdout


@needs_stdio_trigger
def test_capture_then_measure_exits_0(short_dir: Path) -> None:
    new_dir = short_dir / "restored"
    new_dir.mkdir()
    with start_capture(short_dir, preimport=["json"]) as executor:
        census = executor.census
        assert census is not None
        assert executor.pid in {thread["tid"] for thread in census["threads"]}
        assert {0, 1, 2} <= {fd["fd"] for fd in census["fds"]}

        executor.hand_over({"EXECUTOR_DIR": str(new_dir), "EXECUTOR_MODE": "measure"})

        assert executor.wait() == 0
    assert list(short_dir.rglob("executor.sock")) == []


@needs_stdio_trigger
def test_capture_then_sandbox_serves_in_the_new_dir_with_the_new_environment(
    short_dir: Path, executor: ExecutorProcess
) -> None:
    capture_dir, new_dir = short_dir / "capture", short_dir / "sandbox"
    capture_dir.mkdir()
    new_dir.mkdir()
    handover_env = {
        "EXECUTOR_DIR": str(new_dir),
        "EXECUTOR_MODE": "sandbox",
        "READIE_GIVEN_AT_RESTORE": "yes",
    }
    with start_capture(
        capture_dir, preimport=["colorsys"], env={"READIE_CAPTURE_ONLY": "secret"}
    ) as captured:
        captured.hand_over(handover_env)
        captured.wait_until_serving()

        seen = captured.call(environ)["value"]
        preimported = captured.call(lambda: "colorsys" in sys.modules)["value"]

    assert seen == handover_env  # READIE_CAPTURE_ONLY is gone with the rest of the old environment
    assert preimported is True
    # Control: a cold executor has not imported it, so the check above means something.
    assert executor.call(lambda: "colorsys" in sys.modules)["value"] is False
    assert not (capture_dir / "executor.sock").exists()


@needs_stdio_trigger
@pytest.mark.parametrize(
    ("line", "complaint"),
    [
        (b"", "stdin closed before the restored sandbox handed over its environment"),
        (b"not json\n", "handover line is not JSON"),
        (b'{"env": {"A": "1\\u0000"}}\n', "handover line must be"),
    ],
    ids=["eof", "not-json", "nul-in-value"],
)
def test_capture_with_a_bad_handover_exits_3(short_dir: Path, line: bytes, complaint: str) -> None:
    with start_capture(short_dir) as executor:
        executor.hand_over_line(line)

        assert executor.wait() == 3
        assert f"readie_executor: capture failed: {complaint}" in executor.stderr_text()


@needs_stdio_trigger
def test_handover_without_executor_dir_exits_2(short_dir: Path) -> None:
    with start_capture(short_dir) as executor:
        executor.hand_over({"EXECUTOR_MODE": "sandbox"})

        assert executor.wait() == 2
        assert "EXECUTOR_DIR is not set" in executor.stderr_text()


# --- the testing helpers themselves -------------------------------------------------------------


def test_helpers_do_not_pass_on_the_callers_executor_variables(
    monkeypatch: pytest.MonkeyPatch, short_dir: Path
) -> None:
    monkeypatch.setenv("EXECUTOR_CHUNK_SIZE", "not a number")
    monkeypatch.setenv("READIE_PREIMPORT", "readie_no_such_package")

    environ = executor_environ(short_dir, env={"KEEP": "1", "PATH": None})

    assert "EXECUTOR_CHUNK_SIZE" not in environ and "READIE_PREIMPORT" not in environ
    assert (environ["EXECUTOR_DIR"], environ["EXECUTOR_MODE"]) == (str(short_dir), "sandbox")
    assert environ["KEEP"] == "1" and "PATH" not in environ


def test_start_executor_reports_an_executor_that_exits(short_dir: Path) -> None:
    with pytest.raises(ExecutorExited) as info:
        with start_executor(short_dir, env={"EXECUTOR_CHUNK_SIZE": "0"}):
            pytest.fail("the executor cannot have started")

    assert info.value.returncode == 2
    assert "EXECUTOR_CHUNK_SIZE must be between 1 and" in info.value.stderr
