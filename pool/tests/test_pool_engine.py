"""The pool engine in memory: permits, order, drain, refusals, job building. No gVisor.

The real process against real sandboxes is test_pool_conformance_protocol.py and _lifecycle.py; here a
fake backend lets each test decide when jobs finish, so the accounting
(what was read, what runs, what is held back) is checked exactly.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import threading
import time
from collections.abc import Awaitable, Callable
from pathlib import Path

import pytest
from readie_pool._backend import ThreadedBackend
from readie_policy.config import Config, parse_config
from readie_worker.errors import PoolWorkerError, RequestError
from readie_pool._events import RuntimeInfo
from readie_pool._engine import FALLBACK_CWD, PoolEngine, PoolSetup, PoolState
from readie_protocol.requests import MAX_NAME_CHARS, MAX_OUTPUT_BYTES
from readie_pool.testing import FakeBackend, MemorySink, MemorySource, ok_outcome
from readie_protocol.events import ErrorInfo, NetworkReport, RefusedConnection, parse_result
from readie_worker.jobs import CodeJob

RUNTIME = RuntimeInfo.pool("3.11.2")

Scenario = Callable[[PoolEngine, MemorySource, MemorySink, FakeBackend], Awaitable[None]]


def setup_for(cwd: Path, workers: int = 1, config: Config | None = None, **extra) -> PoolSetup:
    return PoolSetup(
        workers=workers,
        checkpoint="base",
        runtime=RUNTIME,
        cwd=cwd,
        config=config or Config(),
        **extra,
    )


def serve(setup: PoolSetup, scenario: Scenario, backend: FakeBackend | None = None):
    logs: list[dict] = []

    async def main():
        fake = backend or FakeBackend()
        source, sink = MemorySource(), MemorySink()
        engine = PoolEngine(setup, fake, log_job=lambda event, **line: logs.append({"event": event, **line}))
        serving = asyncio.create_task(engine.serve(source, sink))
        await scenario(engine, source, sink, fake)
        code = await asyncio.wait_for(serving, 5)
        return code, sink.lines, engine, fake

    code, lines, engine, fake = asyncio.run(main())
    return code, lines, engine, fake, logs


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def by_id(lines):
    return {line.get("id"): line for line in lines[1:]}


def test_ready_first_then_results_then_exit_zero_at_eof(tmp_path):
    async def scenario(engine, source, sink, backend):
        source.feed_lines({"id": 1, "code": "one"}, {"id": 2, "code": "two"})
        source.end()

    code, lines, engine, backend, _ = serve(setup_for(tmp_path, workers=2), scenario)
    assert code == 0
    assert lines[0] == {
        "event": "ready",
        "workers": 2,
        "runtime": "readie",
        "preloaded_modules": [],
        "package_dirs": [],
        "config": None,
        "profiles": [],
        "protocol": 1,
    }
    assert {line["id"]: line["stdout"] for line in lines[1:]} == {1: "one", 2: "two"}
    assert engine.state is PoolState.DRAINING
    assert backend.closed == 0  # closing the backend is its owner's business


def test_results_come_in_completion_order(tmp_path):
    backend = FakeBackend(gates={"slow": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "slow", "code": "slow"}, {"id": "fast", "code": "fast"})
        await sink.wait_for(2)
        fake.gates["slow"].set()
        source.end()

    _, lines, *_ = serve(setup_for(tmp_path, workers=2), scenario, backend)
    assert [line["id"] for line in lines[1:]] == ["fast", "slow"]


def test_intake_stops_at_twice_the_workers_while_jobs_run(tmp_path):
    backend = FakeBackend(gates={"hold": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        for i in range(10):
            source.feed_lines({"id": i, "code": "hold"})
        await settle()
        # workers=1: one job runs, one waits for the slot, and nothing more is read
        assert (engine.accepted, len(fake.started), source.reads, source.unread) == (2, 1, 2, 8)
        fake.gates["hold"].set()
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path, workers=1), scenario, backend)
    assert sorted(line["id"] for line in lines[1:]) == list(range(10))
    assert fake.most_running == 1


def test_unwritten_results_hold_intake_back(tmp_path):
    async def scenario(engine, source, sink, fake):
        await sink.wait_for(1)  # the ready event
        sink.open.clear()  # then the client stops reading stdout
        for i in range(6):
            source.feed_lines({"id": i, "code": "x"})
        await settle()
        # both jobs finished, but their results are not written: nothing more is read
        assert (engine.accepted, len(fake.started), engine.stats.jobs, source.unread) == (
            2,
            2,
            2,
            4,
        )
        sink.open.set()
        source.end()

    code, lines, *_ = serve(setup_for(tmp_path, workers=1), scenario)
    assert code == 0 and len(lines) == 7


def test_stats_answer_at_once_with_the_counters(tmp_path):
    def answer(job):
        return {
            "ok": ok_outcome(),
            "raise": ok_outcome(exit=1, error=ErrorInfo("NameError", "x", "<string>", 1, None)),
            "exit3": ok_outcome(exit=3),
            "slow": ok_outcome(exit=None, error=ErrorInfo("TimeoutError", "t", None, None, None)),
            "crash": ok_outcome(
                exit=None, error=ErrorInfo("PoolWorkerError", "c", None, None, None)
            ),
        }[job.code]

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "code": "ok"},
            {"id": 2, "code": "raise"},
            {"id": 3, "code": "exit3"},
            {"id": 4, "code": "slow"},
            {"id": 5, "code": "crash"},
            {"id": 6, "code": "ok", "bogus": 1},
        )
        await sink.wait_for(7)
        source.feed_lines({"id": "s", "stats": True})
        source.end()

    _, lines, *_ = serve(setup_for(tmp_path, workers=2), scenario, FakeBackend(answer=answer))
    stats = lines[-1]
    assert stats["event"] == "stats" and stats["id"] == "s"
    assert {
        k: stats[k]
        for k in ("jobs", "ok", "failed", "timeouts", "signals", "request_errors", "worker_errors")
    } == {
        "jobs": 6,
        "ok": 1,
        "failed": 2,
        "timeouts": 1,
        "signals": 0,
        "request_errors": 1,
        "worker_errors": 1,
    }
    assert stats["errors"] == {
        "NameError": 1,
        "TimeoutError": 1,
        "PoolWorkerError": 1,
        "RequestError": 1,
    }
    assert stats["duration_ms_total"] == 5  # five jobs of 1000 us each
    assert stats["workers"] == 2 and stats["sessions_active"] == 0


def test_a_failure_raised_or_returned_writes_the_line_the_rule_says(tmp_path):
    """JobBackend's one rule: raised when no runner took the job, returned once one did."""

    def answer(job):
        if job.code == "refused":  # the worker refuses: nothing was granted
            raise RequestError("no network backend", "allow_network")
        if job.code == "unreachable":  # no worker answers: the pool's own clock and backend name
            raise PoolWorkerError("worker call failed (UNAVAILABLE): gone")
        # A runner took it and says why it failed: its clock and backend.
        return ok_outcome(exit=None, error=ErrorInfo("SandboxSetupError", "restore failed", None, None, None))

    async def scenario(engine, source, sink, fake):
        source.feed_lines(*({"id": code, "code": code} for code in ("refused", "unreachable", "no sandbox")))
        source.end()

    _, lines, *_ = serve(setup_for(tmp_path), scenario, FakeBackend(answer=answer))
    got = {
        line["id"]: (line["exit"], line["error"]["type"], line["duration_us"], line["policy"] and line["policy"]["backend"])
        for line in lines[1:]
    }
    assert got == {
        "refused": (-1, "RequestError", 0, None),
        "unreachable": (-1, "PoolWorkerError", 0, "gvisor"),
        "no sandbox": (-1, "SandboxSetupError", 1000, "fake"),
    }
    assert all(line["queue_us"] >= 0 for line in lines[1:])


