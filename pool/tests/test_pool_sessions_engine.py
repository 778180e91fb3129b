"""Sessions in the pool engine, in memory: admission, order, limits, idle, drain. No gVisor.

The real process against real sandboxes is test_pool_sessions.py; here the
fake backend's sessions let each test decide when a step finishes.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from readie_policy.config import parse_config
from readie_pool._events import RuntimeInfo
from readie_pool._engine import PoolEngine, PoolSetup
from readie_protocol.requests import SESSION_SETUP_FIELDS
from readie_pool._sessions import MAX_PENDING_STEPS
from readie_pool.testing import FakeBackend, MemorySink, MemorySource, ok_outcome
from readie_protocol.events import ErrorInfo

RUNTIME = RuntimeInfo.pool("3.11.2")


def setup_for(cwd: Path, workers: int = 1, **extra) -> PoolSetup:
    return PoolSetup(workers=workers, checkpoint="base", runtime=RUNTIME, cwd=cwd, **extra)


def serve(setup, scenario, backend=None):
    logs: list[dict] = []

    async def main():
        fake = backend or FakeBackend()
        source, sink = MemorySource(), MemorySink()
        engine = PoolEngine(setup, fake, log_job=lambda event, **line: logs.append({"event": event, **line}))
        serving = asyncio.create_task(engine.serve(source, sink))
        await scenario(engine, source, sink, fake)
        code = await asyncio.wait_for(serving, 5)
        return code, sink.lines[1:], engine, fake

    code, lines, engine, fake = asyncio.run(main())
    assert code == 0
    return lines, engine, fake, logs


def session_fields(line):
    return {k: line.get(k) for k in ("id", "session", "step", "session_ended")}


def error_of(line):
    return line["error"] and (line["error"]["type"], line["error"]["message"])


async def settle() -> None:
    for _ in range(50):
        await asyncio.sleep(0)


def test_the_first_request_fixes_the_session_and_later_steps_carry_only_code(tmp_path):
    (tmp_path / "data").mkdir()

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "a = 1", "allow_read": ["data"], "env": {"K": "v"}, "timeout": "5s"},
            {"id": 2, "session": "nb", "code": "print(a)", "name": "two.py", "args": ["x"], "timeout": "2s"},
            {"id": "s", "stats": True},
        )
        await sink.wait_for(4)
        source.feed_lines({"id": 3, "session": "nb", "close": True})
        await sink.wait_for(5)
        source.feed_lines({"id": "s2", "stats": True})
        source.end()

    lines, engine, fake, logs = serve(setup_for(tmp_path, log_jobs=True), scenario)
    by_id = {line["id"]: line for line in lines}
    assert session_fields(by_id[1]) == {"id": 1, "session": "nb", "step": 1, "session_ended": False}
    assert session_fields(by_id[2]) == {"id": 2, "session": "nb", "step": 2, "session_ended": False}
    assert by_id[3] == {"id": 3, "session": "nb", "closed": True}
    assert by_id["s"]["sessions_active"] == 1 and by_id["s2"]["sessions_active"] == 0
    assert by_id["s2"]["jobs"] == 2  # closes are not jobs
    # One backend session; the second step keeps its grants and env, with its own timeout.
    (session,) = fake.sessions
    first, second = fake.started
    assert (first.allow_read, first.env, first.timeout_ms) == ((str(tmp_path / "data"),), {"K": "v"}, 5000)
    assert (second.code, second.name, second.args) == ("print(a)", "two.py", ("x",))
    assert (second.allow_read, second.env, second.timeout_ms) == (first.allow_read, first.env, 2000)
    assert by_id[2]["policy"]["timeout_ms"] == 2000 and by_id[2]["policy"]["allow_read"] == [str(tmp_path / "data")]
    assert session.closes == 1
    assert [(log["id"], log["session"], log["step"]) for log in logs] == [(1, "nb", 1), (2, "nb", 2)]


@pytest.mark.parametrize("field", sorted(SESSION_SETUP_FIELDS - {"functions"}))
def test_a_permission_field_on_a_later_step_is_refused_naming_it(tmp_path, field):
    values = {
        "allow_read": [], "allow_write": [], "package_dirs": [], "env": {}, "allow_network": False,
        "memory": "1g", "max_file_size": "1m", "profile": "p", "packages": [],
    }

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "code": "a = 1"})
        await sink.wait_for(2)
        source.feed_lines({"id": 2, "session": "nb", "code": "a", field: values[field]})
        source.feed_lines({"id": 3, "session": "nb", "code": "print(a)"})
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path), scenario)
    refused = lines[1]
    assert session_fields(refused) == {"id": 2, "session": "nb", "step": None, "session_ended": False}
    kind, message = error_of(refused)
    assert kind == "RequestError" and message.startswith(f"{field}: session 'nb' is open")
    assert "code, name, args, timeout and max_output" in message
    assert lines[2]["step"] == 2 and len(fake.started) == 2  # the session lives on


def test_a_step_timeout_above_the_ceiling_is_refused_and_the_session_lives(tmp_path):
    config = parse_config("[pool.limits]\ntimeout = '10s'\n", tmp_path / "readie.toml")

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "a = 1"},
            {"id": 2, "session": "nb", "code": "a", "timeout": "1m"},
            {"id": 3, "session": "nb", "code": "a", "max_output": "64m"},
            {"id": 4, "session": "nb", "code": "a"},
        )
        source.end()

    lines, *_ = serve(setup_for(tmp_path, config=config), scenario)
    assert [(line["id"], line.get("step"), line["exit"]) for line in lines] == [(1, 1, 0), (2, None, -1), (3, None, -1), (4, 2, 0)]
    assert lines[1]["error"]["message"].startswith("timeout: 60000 ms exceeds")
    # Past what a sandbox captures: refused by the parser, as the gRPC wire refuses it (decision 27).
    assert lines[2]["error"]["message"] == "max_output: too large: at most 16m"


def test_sessions_take_inline_code_only(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "script": "app.py"})
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path), scenario)
    assert error_of(lines[0]) == ("RequestError", "script: sessions take inline code, not script")
    assert fake.sessions == []


def test_an_ending_step_ends_the_session_and_the_next_request_starts_fresh(tmp_path):
    (tmp_path / "data").mkdir()

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "code": "a = 1"}, {"id": 2, "session": "nb", "code": "exit"})
        await sink.wait_for(3)
        source.feed_lines(
            {"id": "s", "stats": True},
            {"id": 3, "session": "nb", "code": "print(a)", "allow_read": ["data"]},
        )
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path), scenario)
    by_id = {line["id"]: line for line in lines}
    assert session_fields(by_id[2]) == {"id": 2, "session": "nb", "step": 2, "session_ended": True}
    assert by_id["s"]["sessions_active"] == 0
    assert session_fields(by_id[3]) == {"id": 3, "session": "nb", "step": 1, "session_ended": False}
    assert len(fake.sessions) == 2 and fake.sessions[1].job.allow_read == (str(tmp_path / "data"),)


def test_a_timeout_ends_the_session_and_queued_requests_are_answered_without_running(tmp_path):
    def answer(job):
        if job.code == "spin":
            return ok_outcome(exit=None, error=ErrorInfo("TimeoutError", "step exceeded its timeout", None, None, None))
        return ok_outcome(job.code)

    backend = FakeBackend(answer=answer, gates={"spin": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "a = 1"},
            {"id": 2, "session": "nb", "code": "spin"},
            {"id": 3, "session": "nb", "code": "print(a)"},
            {"id": 4, "session": "nb", "close": True},
        )
        await settle()
        fake.gates["spin"].set()
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path, workers=2), scenario, backend)
    assert [line["id"] for line in lines] == [1, 2, 3, 4]  # in order, one at a time
    assert (lines[1]["exit"], lines[1]["error"]["type"], lines[1]["session_ended"]) == (124, "TimeoutError", True)
    assert error_of(lines[2]) == ("RequestError", "session: session 'nb' ended before this step ran")
    assert lines[3] == {"id": 4, "session": "nb", "closed": True}
    assert [job.code for job in fake.started] == ["a = 1", "spin"]


def test_steps_of_one_session_run_one_at_a_time_in_order(tmp_path):
    backend = FakeBackend(gates={"slow": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "a", "code": "slow"},
            {"id": 2, "session": "a", "code": "two"},
            {"id": 3, "session": "b", "code": "other"},
            {"id": 4, "session": "a", "code": "three"},
        )
        await sink.wait_for(2)
        # Session b ran beside a's first step; a's later steps wait for it.
        assert [job.code for job in fake.started] == ["slow", "other"]
        fake.gates["slow"].set()
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path, workers=4), scenario, backend)
    assert [line["id"] for line in lines] == [3, 1, 2, 4]
    assert [line["step"] for line in lines] == [1, 1, 2, 3]


def test_a_session_with_eight_pending_steps_refuses_more_until_it_catches_up(tmp_path):
    backend = FakeBackend(gates={"slow": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 0, "session": "nb", "code": "slow"})
        source.feed_lines(*({"id": i, "session": "nb", "code": f"s{i}"} for i in range(1, MAX_PENDING_STEPS + 1)))
        await sink.wait_for(2)
        refused = sink.lines[1]
        assert refused["id"] == MAX_PENDING_STEPS and refused["error"]["type"] == "RequestError"
        assert refused["error"]["message"] == (
            "session: session 'nb' has 8 pending steps, the most it queues; read their results before sending more"
        )
        fake.gates["slow"].set()
        await sink.wait_for(MAX_PENDING_STEPS + 1)
        source.feed_lines({"id": "again", "session": "nb", "code": "caught up"})
        source.end()

    # workers=5: the pool's queue (10) is deeper than a session's (8).
    lines, *_ = serve(setup_for(tmp_path, workers=5), scenario, backend)
    assert [line["step"] for line in lines[1:]] == [*range(1, MAX_PENDING_STEPS + 1), MAX_PENDING_STEPS + 1]


def test_max_sessions_caps_open_sessions(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "a", "code": "x"},
            {"id": 2, "session": "b", "code": "x"},
            {"id": 3, "session": "c", "code": "x"},
        )
        await sink.wait_for(4)
        source.feed_lines({"id": 4, "session": "a", "close": True}, {"id": 5, "session": "c", "code": "x"})
        source.end()

    lines, *_ = serve(setup_for(tmp_path, workers=2, max_sessions=2), scenario)
    by_id = {line["id"]: line for line in lines}
    assert error_of(by_id[3]) == (
        "RequestError",
        "session: 2 sessions are open, the pool's max_sessions; close one (or let one idle out) before starting another",
    )
    assert by_id[3]["session"] == "c" and by_id[5]["step"] == 1


def test_max_sessions_zero_disables_sessions(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "a", "code": "x"}, {"id": 2, "code": "plain"})
        source.end()

    lines, *_ = serve(setup_for(tmp_path, max_sessions=0), scenario)
    assert error_of(lines[0]) == ("RequestError", "session: sessions are disabled: the pool's max_sessions is 0")
    assert lines[1]["exit"] == 0


def test_an_idle_session_is_closed(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "code": "a = 1"})
        await sink.wait_for(2)
        await asyncio.sleep(0.02)
        source.feed_lines({"id": 2, "session": "nb", "code": "a"})  # activity re-arms the timer
        await sink.wait_for(3)
        assert fake.sessions[0].closes == 0
        await asyncio.sleep(0.2)
        assert fake.sessions[0].closes == 1 and engine.stats.sessions_active == 0
        source.feed_lines({"id": 3, "session": "nb", "code": "print(a)"})
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path, session_idle_ms=50), scenario)
    assert [(line["id"], line["step"]) for line in lines] == [(1, 1), (2, 2), (3, 1)]
    assert len(fake.sessions) == 2


def test_eof_drains_pending_steps_then_closes_every_session(tmp_path):
    backend = FakeBackend(gates={"slow": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "a", "code": "slow"},
            {"id": 2, "session": "a", "code": "after"},
            {"id": 3, "session": "b", "code": "x"},
        )
        source.end()
        await settle()
        assert all(s.closes == 0 for s in fake.sessions)
        fake.gates["slow"].set()

    lines, engine, fake, _ = serve(setup_for(tmp_path, workers=2), scenario, backend)
    assert sorted(line["id"] for line in lines) == [1, 2, 3]
    assert [s.closes for s in fake.sessions] == [1, 1]
    assert engine.stats.sessions_active == 0


def test_closing_a_session_that_is_not_open_answers_closed(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "c", "session": "never", "close": True})
        source.end()

    lines, *_ = serve(setup_for(tmp_path), scenario)
    assert lines == [{"id": "c", "session": "never", "closed": True}]


def test_a_refused_first_request_opens_nothing(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "code": "x", "profile": "missing"})
        await sink.wait_for(2)
        source.feed_lines({"id": "s", "stats": True})
        await sink.wait_for(3)
        source.feed_lines({"id": 2, "session": "nb", "code": "x", "env": {"A": "b"}})
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path), scenario)
    by_id = {line["id"]: line for line in lines}
    assert by_id[1]["error"]["message"].startswith("profile: unknown profile")
    assert by_id[1]["session"] == "nb" and by_id[1]["session_ended"] is False
    assert by_id["s"]["sessions_active"] == 0
    assert by_id[2]["step"] == 1 and fake.sessions[0].job.env == {"A": "b"}


def test_an_idle_session_holds_no_slot(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "a", "code": "x"}, {"id": 2, "session": "b", "code": "x"})
        await sink.wait_for(3)
        source.feed_lines({"id": 3, "code": "plain job"})
        source.end()

    lines, _, fake, _ = serve(setup_for(tmp_path, workers=1), scenario)
    assert [line["id"] for line in lines] == [1, 2, 3] and fake.most_running == 1


def test_steps_read_before_a_close_run_and_one_read_after_it_starts_a_new_session(tmp_path):
    backend = FakeBackend(gates={"slow": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "slow"},
            {"id": 2, "session": "nb", "code": "queued"},
            {"id": 3, "session": "nb", "close": True},
            {"id": 4, "session": "nb", "code": "fresh", "env": {"NEW": "1"}},
        )
        await settle()
        fake.gates["slow"].set()
        source.end()

    lines, engine, fake, _ = serve(setup_for(tmp_path, workers=2), scenario, backend)
    by_id = {line["id"]: line for line in lines}
    assert (by_id[1]["step"], by_id[2]["step"], by_id[4]["step"]) == (1, 2, 1)
    assert by_id[3] == {"id": 3, "session": "nb", "closed": True}
    first, second = fake.sessions
    assert [job.code for job in fake.started if job.env == {}] == ["slow", "queued"]
    assert second.job.env == {"NEW": "1"} and first.closes == 1
    assert engine.stats.sessions_active == 0


# --------------------------------------------------------------------------- the backend seam


class _SessionRunner:
    """A blocking runner with ``open_session``, as the in-process Worker has."""

    def __init__(self) -> None:
        self.steps: list[tuple[str, int, int, str | None]] = []
        self.closed_sessions = 0

    def run_job(self, job, job_id=None, host=None, cancel=None, output=None):
        return ok_outcome(job.code)

    def open_session(self, job, job_id=None, host=None, cancel=None, output=None):
        from readie_worker.sessions import StepOutcome

        runner = self

        class _Session:
            hibernated = False

            def run_step(self, step, *, job_id=None, host=None, cancel=None, output=None):
                runner.steps.append((step.code, step.timeout_ms, step.max_output, job_id))
                return StepOutcome(ok_outcome(step.code), len(runner.steps) + 1, False)

            def close(self):
                runner.closed_sessions += 1

        return _Session(), StepOutcome(ok_outcome(job.code), 1, False)

    def close(self) -> None:
        pass


def test_threaded_backend_runs_a_runners_session_steps_on_its_threads():
    from readie_pool._backend import ThreadedBackend
    from readie_worker.jobs import CodeJob, Step

    runner = _SessionRunner()

    async def main():
        local = ThreadedBackend(runner, slots=1)
        handle, first = await local.open_session(CodeJob(checkpoint="base", code="a = 1"), "1")
        second = await handle.run_step(Step("print(a)", "<string>", (), 2000, 100), "2")
        await handle.close()
        await local.close()
        return first, second

    first, second = asyncio.run(main())
    assert (first.step, second.step, second.outcome.stdout) == (1, 2, "print(a)")
    assert runner.steps == [("print(a)", 2000, 100, "2")] and runner.closed_sessions == 1
