"""run_job: one code job, from the worker's job dict to the result's JSON bytes.

Order matters: links and the seccomp filter first (setup that may fail
cleanly), then the output capture (its thread exists before the memory limit
is measured), then the process state the job sees, the limits, and last the
audit-hook guard around nothing but the job's own code.
"""

from __future__ import annotations

import contextlib
import importlib.machinery
import importlib.util
import itertools
import json
import linecache
import os
import sys
import time
import traceback
import types
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from .. import _channel
from .._calls import RAW_RESPONSE_ATTRIBUTE, call_started_ns
from .._settings import parse_preimport
from ._bounds import MAX_OUTPUT_LIMIT
from ._capture import CapturedBytes, OutputCapture
from ._guards import JobGuard, guarded, writable_roots
from ._host import declared
from ._phases import UNTIMED, PhaseClock
from ._limits import (
    JobTimedOut,
    apply_file_size_limit,
    apply_memory_limit,
    deadline,
    memory_limit_bytes,
    relax_memory_limit,
)
from ._result import ErrorReport, describe_exception, encode_result, safe_str
from ._seccomp import install_job_filter, job_filter_installed
from ._spec import JobSpec, JobSpecError, Link, parse_job
from ._value import compile_cell, show_value
from ._workspace import WorkspaceError, write_files

# Python's exit status for "could not start": ``python3 missing.py`` exits 2.
EXIT_NOT_STARTED = 2
EXIT_EXCEPTION = 1
# What timeout(1) exits with, as the pool protocol reports a timed-out job.
EXIT_TIMED_OUT = 124
PREIMPORT_VARIABLE = "READIE_PREIMPORT"
# Frames in the executor's own files (the exec call, the audit hook, host
# functions and their JSON encoder) are not the job's and are left out of its tracebacks.
_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep

# The ``__main__`` of a session, kept between calls like a notebook's kernel.
_session_module: types.ModuleType | None = None


class SetupError(Exception):
    """The sandbox could not be prepared for the job (a link, the working directory)."""


@dataclass(frozen=True, slots=True)
class _Outcome:
    exit_status: int
    error: ErrorReport | None
    duration_us: int
    system_exit: bool = False  # ended by SystemExit: in a session, that ends the session
    timed_out: bool = False  # stopped at its deadline: in a session, that ends the session too
    value: dict[str, Any] | None = None  # the last bare expression's, shown (_value.py)


def run_job(job: dict[str, object]) -> bytes:
    """Run one code job in this process and return its result as UTF-8 JSON. Never raises."""
    max_output = _declared_max_output(job)
    # Read before the spec is parsed, so that parsing is timed too; parse_job checks the field.
    clock = PhaseClock(call_started_ns()) if isinstance(job, dict) and job.get("phases") is True else UNTIMED
    clock.lap("request")
    try:
        spec = parse_job(job)
        max_output = spec.limits.max_output
        return _run(spec, clock)
    except JobSpecError as exc:
        return _not_started(ErrorReport("RequestError", str(exc)), max_output)
    except BaseException as exc:  # a bug here must still answer, not break the executor's reply
        message = f"internal error in the job runner: {type(exc).__name__}: {safe_str(exc)}"
        return _not_started(ErrorReport("SandboxSetupError", message), max_output)


# The executor sends these bytes back as they are instead of pickling them
# (see _calls.run_call): the worker must never unpickle what leaves a sandbox.
setattr(run_job, RAW_RESPONSE_ATTRIBUTE, True)

WARMED_UP = b"warm"
WARM_UP_NAME = "<readie warm-up>"
WARM_UP_CODE = 'print(end="")\nNone'


def warm_up(subprocesses: bool = False, max_output: int = 64) -> bytes:
    """Run a job that does nothing, so that the first real job does not pay first-touch costs.

    A restored sandbox pays on its first call for what the template never
    did: its first thread (the output drain thread, kept), pipes and
    descriptors, the seccomp filter, pages of the interpreter faulted in
    from the image. The worker calls this before it hands a restored sandbox
    out (in the background), so no job waits for them. The job asks for
    nothing else run_job keeps for the process (no links, rlimits or session
    ``__main__``). ``subprocesses`` must be what every later job gets: with
    False (the worker's only setting) the filter each job would install
    first is installed now, and the job finds it in place. ``max_output``:
    what most jobs ask (the worker's default), so that they find the output
    capture's buffers already mapped (``_capture.MAX_KEPT_BUFFER_BYTES``).
    """
    job = {
        # What a first job does on paths the template never took: a print (that writes
        # nothing) and a last bare expression, so that their pages are touched here.
        "code": WARM_UP_CODE,
        "name": WARM_UP_NAME,
        "limits": {"subprocesses": subprocesses, "max_output": max_output, "timeout_ms": 10_000},
    }
    result = json.loads(run_job(job))
    linecache.cache.pop(WARM_UP_NAME, None)
    # A policy note means the filter did not go in: such a sandbox is not handed out.
    if result["exit"] != 0 or result["error"] is not None or result["policy_notes"]:
        return b"warm-up failed: " + json.dumps([result["error"], result["policy_notes"]]).encode()
    return WARMED_UP


