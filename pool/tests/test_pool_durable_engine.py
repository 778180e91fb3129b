"""Durable sessions in the pool engine (decision 32), in memory: the key on the first result, attach,
detach at the end, a lost step. No gVisor: the fake backend's store stands for the session store; the
real pool against real sandboxes is test_pool_durable_sessions.py."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from readie_pool._engine import PoolEngine, PoolSetup
from readie_pool._events import RuntimeInfo
from readie_pool.testing import FakeBackend, MemorySink, MemorySource

RUNTIME = RuntimeInfo.pool("3.11.2")


def serve(cwd: Path, backend: FakeBackend, scenario, **extra):
    """Run one engine over ``backend`` until ``scenario`` ends its input; its lines and job log lines."""
    logs: list[dict] = []

    async def main():
        setup = PoolSetup(workers=1, checkpoint="base", runtime=RUNTIME, cwd=cwd, log_jobs=True, **extra)
        source, sink = MemorySource(), MemorySink()
        engine = PoolEngine(setup, backend, log_job=lambda event, **line: logs.append({"event": event, **line}))
        serving = asyncio.create_task(engine.serve(source, sink))
        await scenario(engine, source, sink)
        assert await asyncio.wait_for(serving, 5) == 0
        return sink.lines[1:]

    return asyncio.run(main()), logs


def by_id(lines):
    return {line["id"]: line for line in lines}


def test_a_detached_session_is_attached_by_another_pool_and_goes_on_where_it_was(tmp_path):
    fake = FakeBackend(keys=True)

    async def first_pool(engine, source, sink):
        source.feed_lines({"id": 1, "session": "nb", "code": "a = 1"}, {"id": 2, "session": "nb", "code": "a += 1"})
        await sink.wait_for(3)
        engine.detach_sessions()  # as a SIGTERM of a pool with a session store does

    lines, logs = serve(tmp_path, fake, first_pool)
    first, second = by_id(lines)[1], by_id(lines)[2]
    key = first["session_key"]
    assert len(key) >= 43 and "session_key" not in second  # on the first result only
    (held,) = fake.sessions
    assert (held.detaches, held.closes) == (1, 0) and list(fake.store) == [key]
    assert key not in json.dumps(logs)  # never logged

    async def second_pool(engine, source, sink):
        source.feed_lines({"id": 3, "session": "again", "attach": key})
        source.feed_lines({"id": 4, "session": "again", "code": "print(a)"})
        await sink.wait_for(3)
        source.end()  # EOF: sessions close, as they always did

    lines, logs = serve(tmp_path, fake, second_pool)
    answers = by_id(lines)
    assert answers[3] == {"id": 3, "session": "again", "attached": True, "step": 2}
    assert (answers[4]["step"], answers[4]["session_ended"], answers[4]["exit"]) == (3, False, 0)
    assert "session_key" not in answers[4]
    attached = fake.sessions[-1]
    assert attached.steps == 3 and attached.closes == 1 and attached.detaches == 0 and not fake.store


def test_a_wrong_key_and_an_unknown_key_are_the_same_refusal_and_an_open_name_is_refused(tmp_path):
    fake = FakeBackend(keys=True)
    wrong = "w" * 43

    async def scenario(engine, source, sink):
        source.feed_lines({"id": 1, "session": "nb", "code": "a = 1"})
        await sink.wait_for(2)
        engine.detach_sessions()

    lines, _ = serve(tmp_path, fake, scenario)
    key = by_id(lines)[1]["session_key"]

    async def attaches(engine, source, sink):
        source.feed_lines(
            {"id": "open", "session": "busy", "code": "b = 1"},
            {"id": "wrong", "session": "x", "attach": key[:-1] + ("A" if key[-1] != "A" else "B")},
            {"id": "unknown", "session": "y", "attach": wrong},
            {"id": "taken", "session": "busy", "attach": key},
            {"id": "after", "session": "x", "code": "print(1)"},
        )
        await sink.wait_for(6)
        source.end()

    lines, logs = serve(tmp_path, fake, attaches)
    answers = by_id(lines)
    refusals = [answers[name]["error"] for name in ("wrong", "unknown")]
    assert refusals[0] == refusals[1] and refusals[0]["type"] == "RequestError"
    assert refusals[0]["message"].startswith("attach: ")
    assert answers["wrong"]["session_ended"] is True
    assert answers["taken"]["error"]["message"].startswith("session: session 'busy' is open already")
    assert answers["after"]["step"] == 1  # a refused attach left no session of that name
    assert list(fake.store) == [key]  # still there for the right key
    assert key not in json.dumps(logs) and wrong not in json.dumps(logs)


def test_a_lost_step_is_answered_lost_and_the_session_goes_on_from_its_stored_state(tmp_path):
    fake = FakeBackend(keys=True, lose=lambda job: job.code == "crash")

    async def scenario(engine, source, sink):
        source.feed_lines(
            {"id": 1, "session": "nb", "code": "a = 1"},
            {"id": 2, "session": "nb", "code": "a += 1"},
            {"id": 3, "session": "nb", "code": "crash"},
            {"id": 4, "session": "nb", "code": "print(a)"},
            {"id": "s", "stats": True},
        )
        await sink.wait_for(6)
        source.end()

    lines, _ = serve(tmp_path, fake, scenario)
    answers = by_id(lines)
    lost = answers[3]
    assert (lost["exit"], lost["error"]["type"], lost["lost"], lost["session_ended"]) == (
        -1, "PoolWorkerError", True, False)
    assert (answers[4]["step"], answers[4]["resumed_from_step"], answers[4]["exit"]) == (3, 2, 0)
    assert "lost" not in answers[4] and "resumed_from_step" not in answers[2]
    assert answers["s"]["sessions_active"] == 1  # the lost step ended nothing
    (session,) = fake.sessions
    assert session.closes == 1  # at EOF, not at the lost step


def test_without_detach_sessions_end_with_the_pool_and_a_keyless_session_closes_on_detach(tmp_path):
    fake = FakeBackend()  # keys=False: a worker whose sessions cannot outlive it

    async def scenario(engine, source, sink):
        source.feed_lines({"id": 1, "session": "nb", "code": "a = 1"})
        await sink.wait_for(2)
        engine.detach_sessions()

    lines, _ = serve(tmp_path, fake, scenario)
    assert "session_key" not in lines[0]
    (session,) = fake.sessions
    assert (session.detaches, session.closes, fake.store) == (1, 1, {})


def test_the_threaded_backend_hands_a_runners_attach_key_job_and_detach_through():
    import threading

    from readie_pool._backend import ThreadedBackend
    from readie_worker.jobs import CodeJob

    job = CodeJob(checkpoint="base", code="", functions=("lookup",))
    calls: list[tuple[str, str]] = []

    class Handle:
        id, key = "s1", "k" * 43
        hibernated = False

        def __init__(self) -> None:
            self.job = job

        def detach(self) -> None:
            calls.append(("detach", threading.current_thread().name))

    class Runner:
        def attach_session(self, key, take_over=False, cancel=None):
            calls.append((f"attach {key == Handle.key}", threading.current_thread().name))
            return Handle(), 6

        def close(self) -> None:
            pass

    async def main():
        backend = ThreadedBackend(Runner(), slots=1)
        handle, step = await backend.attach_session(Handle.key)
        assert (step, handle.key, handle.job) == (6, Handle.key, job)
        assert Handle.key not in repr(handle)
        await handle.detach()
        await backend.close()

    asyncio.run(main())
    assert [what for what, _ in calls] == ["attach True", "detach"]
    assert calls[0][1].startswith("readie-job")  # the attach on a job thread: its caller holds a slot


def test_the_first_signal_detaches_sessions_when_they_can_be_kept_and_the_second_aborts():
    from readie_pool.cli import _Signals

    class Engine:
        def __init__(self) -> None:
            self.calls: list[str] = []

        def detach_sessions(self) -> None:
            self.calls.append("detach")

        def drain(self) -> None:
            self.calls.append("drain")

    for keep, expected in ((True, ["detach", "drain"]), (False, ["drain", "drain"])):
        signals, engine = _Signals(keep), Engine()
        signals.engine = engine  # type: ignore[assignment]
        signals.received(15)
        signals.received(15)
        assert engine.calls == expected
