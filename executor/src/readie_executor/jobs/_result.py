"""The job result: a bounded JSON object, UTF-8, every key always present.

Every string is cut to a byte budget measured as it will cross the wire
(JSON-escaped, UTF-8: ``_bounds.fit_text``), so the whole result fits in
:func:`._bounds.result_budget` however hostile the output or the exception is.
"""

from __future__ import annotations

import errno
import json
import os
import platform
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ._bounds import (
    HINTED_ERROR_TYPES,
    MAX_ERROR_MESSAGE,
    MAX_ERROR_TYPE,
    MAX_EXIT_STATUS,
    MAX_FILE_NAME,
    MAX_HINT,
    MAX_LINE_NUMBER,
    MAX_MODULE_NAME,
    MAX_POLICY_NOTE,
    MAX_POLICY_NOTES,
    MAX_PRELOADED_MODULES,
    MAX_PYTHON_VERSION,
    clean_text,
    encoded_size,
    fit_text,
    result_budget,
)
from ._capture import CapturedBytes
from ._phases import PhaseClock
from ._spec import JobSpec

# clean_text, encoded_size and fit_text are the bounds' measure, used here and re-exported.
__all__ = [
    "ErrorReport", "clean_text", "describe_exception", "encode_result", "encoded_size", "fit_stream",
    "fit_text", "safe_repr", "safe_str",
]

def fit_stream(captured: CapturedBytes, max_output: int) -> tuple[str, bool]:
    text, cut = fit_text(captured.data.decode("utf-8", "replace"), max_output)
    return text, cut or captured.total > len(captured.data)


@dataclass(frozen=True, slots=True)
class ErrorReport:
    """A job's error as the sandbox reports it in its result JSON, cut to the bounds on the way out.

    The host parses it into ``readie_protocol.results.ErrorInfo``; this side
    is standard library only, so it cannot share that class.
    """

    type: str
    message: str
    file: str | None = None
    line: int | None = None
    hint: str | None = None

    def as_json(self) -> dict[str, Any]:
        error: dict[str, Any] = {
            "type": fit_text(self.type, MAX_ERROR_TYPE)[0],
            "message": fit_text(self.message, MAX_ERROR_MESSAGE)[0],
            "file": None if self.file is None else fit_text(self.file, MAX_FILE_NAME)[0],
            "line": self.line
            if self.line is None or 0 <= self.line <= MAX_LINE_NUMBER
            else None,
        }
        if self.type in HINTED_ERROR_TYPES:
            error["hint"] = fit_text(self.hint or "", MAX_HINT)[0]
        return error


def describe_exception(exc: BaseException, spec: JobSpec, memory_limit: int | None) -> ErrorReport:
    file, line = locate(exc, spec.name)
    read_only, filename = _read_only_file_system(exc)
    if read_only:
        # gVisor answers a write to a read-only bind mount with EROFS; on a
        # host with Landlock the same write is EACCES, which is what callers
        # of the pool expect.
        message = f"[Errno {errno.EACCES}] {os.strerror(errno.EACCES)}"
        if filename is not None:
            message += f": {filename!r}"
        hint = (
            permission_hint(spec)
            + " (The sandbox answered EROFS: the path is on a read-only mount.)"
        )
        return ErrorReport("PermissionError", message, file, line, hint)
    exc_type = type(exc).__name__
    hint = None
    if isinstance(exc, PermissionError):
        hint = permission_hint(spec)
    elif isinstance(exc, MemoryError):
        hint = memory_hint(memory_limit)
    return ErrorReport(exc_type, safe_str(exc), file, line, hint)


def _read_only_file_system(exc: BaseException) -> tuple[bool, str | None]:
    """Whether ``exc`` is an EROFS OSError, and its file name if it has one."""
    # The exception is the job's object, so its attributes may be properties that raise.
    try:
        if isinstance(exc, OSError) and exc.errno == errno.EROFS:
            return True, None if exc.filename is None else safe_str(exc.filename)
    except Exception:
        pass
    return False, None


