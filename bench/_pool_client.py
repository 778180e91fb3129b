"""A small client for ``readie pool``: spawn it, wait for ready, match results by id.

The reader thread timestamps each line as it arrives, so a waiting thread's
wake-up delay is not charged to the pool. Host-function ``call`` events are
answered by a per-request handler (see the host_function scenario).
"""

from __future__ import annotations

import itertools
import json
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, IO

# Start-up restores ``workers`` warm sandboxes before the ready event (~0.5 s
# each, one at a time); a minute covers a loaded machine.
READY_TIMEOUT_S = 90.0
# EOF drains the pool: accepted jobs finish, sandboxes are destroyed.
EXIT_TIMEOUT_S = 60.0

CallHandler = Callable[[dict[str, Any]], dict[str, Any]]


class PoolError(Exception):
    """The pool did not start, died, or did not answer in time."""


class _Waiter:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.result: dict[str, Any] | None = None
        self.arrived = 0.0


def readie_command() -> list[str]:
    entry_point = Path(sys.executable).with_name("readie")
    if entry_point.exists():
        return [str(entry_point)]
    return [sys.executable, "-c", "import sys; from readie._cli import main; sys.exit(main())"]


class PoolClient:
    def __init__(self, process: subprocess.Popen[bytes], ready: dict[str, Any], log_path: Path) -> None:
        self.process = process
        self.ready = ready
        self.log_path = log_path
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiter] = {}
        self._handlers: dict[str, CallHandler] = {}
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="pool-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls, manifest: Path, preimport: tuple[str, ...], workers: int, log_path: Path, router: str | None = None
    ) -> PoolClient:
        """``router`` (HOST:PORT): ``readie pool --router``, its jobs and sessions run on the router's workers."""
        command = [
            *readie_command(),
            "pool",
            f"--workers={workers}",
            f"--preload={','.join(preimport)}",
            f"--checkpoints={manifest}",
            *([f"--router={router}"] if router else []),
        ]
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        assert process.stdout is not None
        line = _readline(process.stdout, READY_TIMEOUT_S)
        try:
            ready = json.loads(line) if line else None
        except ValueError:
            ready = None
        if not isinstance(ready, dict) or ready.get("event") != "ready":
            process.kill()
            process.wait()
            tail = log_path.read_text(errors="replace")[-800:].strip()
            raise PoolError(f"no ready event (first line {line[:200]!r}): {tail}")
        return cls(process, ready, log_path)

    def request(
        self, body: dict[str, Any], timeout: float, on_call: CallHandler | None = None
    ) -> tuple[dict[str, Any], float]:
        """Send one request; return its result line and the seconds from write to arrival."""
        request_id = f"b{next(self._ids)}"
        waiter = _Waiter()
        with self._lock:
            if self._dead is not None:
                raise PoolError(self._dead)
            self._waiting[request_id] = waiter
            if on_call is not None:
                self._handlers[request_id] = on_call
        try:
            started = time.monotonic()
            self._write({"id": request_id, **body})
            if not waiter.done.wait(timeout):
                raise PoolError(f"no result for {request_id} within {timeout:.0f} s")
            if waiter.result is None:
                raise PoolError(self._dead or "the pool closed its stdout")
            return waiter.result, waiter.arrived - started
        finally:
            with self._lock:
                self._waiting.pop(request_id, None)
                self._handlers.pop(request_id, None)

    def close(self) -> int | None:
        """EOF on stdin (the pool drains and exits 0); kill only if it does not."""
        try:
            if self.process.stdin is not None:
                self.process.stdin.close()
        except OSError:
            pass
        try:
            return self.process.wait(EXIT_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()
            return None
        finally:
            self._reader.join(5)

    def _write(self, obj: dict[str, Any]) -> None:
        data = json.dumps(obj).encode() + b"\n"
        assert self.process.stdin is not None
        with self._write_lock:
            try:
                self.process.stdin.write(data)
                self.process.stdin.flush()
            except OSError as exc:
                raise PoolError(f"cannot write to the pool: {exc}") from None

    def _read_loop(self) -> None:
        assert self.process.stdout is not None
        for line in self.process.stdout:
            arrived = time.monotonic()
            try:
                obj = json.loads(line)
            except ValueError:
                continue
            if not isinstance(obj, dict):
                continue
            if obj.get("event") == "call":
                self._answer_call(obj)
                continue
            with self._lock:
                waiter = self._waiting.get(str(obj.get("id")))
            if waiter is not None:
                waiter.result, waiter.arrived = obj, arrived
                waiter.done.set()
        with self._lock:
            self._dead = f"the pool exited (code {self.process.poll()}); see {self.log_path}"
            for waiter in self._waiting.values():
                waiter.done.set()

    def _answer_call(self, event: dict[str, Any]) -> None:
        with self._lock:
            handler = self._handlers.get(str(event.get("id")))
        try:
            reply = handler(event) if handler else {"error": "no handler in the bench"}
        except Exception as exc:  # a handler bug becomes the task's HostError, not a hang
            reply = {"error": f"bench handler failed: {exc}"}
        self._write({"reply": {"call_id": event.get("call_id"), **reply}})


def _readline(stream: IO[bytes], timeout: float) -> bytes:
    """One line from a pipe, or b"" after ``timeout`` (the pool may hang at start)."""
    box: list[bytes] = []
    reader = threading.Thread(target=lambda: box.append(stream.readline()), daemon=True)
    reader.start()
    reader.join(timeout)
    return box[0] if box else b""
