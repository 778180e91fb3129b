"""Run the real executor in tests: a subprocess, a short socket directory, calls over the socket.

::

    from readie_executor.testing import short_tempdir, start_executor

    with short_tempdir() as directory, start_executor(directory) as executor:
        assert executor.call(sum, [1, 2, 3]) == {"ok": True, "value": 6, "output": []}

Functions travel with cloudpickle, which pickles a function defined at module
level *by reference* (module and name). A test module that the executor cannot
import must therefore send its functions by value::

    cloudpickle.register_pickle_by_value(sys.modules[__name__])

Standard library and cloudpickle only, like the executor itself.
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import IO, Any

import cloudpickle

from ._checkpoint import READY_MARKER
from .sockets import SOCKET_NAME
from .framing import DEFAULT_CHUNK_SIZE, MessageReader
from .sockets import receive_message, send_message

__all__ = [
    "EXECUTOR_COMMAND",
    "EXECUTOR_VARIABLES",
    "ExecutorConnection",
    "ExecutorExited",
    "ExecutorProcess",
    "executor_environ",
    "request_bytes",
    "run_executor",
    "short_tempdir",
    "start_capture",
    "start_executor",
]

EXECUTOR_COMMAND = (sys.executable, "-u", "-m", "readie_executor")
# Variables the executor reads; inherited values from the shell running the
# tests would otherwise leak into every executor started here.
EXECUTOR_VARIABLES = (
    "EXECUTOR_DIR",
    "EXECUTOR_MODE",
    "EXECUTOR_CHUNK_SIZE",
    "READIE_PREIMPORT",
    "READIE_NAMESERVER",
    "READIE_AFTER_RESTORE",
)
# An interpreter start plus the cloudpickle import; generous for a loaded CI machine.
START_TIMEOUT = 30.0
# Per socket operation, not per call: a 100 MB call makes many of them.
IO_TIMEOUT = 60.0
_POLL_INTERVAL = 0.01


class ExecutorExited(Exception):
    """The executor process ended while it was expected to keep going."""

    def __init__(self, returncode: int, stderr: str) -> None:
        super().__init__(f"executor exited with code {returncode}; stderr:\n{stderr}")
        self.returncode = returncode
        self.stderr = stderr


@contextlib.contextmanager
def short_tempdir(prefix: str = "rx-") -> Iterator[Path]:
    """A fresh directory with a short path, removed afterwards.

    A Unix socket path has at most 107 bytes, which pytest's ``tmp_path`` can
    exceed, so this prefers ``/tmp`` over a long ``$TMPDIR``.
    """
    parent = "/tmp" if os.path.isdir("/tmp") else None
    path = Path(tempfile.mkdtemp(prefix=prefix, dir=parent))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def executor_environ(
    directory: Path | str | None,
    *,
    mode: str | None = "sandbox",
    env: Mapping[str, str | None] | None = None,
) -> dict[str, str]:
    """The environment for an executor: this process's, minus executor variables, plus ``env``.

    ``directory`` or ``mode`` None leaves that variable unset; a None value in
    ``env`` removes the variable.
    """
    environ = {key: value for key, value in os.environ.items() if key not in EXECUTOR_VARIABLES}
    if directory is not None:
        environ["EXECUTOR_DIR"] = str(directory)
    if mode is not None:
        environ["EXECUTOR_MODE"] = mode
    for key, value in (env or {}).items():
        if value is None:
            environ.pop(key, None)
        else:
            environ[key] = value
    return environ


def run_executor(
    directory: Path | str | None,
    *,
    mode: str | None = "sandbox",
    env: Mapping[str, str | None] | None = None,
    stdin: bytes = b"",
    timeout: float = START_TIMEOUT,
) -> subprocess.CompletedProcess[str]:
    """Run an executor that is expected to exit by itself (bad settings, a failed capture).

    Output is decoded leniently: a failing executor's stderr is evidence, not input.
    """
    result = subprocess.run(
        EXECUTOR_COMMAND,
        env=executor_environ(directory, mode=mode, env=env),
        input=stdin,
        capture_output=True,
        timeout=timeout,
    )
    return subprocess.CompletedProcess(
        result.args,
        result.returncode,
        result.stdout.decode("utf-8", "replace"),
        result.stderr.decode("utf-8", "replace"),
    )


def request_bytes(func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> bytes:
    """A request as the worker sends it: a cloudpickle of ``{"func", "args", "kwargs"}``."""
    return cloudpickle.dumps({"func": func, "args": args, "kwargs": kwargs})


class ExecutorConnection:
    """One client connection; several calls may follow each other on it."""

    def __init__(self, sock: socket.socket) -> None:
        self.socket = sock
        self._reader = MessageReader()

    def call(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """Run ``func(*args, **kwargs)`` in the executor and return the decoded envelope."""
        return pickle.loads(self.call_raw(request_bytes(func, *args, **kwargs)))

    def call_raw(self, request: bytes, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> bytes:
        """Send one request payload; return the response payload, still pickled."""
        send_message(self.socket, request, chunk_size)
        response = self.receive()
        if response is None:
            raise ConnectionError("the executor closed the connection without answering")
        return response

    def receive(self) -> bytes | None:
        """The next response payload, or None if the executor closed the connection."""
        return receive_message(self.socket, self._reader)

    def send_bytes(self, data: bytes) -> None:
        """Unframed bytes, for tests that break the framing on purpose."""
        self.socket.sendall(data)

    def close(self) -> None:
        self.socket.close()

    def __enter__(self) -> ExecutorConnection:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class ExecutorProcess:
    """A running ``python -m readie_executor`` and the socket it serves (or will serve)."""

    def __init__(
        self,
        process: subprocess.Popen[bytes],
        socket_path: Path,
        stdout: IO[bytes],
        stderr: IO[bytes],
    ) -> None:
        self.process = process
        self.socket_path = socket_path
        #: The template census from the capture announcement (capture mode only).
        self.census: dict[str, Any] | None = None
        self._stdout = stdout
        self._stderr = stderr
        # What the executor wrote, kept once the files are closed by stop().
        self._final_output: tuple[str, str] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    def connect(self, timeout: float = IO_TIMEOUT) -> ExecutorConnection:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(timeout)
        try:
            sock.connect(os.fsencode(self.socket_path))
        except BaseException:
            sock.close()
            raise
        return ExecutorConnection(sock)

    def call(self, func: Callable[..., Any], /, *args: Any, **kwargs: Any) -> dict[str, Any]:
        """One call on a fresh connection; the decoded envelope."""
        with self.connect() as connection:
            return connection.call(func, *args, **kwargs)

    def call_raw(self, request: bytes, *, chunk_size: int = DEFAULT_CHUNK_SIZE) -> bytes:
        """One request payload on a fresh connection; the response payload, still pickled."""
        with self.connect() as connection:
            return connection.call_raw(request, chunk_size=chunk_size)

    def wait_until_serving(self, timeout: float = START_TIMEOUT) -> None:
        """Dial until the socket accepts, as the worker does; fail early if the executor exits."""
        deadline = time.monotonic() + timeout
        while True:
            self._raise_if_exited()
            try:
                with self.connect(timeout=1.0):
                    return
            except (FileNotFoundError, ConnectionRefusedError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no executor socket at {self.socket_path} after {timeout}s; "
                    f"stderr:\n{self.stderr_text()}"
                )
            time.sleep(_POLL_INTERVAL)

    def hand_over(self, env: Mapping[str, str]) -> None:
        """Give a capture-mode executor its new environment, as the worker does after a restore."""
        self.hand_over_line(json.dumps({"env": dict(env)}).encode() + b"\n")
        if "EXECUTOR_DIR" in env:
            self.socket_path = Path(env["EXECUTOR_DIR"]) / SOCKET_NAME

    def hand_over_line(self, line: bytes) -> None:
        """Raw bytes on the executor's stdin, then end of file."""
        if self.process.stdin is None:
            raise RuntimeError("this executor has no stdin pipe: start it with start_capture")
        with contextlib.suppress(BrokenPipeError):
            self.process.stdin.write(line)
            self.process.stdin.close()

    def wait(self, timeout: float = START_TIMEOUT) -> int:
        return self.process.wait(timeout)

    def stdout_text(self) -> str:
        return self._final_output[0] if self._final_output else _read_whole(self._stdout)

    def stderr_text(self) -> str:
        return self._final_output[1] if self._final_output else _read_whole(self._stderr)

    def stop(self) -> None:
        """Terminate the executor if it still runs; its output stays readable."""
        if self._final_output is not None:
            return
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(5)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if self.process.stdin is not None:
            with contextlib.suppress(OSError):
                self.process.stdin.close()
        self._final_output = (_read_whole(self._stdout), _read_whole(self._stderr))
        self._stdout.close()
        self._stderr.close()

    def _wait_for_announcement(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while True:
            for line in self.stdout_text().splitlines():
                if line.startswith(READY_MARKER):
                    self.census = json.loads(line[len(READY_MARKER) :])
                    return
            self._raise_if_exited()
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"no capture announcement after {timeout}s; stderr:\n{self.stderr_text()}"
                )
            time.sleep(_POLL_INTERVAL)

    def _raise_if_exited(self) -> None:
        returncode = self.process.poll()
        if returncode is not None:
            raise ExecutorExited(returncode, self.stderr_text())