def test_drain_stops_intake_and_finishes_accepted_jobs(tmp_path):
    backend = FakeBackend(gates={"hold": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "code": "hold"})
        await settle()
        engine.drain()
        source.feed_lines({"id": 2, "code": "never read"})
        await settle()
        fake.gates["hold"].set()

    code, lines, _, fake, _ = serve(setup_for(tmp_path), scenario, backend)
    assert code == 0
    assert [line["id"] for line in lines[1:]] == [1]
    assert [job.code for job in fake.started] == ["hold"]


def test_second_drain_aborts_through_the_backend(tmp_path):
    backend = FakeBackend(gates={"hold": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "code": "hold"}, {"id": 2, "code": "queued"})
        await settle()
        engine.drain()
        engine.drain()

    code, lines, engine, fake, _ = serve(setup_for(tmp_path), scenario, backend)
    assert code == 0 and engine.state is PoolState.ABORTING and fake.closed == 1
    results = by_id(lines)
    assert results[1]["exit"] == 0  # the fake's close released it
    assert results[2]["error"]["type"] == "PoolWorkerError"  # never ran: the backend had closed


def test_a_signal_after_eof_still_drains_gracefully(tmp_path):
    backend = FakeBackend(gates={"hold": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "code": "hold"})
        source.end()  # the supervisor closes stdin...
        await settle()
        engine.drain()  # ...then sends SIGTERM
        await settle()
        assert (engine.state, fake.closed) == (PoolState.DRAINING, 0)
        fake.gates["hold"].set()

    code, lines, *_ = serve(setup_for(tmp_path), scenario, backend)
    assert code == 0 and lines[1]["exit"] == 0