def locate(exc: BaseException, name: str) -> tuple[str | None, int | None]:
    """The innermost frame in the job's own file, else the innermost frame."""
    if isinstance(exc, SyntaxError) and exc.filename == name:
        return name, exc.lineno
    found: tuple[str | None, int | None] = (None, None)
    last: tuple[str | None, int | None] = (None, None)
    tb: TracebackType | None = exc.__traceback__
    while tb is not None:
        last = (tb.tb_frame.f_code.co_filename, tb.tb_lineno)
        if last[0] == name:
            found = last
        tb = tb.tb_next
    return found if found[0] is not None else last


def permission_hint(spec: JobSpec) -> str:
    writable = [link.path for link in spec.links if link.writable]
    readable = [link.path for link in spec.links if not link.writable]
    workspace = spec.workspace
    parts = [
        f"This job may write only beneath its workspace ({workspace})"
        + (" and its write grants: " + ", ".join(writable) if writable else " (it has no write grants)")
        + ".",
        "Read-only grants: " + (", ".join(readable) if readable else "none") + ".",
    ]
    if not spec.limits.subprocesses:
        parts.append("Subprocesses are not allowed.")
    return " ".join(parts)


def memory_hint(memory_limit: int | None) -> str:
    if memory_limit is None:
        return "No memory limit was set for this job: the sandbox itself ran out of memory."
    return (
        f"The job may use {memory_limit} bytes ({memory_limit / 2**20:.0f} MiB) of memory beyond "
        "the interpreter's own; use less or ask for a higher memory limit."
    )


def encode_result(
    *,
    exit_status: int,
    stdout: CapturedBytes,
    stderr: CapturedBytes,
    error: ErrorReport | None,
    duration_us: int,
    preloaded_modules: list[str],
    policy_notes: list[str],
    max_output: int,
    system_exit: bool = False,
    timed_out: bool = False,
    value: dict[str, Any] | None = None,
    phases: PhaseClock | None = None,
) -> bytes:
    stdout_text, stdout_truncated = fit_stream(stdout, max_output)
    stderr_text, stderr_truncated = fit_stream(stderr, max_output)
    result = {
        "exit": exit_status & MAX_EXIT_STATUS,
        "system_exit": system_exit,
        "timed_out": timed_out,
        "stdout": stdout_text,
        "stderr": stderr_text,
        "stdout_truncated": stdout_truncated,
        "stderr_truncated": stderr_truncated,
        "error": None if error is None else error.as_json(),
        "duration_us": max(0, duration_us),
        "preloaded_modules": [
            fit_text(module, MAX_MODULE_NAME)[0]
            for module in preloaded_modules[: MAX_PRELOADED_MODULES]
        ],
        "python": fit_text(platform.python_version(), MAX_PYTHON_VERSION)[0],
        "policy_notes": [
            fit_text(note, MAX_POLICY_NOTE)[0]
            for note in policy_notes[: MAX_POLICY_NOTES]
        ],
        "value": value,  # shown by _value.show_value, which keeps it within its caps
    }
    if phases is not None and phases.on:
        # Optional (a result without it is as valid): the JSON encoding below is the one part of
        # the runner's work no phase holds; the worker's clock has it, with the socket hops.
        phases.lap("encode")
        result["phases"] = phases.microseconds()
    encoded = json.dumps(result, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    budget = result_budget(max_output)
    if len(encoded) > budget:  # cannot happen if the bounds add up; never send more than promised
        raise AssertionError(f"job result of {len(encoded)} bytes exceeds its budget of {budget}")
    return encoded


def safe_repr(value: object) -> str:
    """repr() of the job's object, which may raise; an interrupt (the deadline) is not caught."""
    try:
        text = repr(value)
        # An exact str: a subclass's slicing and encoding would be the job's code, run unguarded later.
        return str.__str__(text) if isinstance(text, str) else f"<{type(value).__name__}>"
    except Exception:  # noqa: BLE001
        return f"<{type(value).__name__}: repr() failed>"


def safe_str(value: object) -> str:
    """str() of something the job made, which may raise or misbehave."""
    try:
        text = str(value)
        return str.__str__(text) if isinstance(text, str) else f"<{type(value).__name__}>"  # exact, as safe_repr
    except BaseException:
        return f"<{type(value).__name__}: str() failed>"