setattr(warm_up, RAW_RESPONSE_ATTRIBUTE, True)


def _run(spec: JobSpec, clock: PhaseClock) -> bytes:
    preloaded = preloaded_modules()
    notes: list[str] = []
    try:
        source = _read_source(spec)
    except OSError as exc:
        # What python3 itself says for a script it cannot open.
        stderr = (
            f"python3: can't open file {spec.script_path!r}: [Errno {exc.errno}] {exc.strerror}\n"
        )
        error = ErrorReport(type(exc).__name__, safe_str(exc), spec.script_path, None)
        return _not_started(error, spec.limits.max_output, stderr=stderr, preloaded=preloaded)
    clock.lap("spec")
    try:
        create_links(spec.links)
        if spec.nameserver is not None:
            name_resolver(spec.nameserver)
    except SetupError as exc:
        return _not_started(
            ErrorReport("SandboxSetupError", str(exc)), spec.limits.max_output, preloaded=preloaded
        )
    try:
        write_files(spec.workspace, spec.files)
    except WorkspaceError as exc:
        # The request's files cannot go where it says (a link or a directory in the way): the
        # request's fault, not the sandbox's, so a session goes on (decision 31).
        return _not_started(ErrorReport("RequestError", f"files: {exc}"), spec.limits.max_output, preloaded=preloaded)
    notes += _apply_subprocess_policy(spec.limits.subprocesses)
    channel = _channel.current() if spec.stream else None
    clock.lap("setup")
    capture = OutputCapture(
        spec.limits.max_output, channel.send if channel is not None else None, subprocesses=spec.limits.subprocesses
    )
    try:
        with capture.active():
            outcome = _execute(spec, source, notes, clock)
    except SetupError as exc:
        return _not_started(
            ErrorReport("SandboxSetupError", str(exc)), spec.limits.max_output, preloaded=preloaded
        )
    clock.lap("drain")
    return encode_result(
        exit_status=outcome.exit_status,
        stdout=capture.stdout,
        stderr=capture.stderr,
        error=outcome.error,
        duration_us=outcome.duration_us,
        preloaded_modules=preloaded,
        policy_notes=notes,
        max_output=spec.limits.max_output,
        system_exit=outcome.system_exit,
        timed_out=outcome.timed_out,
        value=outcome.value,
        phases=clock,
    )


def _execute(spec: JobSpec, source: str | bytes, notes: list[str], clock: PhaseClock) -> _Outcome:
    clock.lap("capture")
    try:
        return _execute_in_state(spec, source, notes, clock)
    finally:
        clock.lap("restore")


def _execute_in_state(spec: JobSpec, source: str | bytes, notes: list[str], clock: PhaseClock) -> _Outcome:
    module = _main_module(spec)
    # The workspace is the job's to write in (decision 31: what it saves there can be collected).
    workspace = spec.workspace
    guard = JobGuard(
        writable_roots=writable_roots(
            itertools.chain([workspace], (path for link in spec.writable_links for path in (link.path, link.target)))
        ),
        subprocesses=spec.limits.subprocesses,
    )
    with _job_process_state(spec, module), declared(spec.functions):
        clock.lap("state")
        try:
            # Code runs as a notebook cell: its last bare expression is shown. (The pool sends a
            # script's text as code too; only a script the sandbox reads itself is left as python3 runs it.)
            if spec.code is not None:
                code, last = compile_cell(source, spec.name)
            else:
                code, last = compile(source, spec.name, "exec", dont_inherit=True), None
        except BaseException as exc:  # SyntaxError, or ValueError for a NUL in the source
            return _failure(exc, spec, duration_us=0)
        _register_source(spec.name, source)
        clock.lap("compile")
        notes += apply_file_size_limit(spec.limits.max_file_size)
        notes += apply_memory_limit(spec.limits.memory_bytes, spec.limits.max_output)
        clock.lap("limits")
        started = time.perf_counter_ns()
        try:
            try:
                with deadline(spec.limits.timeout_ms), guarded(guard):
                    exec(code, module.__dict__)
                    # Its repr and display methods are the job's code too: under the same limits.
                    value = None if last is None else show_value(eval(last, module.__dict__), spec.limits.max_output)
            finally:
                relax_memory_limit()
                duration_us = (time.perf_counter_ns() - started) // 1000
                clock.lap("code")
        except JobTimedOut:
            message = f"job exceeded its timeout of {spec.limits.timeout_ms} ms"
            return _Outcome(EXIT_TIMED_OUT, ErrorReport("TimeoutError", message), duration_us, timed_out=True)
        except SystemExit as exc:
            return _Outcome(_exit_status(exc.code), None, duration_us, system_exit=True)
        except BaseException as exc:
            return _failure(exc, spec, duration_us)
        return _Outcome(0, None, duration_us, value=value)