def test_stdout_failure_drains_and_exits_one(tmp_path):
    async def scenario(engine, source, sink, fake):
        await settle()
        sink.fail = BrokenPipeError(32, "Broken pipe")
        source.feed_lines({"id": 1, "code": "x"})
        await settle()
        source.feed_lines({"id": 2, "code": "x"})

    code, _, engine, *_ = serve(setup_for(tmp_path), scenario)
    assert code == 1 and engine.state is PoolState.DRAINING


def test_one_log_line_per_result_never_for_stats(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "code": "secret output"}, {"id": "s", "stats": True}, {"id": 2})
        source.end()

    _, _, _, _, logs = serve(setup_for(tmp_path, log_jobs=True), scenario)
    assert sorted(str(line["id"]) for line in logs) == ["1", "2"]
    assert all("secret" not in json.dumps(line) for line in logs)
    assert {line["error"] for line in logs} == {None, "RequestError"}


# --------------------------------------------------------------------------- the job sent


def sent_job(tmp_path: Path, request: dict, config: Config | None = None, **extra):
    async def scenario(engine, source, sink, fake):
        source.feed_lines(request)
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path, config=config, **extra), scenario)
    return (fake.started[0] if fake.started else None), lines[1]


def test_script_is_read_by_the_pool_and_named_as_written(tmp_path):
    (tmp_path / "app.py").write_text(
        "# -*- coding: latin-1 -*-\nprint('caf\xe9')\n", encoding="latin-1"
    )
    job, result = sent_job(tmp_path, {"id": 1, "script": "app.py", "args": ["one"]})
    assert (job.name, job.args) == ("app.py", ("one",))
    assert job.code == "# -*- coding: latin-1 -*-\nprint('caf\xe9')\n"
    assert result["exit"] == 0


@pytest.mark.parametrize(
    ("make", "words"),
    [
        (lambda p: None, "'app.py' does not exist"),
        (lambda p: p.mkdir(), "'app.py' is not a regular file"),
        (lambda p: os.mkfifo(p), "'app.py' is neither a directory nor a regular file"),  # must not block the pool
        (lambda p: p.write_bytes(b"print('\xff')"), "not readable as Python source"),
    ],
)
def test_unreadable_scripts_are_request_errors(tmp_path, make, words):
    make(tmp_path / "app.py")
    job, result = sent_job(tmp_path, {"id": 1, "script": "app.py"})
    assert job is None
    assert result["error"]["type"] == "RequestError"
    assert result["error"]["message"].startswith("script: ") and words in result["error"]["message"]


def test_job_fields_come_from_the_policy(tmp_path):
    (tmp_path / "data").mkdir()
    job, _ = sent_job(
        tmp_path,
        {
            "id": 1,
            "code": "c",
            "allow_read": ["data"],
            "env": {"K": "v"},
            "timeout": "5s",
            "memory": "512m",
            "max_output": 65536,
            "max_file_size": "1m",
        },
    )
    assert job.allow_read == (str(tmp_path / "data"),) and job.allow_write == ()
    assert (job.env, job.timeout_ms, job.memory_bytes, job.max_output, job.max_file_size) == (
        {"K": "v"},
        5000,
        512 * 1024**2,
        65536,
        1024**2,
    )
    assert (job.checkpoint, job.name, job.network) == ("base", "<string>", False)


