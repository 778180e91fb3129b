"""Floors: what the hops a figure cannot avoid cost on this machine, with no readie code on them.

Issue 31 asks for a host call in 0.3 ms and a router hop nearly free. Every
host call crosses the sandbox's socket twice and the pool's process boundary
(the worker is root, the client is not: they are two processes) twice; a routed
one also crosses two gRPC streams each way. Measured bare, in the same run as
the figures they bound, these say how far a figure is from what the machine
allows, and whether an ask is below that at all:

* ``sandbox_echo_us``: one byte into a restored sandbox and back over a Unix
  socket it bound in its ``/readie/run`` (as the executor binds its own), echoed
  by a thread that does nothing else: gVisor's wake-ups and system calls alone;
* ``process_round_trip_us``: one byte to a child Python and back over two pipes;
* ``chained_call_us``: the two chained as a host call chains them: the sandbox
  sends a byte, the host passes it to a child Python and back, then into the
  sandbox, timed inside the sandbox as host calls are. Each side now waits
  while the other works, as in a call, which the two alone never do: this is
  a host call's least, with no readie code anywhere on it;
* :class:`StreamEcho`: one message and its answer on an open bidirectional
  stream (the server's reflection service: no work in the handler), from a
  synchronous client fed by a queue, as readie's clients are.

The first three are timed back to back (:func:`timed`) after a few unmeasured
rounds, as the host calls they bound are (a task's calls follow one
another). The stream is timed both ways: back to back for the host call's
floor, and each after the machine settled, as the session steps it bounds
are (an idle chain of threads wakes slower than a busy one).
"""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import queue
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

import grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc
from readie_worker.bundle import EXECUTOR_DIR
from readie_worker.errors import ReadieError
from readie_worker.sandbox import Sandbox

from ._stats import summary

# Rounds run before the measured ones: the first wake the threads and fill the caches.
UNMEASURED = 20
# The echo child ends with its pipe; one that outlives it by this long is a broken run.
ECHO_EXIT_TIMEOUT_S = 10.0
# One byte in, the same byte out, until the pipe ends.
_ECHO = "import os\nwhile os.write(1, os.read(0, 1)): pass\n"
# The same inside a sandbox, on a thread of the executor's, for one connection.
_ECHO_IN_SANDBOX = """
import socket, threading
def serve(listener):
    connection, _ = listener.accept()
    listener.close()
    with connection:
        while data := connection.recv(1):
            connection.sendall(data)
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(PATH)
listener.listen(1)
threading.Thread(target=serve, args=(listener,), daemon=True).start()
"""
# The sandbox's side of a chained call: once the host says go (a byte), ROUNDS round trips
# begun and timed in the sandbox, then their times in µs as one JSON line.
_CHAIN_IN_SANDBOX = """
import json, socket, threading, time
def serve(listener):
    connection, _ = listener.accept()
    listener.close()
    times = []
    with connection:
        if connection.recv(1) != b"g":
            return
        for _ in range(ROUNDS):
            started = time.perf_counter_ns()
            connection.sendall(b"x")
            if connection.recv(1) != b"x":
                return
            times.append((time.perf_counter_ns() - started) / 1000)
        connection.sendall(json.dumps(times).encode() + b"\\n")
listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
listener.bind(PATH)
listener.listen(1)
threading.Thread(target=serve, args=(listener,), daemon=True).start()
"""
# What the chain's timings may take on the way out: 300 samples are ~6 KB.
MAX_CHAIN_REPORT_BYTES = 1 << 20
# In the sandbox's /readie/run, the executor's socket's dir; no longer a name than its socket's,
# so the path fits wherever the executor's does.
_ECHO_PATH = EXECUTOR_DIR / "echo.sock"
# Starting the echo and each of its round trips; longer is a broken run.
ECHO_START_TIMEOUT_S = 10.0


# What a floor that could not be measured raises: the scenario reports it and keeps its figures.
FLOOR_ERRORS = (OSError, RuntimeError, subprocess.SubprocessError, grpc.RpcError, ReadieError)


def measured(take: Callable[[], list[float]], digits: int) -> dict[str, Any]:
    """``summary`` of what ``take`` times, or ``{"n": 0, "error": ...}`` when it could not."""
    try:
        return summary(take(), digits=digits)
    except FLOOR_ERRORS as exc:
        return {"n": 0, "error": f"{type(exc).__name__}: {exc}"}


def timed(round_trip: Callable[[], object], samples: int, unit_ns: int) -> list[float]:
    """``samples`` timings of ``round_trip``, in units of ``unit_ns``, after :data:`UNMEASURED` ones."""
    times = []
    for index in range(UNMEASURED + samples):
        started = time.perf_counter_ns()
        round_trip()
        if index >= UNMEASURED:
            times.append((time.perf_counter_ns() - started) / unit_ns)
    return times


