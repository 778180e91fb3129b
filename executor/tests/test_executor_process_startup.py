"""The real executor's start-up and capture mode, and the testing helpers that start it.

Each test starts an executor of its own (or none, when it must refuse to
start), in a short temp dir of its own, except where a cold executor is
the control. Calls to a running executor: test_executor_process_calls.py.
"""

from __future__ import annotations

import os
import pickle
import socket
import struct
import sys
from pathlib import Path

import cloudpickle
import pytest

from executor.tests._executor_process import add, environ, framed
from executor.tests._executor_process import executor, short_dir  # noqa: F401 - fixtures
from readie_executor._checkpoint import PROC_CHECKPOINT, READY_MARKER
from readie_executor.framing import MAX_CHUNK_SIZE
from readie_executor.testing import (
    ExecutorExited,
    ExecutorProcess,
    executor_environ,
    request_bytes,
    run_executor,
    start_capture,
    start_executor,
)


# The executor cannot import this module, so its functions must travel by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


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