@contextlib.contextmanager
def start_executor(
    directory: Path | str,
    *,
    mode: str | None = "sandbox",
    env: Mapping[str, str | None] | None = None,
    timeout: float = START_TIMEOUT,
) -> Iterator[ExecutorProcess]:
    """Start an executor (a cold start) and yield it once its socket accepts connections."""
    with _spawn(directory, mode=mode, env=env, stdin_pipe=False) as executor:
        executor.wait_until_serving(timeout)
        yield executor


@contextlib.contextmanager
def start_capture(
    directory: Path | str,
    *,
    preimport: tuple[str, ...] | list[str] = (),
    env: Mapping[str, str | None] | None = None,
    timeout: float = START_TIMEOUT,
) -> Iterator[ExecutorProcess]:
    """Start an executor in capture mode and yield it once it announces the capture point.

    Off gVisor this is the stdio trigger: the executor then blocks on stdin
    until :meth:`ExecutorProcess.hand_over`, which stands in for the restore.
    Its ``census`` holds the announced template census.
    """
    env = {**(env or {}), "READIE_PREIMPORT": ",".join(preimport)}
    with _spawn(directory, mode="capture", env=env, stdin_pipe=True) as executor:
        executor._wait_for_announcement(timeout)
        yield executor


@contextlib.contextmanager
def _spawn(
    directory: Path | str,
    *,
    mode: str | None,
    env: Mapping[str, str | None] | None,
    stdin_pipe: bool,
) -> Iterator[ExecutorProcess]:
    # Files, not pipes: nobody has to drain them for the executor to make progress,
    # and they can be read at any time without disturbing the writer.
    stdout = tempfile.TemporaryFile()
    stderr = tempfile.TemporaryFile()
    try:
        process = subprocess.Popen(
            EXECUTOR_COMMAND,
            env=executor_environ(directory, mode=mode, env=env),
            stdin=subprocess.PIPE if stdin_pipe else subprocess.DEVNULL,
            stdout=stdout,
            stderr=stderr,
        )
    except BaseException:
        stdout.close()
        stderr.close()
        raise
    executor = ExecutorProcess(process, Path(directory) / SOCKET_NAME, stdout, stderr)
    try:
        yield executor
    finally:
        executor.stop()


def _read_whole(file: IO[bytes]) -> str:
    # pread leaves the shared file offset alone, which the child is still writing at.
    fd = file.fileno()
    return os.pread(fd, os.fstat(fd).st_size, 0).decode("utf-8", "replace")