def create_links(links: tuple[Link, ...]) -> None:
    """Make each granted host path a symlink to its grant's mount point.

    The mount itself was planned at capture time (gVisor fixes the mount tree
    then); the sandbox root is a writable in-memory overlay, so the link costs
    nothing outside the sandbox.
    """
    for link in links:
        try:
            os.makedirs(os.path.dirname(link.path), exist_ok=True)
            os.symlink(link.target, link.path)
        except FileExistsError:
            if os.path.islink(link.path) and os.readlink(link.path) == link.target:
                continue  # an earlier step of the same session made it
            raise SetupError(
                f"cannot link {link.path} to its grant: something else is already there"
            ) from None
        except OSError as exc:
            raise SetupError(f"cannot link {link.path} to its grant {link.target}: {exc}") from None


# The rootfs leaves it empty (no network at capture); glibc reads it again when it changes.
RESOLV_CONF = "/etc/resolv.conf"


def name_resolver(address: str) -> None:
    """Point the sandbox's DNS lookups at ``address`` (its resolver outside, readie's). Written
    beside it and renamed over it: a link an earlier step of a session put there is replaced, not
    written through."""
    staged = f"{RESOLV_CONF}.readie"
    try:
        with open(staged, "w") as conf:
            conf.write(f"nameserver {address}\n")
        os.replace(staged, RESOLV_CONF)
    except OSError as exc:
        raise SetupError(f"cannot name the sandbox's resolver in {RESOLV_CONF}: {exc.strerror}") from None


def _list_again(*directories: str) -> None:
    """Python's import system finds a module written since it listed a directory by that
    directory's mtime, which two writes within one tick of its clock leave as it was: the job's
    own directories (its working directory and its script's, named as the import system names
    them), where a step writes or uploads the modules a later one imports, are listed again.
    Every other listing is dropped once per wake-up from a checkpoint (``_server.wake``), not
    per job: that took ~0.1 ms of a step in a sandbox with pandas loaded, and walking the
    listings to find those below the job's directories cost as much (decision 33)."""
    for directory in directories:
        finder = sys.path_importer_cache.get(directory)
        if type(finder) is importlib.machinery.FileFinder:  # a finder a job put there is its own business
            finder.invalidate_caches()


def preloaded_modules() -> list[str]:
    """What the template pre-imported, as far as this process can tell.

    READIE_PREIMPORT is read from the executor's environment as it is now,
    which after a restore is the new sandbox's; names not actually imported
    are left out.
    """
    names = parse_preimport(os.environ.get(PREIMPORT_VARIABLE, ""))
    return [name for name in names if name in sys.modules]


def _apply_subprocess_policy(allowed: bool) -> list[str]:
    if allowed:
        if job_filter_installed():
            return ["subprocesses: an earlier job in this process denied them, for good"]
        return []
    try:
        install_job_filter()
    except Exception as exc:  # SeccompUnavailable, or anything ctypes raises
        return [
            f"subprocesses: seccomp filter not installed ({safe_str(exc)}); only an audit hook "
            "refuses them, which code calling fork() through ctypes gets around"
        ]
    return []


@contextlib.contextmanager
def _job_process_state(spec: JobSpec, module: types.ModuleType) -> Iterator[None]:
    """The cwd, environment, argv, sys.path and __main__ the job sees; all but the cwd restored after.

    The cwd is entered only if the process is not in it already, and left as the job leaves
    it: nothing between jobs uses it, and a session's steps, all in one workspace, make no
    chdir at all (two system calls a step fewer, decision 33).
    """
    try:
        here: str | None = os.getcwd()
    except OSError:  # the job removed the directory it left the process in
        here = None
    saved_environ = dict(os.environ)
    saved_argv, saved_path = sys.argv, list(sys.path)
    saved_main = sys.modules.get("__main__")
    try:
        if here != spec.workspace:
            try:
                os.chdir(spec.workspace)
                here = os.getcwd()  # resolved: what the import system keys "" by
            except OSError as exc:
                raise SetupError(f"cannot enter the working directory {spec.workspace}: {exc}") from None
        script_dir = os.path.dirname(os.path.abspath(spec.script_path)) if spec.script_path else None
        _list_again(here or spec.workspace, *([script_dir] if script_dir else []))
        os.environ.clear()
        os.environ.update(spec.env)
        sys.argv = [spec.name, *spec.args]
        # What python3 puts first on sys.path: the script's directory, or ""
        # (the working directory) for inline code.
        sys.path.insert(0, script_dir or "")
        sys.modules["__main__"] = module
        yield
    finally:
        if saved_main is not None:
            sys.modules["__main__"] = saved_main
        else:
            sys.modules.pop("__main__", None)
        sys.path[:] = saved_path
        sys.argv = saved_argv
        os.environ.clear()
        os.environ.update(saved_environ)


