"""One call: a cloudpickled request in, a cloudpickled envelope out, whatever happens."""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import time
import traceback
from collections.abc import Callable, Iterator
from typing import Any

import cloudpickle

# Captured output is held in memory until the envelope is sent; past this a
# chatty function's output is cut (with a marker) instead of exhausting the
# sandbox's memory before it can answer.
MAX_CAPTURED_OUTPUT = 16 * 1024 * 1024
TRUNCATION_MARKER = "\n[readie: output truncated at {limit} characters]\n"
RESOLV_CONF = "/etc/resolv.conf"
# A function carrying this attribute (set to True) that returns bytes (or a
# bytearray) is answered with those bytes as they are, not with a pickled envelope. Code jobs
# (readie_executor.jobs.run_job) use it so that the worker, which must never
# unpickle what comes out of a sandbox, gets plain JSON. This adds no risk:
# job code runs in this process and could tamper with the executor to send
# any bytes anyway, so the worker treats the response as hostile JSON either
# way, and the marked function is chosen by whoever sent the request.
RAW_RESPONSE_ATTRIBUTE = "__readie_raw_response__"


class InvalidRequest(Exception):
    pass


# When the running call began, before its request was unpickled: where a code job's phase
# clock starts (jobs/_phases.py). None outside a call.
_call_started_ns: int | None = None


def call_started_ns() -> int | None:
    """``time.perf_counter_ns()`` when the running call began; None outside one."""
    return _call_started_ns


def run_call(request: bytes) -> bytes | bytearray:
    """Decode, run and answer one request. Never raises."""
    global _call_started_ns
    _call_started_ns = time.perf_counter_ns()
    try:
        return _run_call(request)
    finally:
        _call_started_ns = None


def _run_call(request: bytes) -> bytes | bytearray:
    output = CapturedOutput(MAX_CAPTURED_OUTPUT)
    try:
        func, args, kwargs = decode_request(request)
    except InvalidRequest as exc:
        return _dump(failure("InvalidRequest", str(exc), "", output))
    ensure_resolver()
    with output.redirect():
        try:
            value = func(*args, **kwargs)
        except BaseException as exc:  # SystemExit and KeyboardInterrupt are answers too
            envelope = failure(type(exc).__name__, _safe_str(exc), _format_traceback(exc), output)
        else:
            if isinstance(value, (bytes, bytearray)) and _wants_raw_response(func):
                return value  # the bytes are the whole answer; output captured around it is dropped
            envelope = {"ok": True, "value": value, "output": output.texts()}
    return _dump(envelope, output)


def _wants_raw_response(func: Callable[..., Any]) -> bool:
    try:
        return getattr(func, RAW_RESPONSE_ATTRIBUTE, False) is True
    except BaseException:  # a callable with a hostile __getattr__ gets the usual envelope
        return False


def decode_request(request: bytes) -> tuple[Callable[..., Any], tuple[Any, ...], dict[str, Any]]:
    try:
        decoded = pickle.loads(request)
    except BaseException as exc:
        raise InvalidRequest(f"request cannot be unpickled: {type(exc).__name__}: {_safe_str(exc)}") from None
    if not isinstance(decoded, dict):
        raise InvalidRequest(f"request must be a dict, got {type(decoded).__name__}")
    missing = [key for key in ("func", "args", "kwargs") if key not in decoded]
    if missing:
        raise InvalidRequest(f"request lacks {', '.join(missing)}")
    # An older client's "packages" key is accepted and ignored (the worker installs packages).
    func, args, kwargs = decoded["func"], decoded["args"], decoded["kwargs"]
    if not callable(func):
        raise InvalidRequest(f"func must be callable, got {type(func).__name__}")
    if not isinstance(args, (tuple, list)):
        raise InvalidRequest(f"args must be a tuple, got {type(args).__name__}")
    if not isinstance(kwargs, dict) or not all(isinstance(key, str) for key in kwargs):
        raise InvalidRequest("kwargs must be a dict with string keys")
    return func, tuple(args), kwargs


def failure(exc_type: str, message: str, tb: str, output: CapturedOutput) -> dict[str, Any]:
    return {"ok": False, "exc_type": exc_type, "message": message, "traceback": tb, "output": output.texts()}


def _dump(envelope: dict[str, Any], output: CapturedOutput | None = None) -> bytes:
    try:
        return cloudpickle.dumps(envelope)
    except BaseException as exc:
        value_type = type(envelope.get("value")).__qualname__
        message = f"the return value ({value_type}) cannot be pickled: {type(exc).__name__}: {_safe_str(exc)}"
        described = failure("PicklingError", message, _format_traceback(exc), output or CapturedOutput(0))
        return cloudpickle.dumps(described)


def ensure_resolver() -> None:
    """Point DNS at READIE_NAMESERVER when the sandbox has no resolver configured.

    Only the worker's networked sandboxes set READIE_NAMESERVER; without it this
    does nothing, so a development run never edits the host's resolver.
    """
    nameserver = os.environ.get("READIE_NAMESERVER")
    if not nameserver:
        return
    try:
        with open(RESOLV_CONF, encoding="utf-8") as existing:
            if any(line.split()[:1] == ["nameserver"] for line in existing):
                return
    except OSError:
        pass
    with contextlib.suppress(OSError):
        with open(RESOLV_CONF, "w", encoding="utf-8") as conf:
            conf.write(f"nameserver {nameserver}\n")


class CapturedOutput:
    """stdout and stderr of one call, in order, bounded."""

    def __init__(self, limit: int) -> None:
        self._limit = limit
        self._size = 0
        self._pieces: list[str] = []
        self._truncated = False

    def write(self, text: str) -> None:
        if self._truncated or not text:
            return
        room = self._limit - self._size
        if len(text) > room:
            text = text[:room] + TRUNCATION_MARKER.format(limit=self._limit)
            self._truncated = True
        self._pieces.append(text)
        self._size += len(text)

    def texts(self) -> list[str]:
        return ["".join(self._pieces)] if self._pieces else []

    @contextlib.contextmanager
    def redirect(self) -> Iterator[None]:
        stream = _Stream(self)
        with contextlib.redirect_stdout(stream), contextlib.redirect_stderr(stream):
            yield


class _Stream(io.TextIOBase):
    def __init__(self, sink: CapturedOutput) -> None:
        self._sink = sink

    def writable(self) -> bool:
        return True

    def write(self, text: str) -> int:
        if not isinstance(text, str):
            raise TypeError(f"write() argument must be str, not {type(text).__name__}")
        self._sink.write(text)
        return len(text)


def _format_traceback(exc: BaseException) -> str:
    try:
        return "".join(traceback.format_exception(exc))
    except BaseException:
        return ""


def _safe_str(exc: BaseException) -> str:
    try:
        return str(exc)
    except BaseException:
        return f"<{type(exc).__name__}: str() failed>"