def _serving(sandbox: Sandbox, code: str, **names: object) -> socket.socket:
    """A connection to the socket that ``code``, run in ``sandbox`` with ``names`` and ``PATH``, serves.

    The code is started through the executor (``exec``: a builtin, so nothing is imported
    there); its answer, a pickle from the sandbox, is not opened: the socket appearing is the
    answer. The sandbox is the bench's own, just restored, running only this code, so its
    directory is trusted here as the worker never trusts a job's.
    """
    names["PATH"] = str(_ECHO_PATH)
    sandbox.call(pickle.dumps({"func": exec, "args": (code, names), "kwargs": {}}), timeout=ECHO_START_TIMEOUT_S)
    connection = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        connection.settimeout(ECHO_START_TIMEOUT_S)
        connection.connect(str(sandbox.dir.executor_dir / _ECHO_PATH.name))
    except BaseException:
        connection.close()
        raise
    return connection


def sandbox_echo_us(sandbox: Sandbox, samples: int, before: Callable[[], object] = lambda: None) -> list[float]:
    """Round trips of a byte into ``sandbox`` and back, timed once ``before()`` returns (a settle:
    the restore's own work done); the sandbox is left serving the echo (destroy it after)."""
    with _serving(sandbox, _ECHO_IN_SANDBOX) as connection:
        before()

        def round_trip() -> None:
            connection.sendall(b"x")
            if connection.recv(1) != b"x":
                raise RuntimeError("the sandbox's echo did not answer")

        return timed(round_trip, samples, 1000)


def process_round_trip_us(samples: int) -> list[float]:
    with _echo_child() as round_trip:
        return timed(round_trip, samples, 1000)


def chained_call_us(sandbox: Sandbox, samples: int, before: Callable[[], object] = lambda: None) -> list[float]:
    """A host call's crossings chained, timed in ``sandbox`` once ``before()`` returns: the
    sandbox sends a byte, this thread passes it to a child process and back, then into the
    sandbox. The sandbox is left serving (destroy it after)."""
    rounds = UNMEASURED + samples
    with _serving(sandbox, _CHAIN_IN_SANDBOX, ROUNDS=rounds) as connection, _echo_child() as child_round_trip:
        before()
        connection.sendall(b"g")
        for _ in range(rounds):
            if connection.recv(1) != b"x":
                raise RuntimeError("the sandbox's chain stopped")
            child_round_trip()
            connection.sendall(b"x")
        report = b""
        while not report.endswith(b"\n") and len(report) < MAX_CHAIN_REPORT_BYTES:
            data = connection.recv(MAX_CHAIN_REPORT_BYTES)
            if not data:
                break
            report += data
    try:
        times = json.loads(report)
    except ValueError:
        raise RuntimeError(f"the sandbox's chain reported {report[:80]!r}") from None
    if not isinstance(times, list) or len(times) != rounds:
        raise RuntimeError("the sandbox's chain reported the wrong number of round trips")
    return [float(t) for t in times[UNMEASURED:]]


@contextlib.contextmanager
def _echo_child() -> Iterator[Callable[[], None]]:
    """A child Python echoing bytes on two pipes; yields one round trip through it."""
    child = subprocess.Popen([sys.executable, "-c", _ECHO], stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
    assert child.stdin is not None and child.stdout is not None
    to_child, from_child = child.stdin.fileno(), child.stdout.fileno()

    def round_trip() -> None:
        os.write(to_child, b"x")
        if os.read(from_child, 1) != b"x":
            raise RuntimeError("the echo child did not answer")

    try:
        yield round_trip
    finally:
        child.stdin.close()
        child.stdout.close()
        try:
            child.wait(timeout=ECHO_EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


class StreamEcho:
    """One open ``ServerReflectionInfo`` stream to the server behind a channel: each
    :meth:`round_trip` sends a message and waits for its answer. A context manager."""

    def __init__(self, channel: grpc.Channel, lifetime_s: float) -> None:
        self._requests: queue.SimpleQueue[reflection_pb2.ServerReflectionRequest | None] = queue.SimpleQueue()
        self._ask = reflection_pb2.ServerReflectionRequest(list_services="")
        stub = reflection_pb2_grpc.ServerReflectionStub(channel)
        self._answers: Iterator[reflection_pb2.ServerReflectionResponse] = stub.ServerReflectionInfo(
            iter(self._requests.get, None), timeout=lifetime_s
        )

        self.error: str | None = None  # why a round trip failed; none is tried after

    def round_trip(self) -> None:
        self._requests.put(self._ask)
        answer = next(self._answers, None)
        if answer is None or not answer.HasField("list_services_response"):
            raise RuntimeError("the reflection stream ended or answered something else")

    def once_ms(self) -> float | None:
        """One round trip, in ms; None once one has failed (``error`` says why)."""
        if self.error is not None:
            return None
        started = time.perf_counter_ns()
        try:
            self.round_trip()
        except FLOOR_ERRORS as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            return None
        return (time.perf_counter_ns() - started) / 1e6

    def __enter__(self) -> StreamEcho:
        return self

    def __exit__(self, *_: object) -> None:
        self._requests.put(None)
        self._answers.cancel()  # type: ignore[attr-defined] - a grpc call is also its own future