def _main_module(spec: JobSpec) -> types.ModuleType:
    global _session_module
    if spec.session and _session_module is not None:
        module = _session_module
    else:
        module = types.ModuleType("__main__")
        if spec.session:
            _session_module = module
    module.__file__ = spec.name
    return module


def _read_source(spec: JobSpec) -> str | bytes:
    if spec.code is not None:
        return spec.code
    with open(spec.script_path, "rb") as script:  # type: ignore[arg-type]
        return script.read()  # bytes: compile() honours a coding cookie


def _register_source(name: str, source: str | bytes) -> None:
    """Let tracebacks show the job's lines even though its file may not exist here."""
    try:
        text = source if isinstance(source, str) else importlib.util.decode_source(source)
    except Exception:
        return
    # An mtime of None tells linecache not to check the (possibly absent) file.
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)


def _exit_status(code: object) -> int:
    """What python3's exit status would be for ``sys.exit(code)``."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code
    _write_stderr(f"{safe_str(code)}\n")
    return EXIT_EXCEPTION


def _failure(exc: BaseException, spec: JobSpec, duration_us: int) -> _Outcome:
    """Describe an uncaught exception and print its traceback to stderr, as python3 would."""
    # The exception is the job's object: any attribute read may raise.
    try:
        _strip_runner_frames(exc)
        error = describe_exception(exc, spec, memory_limit_bytes())
    except BaseException:
        error = ErrorReport(type(exc).__name__, safe_str(exc))
    try:
        text = "".join(traceback.format_exception(exc))
    except BaseException:
        text = f"{type(exc).__name__}: {safe_str(exc)}\n"
    _write_stderr(text)
    return _Outcome(EXIT_EXCEPTION, error, duration_us)


def _strip_runner_frames(exc: BaseException) -> None:
    """Drop the executor's frames from ``exc`` and its chain.

    The exec call, the audit hook, host functions: they are not the job's and
    would only point the reader at the wrong file.
    """
    seen: set[int] = set()
    pending: list[BaseException | None] = [exc]
    while pending:
        current = pending.pop()
        if current is None or id(current) in seen:
            continue
        seen.add(id(current))
        current.__traceback__ = _without_runner_frames(current.__traceback__)
        pending += [current.__cause__, current.__context__]


def _without_runner_frames(tb: types.TracebackType | None) -> types.TracebackType | None:
    kept = []
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE_DIR):
            kept.append(tb)
        tb = tb.tb_next
    rebuilt = None
    for entry in reversed(kept):
        rebuilt = types.TracebackType(rebuilt, entry.tb_frame, entry.tb_lasti, entry.tb_lineno)
    return rebuilt


def _write_stderr(text: str) -> None:
    # To descriptor 2 itself, after the job's buffered streams: the job may
    # have replaced or closed sys.stderr, and python3 would still show this.
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    data = text.encode("utf-8", "backslashreplace")
    with contextlib.suppress(OSError):
        while data:
            data = data[os.write(2, data) :]


def _declared_max_output(job: object) -> int:
    """max_output of a job that may not parse, so that even a refusal stays in budget."""
    limits = job.get("limits") if isinstance(job, dict) else None
    value = limits.get("max_output") if isinstance(limits, dict) else None
    return (
        value
        if isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= MAX_OUTPUT_LIMIT
        else 0
    )


def _not_started(
    error: ErrorReport, max_output: int, *, stderr: str = "", preloaded: list[str] | None = None
) -> bytes:
    stderr_bytes = stderr.encode("utf-8", "replace")
    return encode_result(
        exit_status=EXIT_NOT_STARTED,
        stdout=CapturedBytes(b"", 0),
        stderr=CapturedBytes(stderr_bytes, len(stderr_bytes)),
        error=error,
        duration_us=0,
        preloaded_modules=preloaded or [],
        policy_notes=[],
        max_output=max_output,
    )
