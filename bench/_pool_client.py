"""A small client for ``readie pool``: spawn it, wait for ready, match results by id.

A thin adapter over the client's end of :class:`~readie_protocol.connection.PoolConnection`,
like ``readie.Pool``, but returning the lines as the dicts the pool wrote
(the scenarios read fields the way a JSONL user would). The reader thread
timestamps each line as it arrives, so a waiting thread's wake-up delay is
not charged to the pool. Host-function ``call`` events are answered by a
per-request handler (see the host_function scenario).
"""

from __future__ import annotations

import itertools
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from readie import MAX_EVENT_LINE_BYTES
from readie_protocol.connection import ENDED, NEED_DATA, PoolConnection, Role, Stray
from readie_protocol.errors import ReadieError
from readie_protocol.events import CallEvent, OutputEvent, ReadyEvent
from readie_protocol.requests import ReplyRequest, Request
from readie_protocol.wire import RequestId

# Start-up restores ``workers`` warm sandboxes before the ready event (~0.5 s
# each, one at a time); a minute covers a loaded machine.
READY_TIMEOUT_S = 90.0
# EOF drains the pool: accepted jobs finish, sandboxes are destroyed.
EXIT_TIMEOUT_S = 60.0

READ_BYTES = 64 * 1024

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
    return [sys.executable, "-c", "import sys; from readie.cli import main; sys.exit(main())"]


class PoolClient:
    def __init__(
        self, process: subprocess.Popen[bytes], connection: PoolConnection, ready: ReadyEvent, log_path: Path
    ) -> None:
        self.process = process
        self._connection = connection
        self.ready = ready.to_json()
        self.log_path = log_path
        self._ids = itertools.count(1)
        self._write_lock = threading.Lock()
        self._connection_lock = threading.Lock()
        self._lock = threading.Lock()
        self._waiting: dict[str, _Waiter] = {}
        self._handlers: dict[str, CallHandler] = {}
        self._outputs: dict[str, int] = {}  # output events read so far, by request
        self._dead: str | None = None
        self._reader = threading.Thread(target=self._read_loop, name="pool-reader", daemon=True)
        self._reader.start()

    @classmethod
    def start(
        cls,
        manifest: Path,
        preimport: tuple[str, ...],
        workers: int,
        log_path: Path,
        router: str | None = None,
        args: Sequence[str] = (),
    ) -> PoolClient:
        """``router`` (HOST:PORT): ``readie pool --router``, its jobs and sessions run on the router's workers;
        ``args``: further flags (``--state-dir``, ``--max-sessions``)."""
        command = [
            *readie_command(),
            "pool",
            f"--workers={workers}",
            f"--preload={','.join(preimport)}",
            f"--checkpoints={manifest}",
            *([f"--router={router}"] if router else []),
            *args,
        ]
        return cls.spawn(command, log_path)

    @classmethod
    def spawn(cls, command: Sequence[str], log_path: Path) -> PoolClient:
        """Any command that speaks the pool protocol on its stdin and stdout (``bench._host_pool``)."""
        with open(log_path, "ab") as log:
            process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log)
        connection = PoolConnection(Role.CLIENT, max_line_bytes=MAX_EVENT_LINE_BYTES)
        try:
            ready = _first_event(process, connection, READY_TIMEOUT_S)
        except (ReadieError, TimeoutError) as exc:
            process.kill()
            process.wait()
            tail = log_path.read_text(errors="replace")[-800:].strip()
            raise PoolError(f"no ready event ({exc}): {tail}") from None
        return cls(process, connection, ready, log_path)

    def request(
        self, make: Callable[[RequestId], Request], timeout: float, on_call: CallHandler | None = None
    ) -> tuple[dict[str, Any], float]:
        """Send the request ``make`` builds for an id of ours; return its answer's line and the seconds
        from encoding it to its answer's arrival."""
        request_id = f"b{next(self._ids)}"
        waiter = _Waiter()
        with self._lock:
            if self._dead is not None:
                raise PoolError(self._dead)
            self._waiting[request_id] = waiter
            if on_call is not None:
                self._handlers[request_id] = on_call
        try:
            # Timed from the line's encoding on: building the request is the bench's own work
            # (its fields go through the protocol's parser), not the client's nor the pool's.
            request = make(request_id)
            started = time.monotonic()
            self._write(request)
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

    def _write(self, request: Request) -> None:
        assert self.process.stdin is not None
        with self._connection_lock:
            data = self._connection.send(request)
        with self._write_lock:
            try:
                self.process.stdin.write(data)
                self.process.stdin.flush()
            except OSError as exc:
                raise PoolError(f"cannot write to the pool: {exc}") from None

    def _read_loop(self) -> None:
        assert self.process.stdout is not None
        why = None
        try:
            while (event := self._next_event()) is not ENDED:
                arrived = time.monotonic()
                if isinstance(event, CallEvent):
                    self._answer_call(event)
                    continue
                if isinstance(event, Stray):
                    continue
                if isinstance(event, OutputEvent):  # counted, and handed over with the result
                    with self._lock:
                        self._outputs[str(event.id)] = self._outputs.get(str(event.id), 0) + 1
                    continue
                with self._lock:
                    waiter = self._waiting.get(str(event.id))
                if waiter is not None:
                    with self._lock:
                        outputs = self._outputs.pop(str(event.id), 0)
                    waiter.result, waiter.arrived = {**event.to_json(), "output_events": outputs}, arrived
                    waiter.done.set()
        except ReadieError as exc:
            why = str(exc)
        with self._lock:
            self._dead = f"{why or 'the pool exited'} (code {self.process.poll()}); see {self.log_path}"
            for waiter in self._waiting.values():
                waiter.done.set()

    def _next_event(self) -> Any:
        while (event := self._locked_next()) is NEED_DATA:
            data = self.process.stdout.read1(READ_BYTES)  # type: ignore[union-attr]
            with self._connection_lock:
                self._connection.receive_data(data)
        return event

    def _locked_next(self) -> Any:
        # Sending registers the answer it expects: one lock for both sides of the
        # connection, never held while a pipe blocks.
        with self._connection_lock:
            return self._connection.next_event()

    def _answer_call(self, event: CallEvent) -> None:
        with self._lock:
            handler = self._handlers.get(str(event.id))
        try:
            reply = handler(event.to_json()) if handler else {"error": "no handler in the bench"}
        except Exception as exc:  # a handler bug becomes the task's HostError, not a hang
            reply = {"error": f"bench handler failed: {exc}"}
        self._write(ReplyRequest(event.call_id, **reply))


def _first_event(process: subprocess.Popen[bytes], connection: PoolConnection, timeout: float) -> ReadyEvent:
    """The ready event, within ``timeout`` (the pool may hang at start)."""
    assert process.stdout is not None
    deadline = time.monotonic() + timeout
    while (event := connection.next_event()) is NEED_DATA:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([process.stdout], [], [], remaining)[0]:
            raise TimeoutError(f"nothing within {timeout:.0f} s")
        connection.receive_data(os.read(process.stdout.fileno(), READ_BYTES))
    if not isinstance(event, ReadyEvent):
        raise TimeoutError("the pool's output ended before its ready event")
    return event