def test_job_cwd_is_the_pools_only_when_a_grant_makes_it_visible(tmp_path):
    (tmp_path / "out").mkdir()
    plain, _ = sent_job(tmp_path, {"id": 1, "code": "c"})
    granted, _ = sent_job(tmp_path, {"id": 1, "code": "c", "allow_write": ["out"]})
    outside, _ = sent_job(
        tmp_path / "out", {"id": 1, "code": "c", "allow_read": [str(tmp_path.parent)]}
    )
    assert plain.cwd == FALLBACK_CWD
    assert granted.cwd == str(tmp_path)
    assert outside.cwd == str(tmp_path / "out")  # the pool's dir lies beneath the grant


def test_pool_package_dirs_go_to_every_job(tmp_path):
    site = tmp_path / "site"
    site.mkdir()
    job, _ = sent_job(tmp_path, {"id": 1, "code": "c"}, package_dirs=(site,))
    assert job.package_dirs == (str(site),)


def test_max_output_above_the_sandbox_capture_limit_is_refused(tmp_path):
    job, result = sent_job(tmp_path, {"id": 1, "code": "c", "max_output": MAX_OUTPUT_BYTES + 1})
    assert job is None and result["error"]["message"].startswith("max_output: ")


def test_packages_need_a_pool_without_a_ceiling(tmp_path):
    config = parse_config(b"[pool.limits]\ntimeout = '30s'\n", tmp_path / "readie.toml")
    job, result = sent_job(tmp_path, {"id": 1, "code": "c", "packages": ["six"]}, config=config)
    assert job is None and result["error"]["message"].startswith("packages: ")
    free, _ = sent_job(tmp_path, {"id": 1, "code": "c", "packages": ["six"]})
    assert free.packages == ("six",)


# --------------------------------------------------------------------------- the backend seam


class BlockingRunner:
    """A blocking ``run_job``/``close`` pair, like Worker, WorkerClient and Placement."""

    def __init__(self) -> None:
        self.threads: set[str] = set()
        self.closed = 0

    def run_job(self, job, job_id=None, host=None, cancel=None, output=None):
        self.threads.add(threading.current_thread().name)
        time.sleep(0.05)
        return ok_outcome(f"{job_id}:{job.code}")

    def close(self) -> None:
        self.closed += 1


def test_threaded_backend_runs_blocking_jobs_concurrently_and_refuses_after_close():
    runner = BlockingRunner()

    async def main():
        backend = ThreadedBackend(runner, slots=2)
        jobs = [CodeJob(checkpoint="base", code=str(i)) for i in range(2)]
        outcomes = await asyncio.gather(*(backend.run(job, f"j{i}") for i, job in enumerate(jobs)))
        await backend.close()
        with pytest.raises(PoolWorkerError, match="shutting down"):
            await backend.run(jobs[0], "late")
        return [o.stdout for o in outcomes]

    assert asyncio.run(main()) == ["j0:0", "j1:1"]
    assert len(runner.threads) == 2 and runner.closed == 1


def test_a_script_with_a_path_longer_than_a_name_is_named_by_its_end(tmp_path):
    """A job's name is at most MAX_NAME_CHARS on every path (a router's parser holds it to that),
    so a script path longer than that names its job by the end a traceback needs."""
    deep = Path("d" * 200) / ("s" * 200) / "app.py"
    (tmp_path / deep.parent).mkdir(parents=True)
    (tmp_path / deep).write_text("print(1)\n")
    job, result = sent_job(tmp_path, {"id": 1, "script": str(deep)})
    assert result["exit"] == 0
    assert len(job.name) == MAX_NAME_CHARS and job.name.endswith(f"{'s' * 200}/app.py")
    assert job.name.startswith("…")


def test_the_engine_writes_what_the_backend_says_the_egress_policy_refused(tmp_path):
    report = NetworkReport(2, (RefusedConnection("169.254.169.254", 80, 2),), 1, ("denied.test.example",))

    def answer(job: CodeJob):
        return dataclasses.replace(ok_outcome(), network=report if job.code == "online" else None)

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "code": "online"}, {"id": 2, "code": "offline"})
        source.end()

    _, lines, *_ = serve(setup_for(tmp_path), scenario, FakeBackend(answer=answer))
    by_id = {line["id"]: line for line in lines[1:]}
    assert by_id[1]["network"] == report.to_json() and parse_result(by_id[1]).network == report
    assert "network" not in by_id[2]
