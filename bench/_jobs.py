"""The jobs the bench runs and the ways it can run them (the arms).

Each path answers a :class:`Sample`: the latency as the caller sees it, or the
reason the job did not do what it should (a wrong answer is an error, not a
fast sample).
"""

from __future__ import annotations

import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from readie_protocol.requests import build_job
from readie_worker.bundle import SINGLE_THREAD_ENV, SITE_DIR
from readie_worker.core import Worker
from readie_worker.jobs import CodeJob

from ._pool_client import PoolClient, PoolError

# The host floor runs the interpreter the sandboxes run (Debian's 3.11), when
# the host has it, with the rootfs's own site packages: same code, no gVisor.
HOST_PYTHON = "/usr/bin/python3"
# Far above any job here; a job that takes this long is broken, not slow.
JOB_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class JobKind:
    name: str
    code: str
    expected_stdout: str


PRINT = JobKind("print", "print(1)\n", "1\n")
# Small on purpose: the figure is the fixed cost around a typical agent step.
GROUPBY = JobKind(
    "groupby",
    "import pandas as pd\n"
    "df = pd.DataFrame({'k': list('abacba'), 'v': range(6)})\n"
    "print(df.groupby('k').v.sum().to_dict())\n",
    "{'a': 7, 'b': 5, 'c': 3}\n",
)


def kinds_for(preimport: tuple[str, ...]) -> tuple[JobKind, ...]:
    return (PRINT, GROUPBY) if "pandas" in preimport else (PRINT,)


@dataclass(frozen=True)
class Sample:
    elapsed_ms: float
    error: str | None = None
    call_ms: float | None = None  # the worker's clock around the in-sandbox call alone


def check(kind: JobKind, exit_code: object, stdout: object, backend: object, want_backend: str | None) -> str | None:
    if exit_code != 0:
        return f"exit {exit_code!r}"
    if stdout != kind.expected_stdout:
        return f"stdout {stdout!r} != {kind.expected_stdout!r}"
    if want_backend is not None and backend != want_backend:
        return f"backend {backend!r} != {want_backend!r}"
    return None


class PoolPath:
    """Through ``readie pool``: request line written to result line read."""

    via = "readie pool (JSONL, request line -> result line)"

    def __init__(self, client: PoolClient, want_backend: str = "gvisor:runsc-restore", allow_read: tuple[str, ...] = ()) -> None:
        self.client = client
        self.want_backend = want_backend
        self.fields = {"allow_read": list(allow_read)} if allow_read else {}

    def run(self, kind: JobKind) -> Sample:
        try:
            result, elapsed_s = self.client.request(
                lambda rid: build_job(rid, {"code": kind.code, **self.fields}), timeout=JOB_TIMEOUT_S
            )
        except PoolError as exc:
            return Sample(0.0, f"pool: {exc}")
        error = result.get("error")
        if error:
            return Sample(elapsed_s * 1000, f"{error.get('type')}: {error.get('message')}")
        backend = (result.get("policy") or {}).get("backend")
        problem = check(kind, result.get("exit"), result.get("stdout"), backend, self.want_backend)
        call_us = result.get("duration_us")
        return Sample(elapsed_s * 1000, problem, call_us / 1000 if isinstance(call_us, int) else None)


class WorkerPath:
    """Through ``Worker.run_job`` in this process: the same code path minus the JSONL layer."""

    via = "Worker.run_job (in process)"

    def __init__(
        self, worker: Worker, checkpoint: str, want_backend: str = "gvisor:runsc-restore", allow_read: tuple[str, ...] = ()
    ) -> None:
        self.worker = worker
        self.checkpoint = checkpoint
        self.want_backend = want_backend
        self.allow_read = allow_read

    def run(self, kind: JobKind) -> Sample:
        started = time.monotonic()
        outcome = self.worker.run_job(CodeJob(checkpoint=self.checkpoint, code=kind.code, allow_read=self.allow_read))
        elapsed_ms = (time.monotonic() - started) * 1000
        if outcome.error is not None:
            return Sample(elapsed_ms, f"{outcome.error.type}: {outcome.error.message}")
        problem = check(kind, outcome.exit, outcome.stdout, outcome.backend, self.want_backend)
        return Sample(elapsed_ms, problem, outcome.duration_us / 1000)


class HostPath:
    """A plain ``python -c`` with the same imports: no isolation at all, the floor."""

    via = "python -c on the host (no isolation)"

    def __init__(self, rootfs: Path, preimport: tuple[str, ...]) -> None:
        self.python = HOST_PYTHON if os.path.exists(HOST_PYTHON) else "python3"
        self.prefix = f"import {', '.join(preimport)}\n" if preimport else ""
        self.env = {
            "PATH": "/usr/local/bin:/usr/bin:/bin",
            "LANG": "C.UTF-8",
            "PYTHONPATH": str(rootfs / SITE_DIR.relative_to("/")),
            **SINGLE_THREAD_ENV,  # as in the sandbox: BLAS pools pinned to one thread
        }

    def command(self, code: str) -> list[str]:
        return [self.python, "-c", self.prefix + code]

    def run(self, kind: JobKind) -> Sample:
        started = time.monotonic()
        try:
            done = subprocess.run(
                self.command(kind.code), env=self.env, capture_output=True, text=True, timeout=JOB_TIMEOUT_S
            )
        except subprocess.TimeoutExpired:
            return Sample((time.monotonic() - started) * 1000, "host python timed out")
        elapsed_ms = (time.monotonic() - started) * 1000
        return Sample(elapsed_ms, check(kind, done.returncode, done.stdout, None, None))
