"""Host functions in the pool engine, in memory: call events, replies, ids, deadlines, permits. No gVisor.

The fake backend makes each job's calls through the engine's host callback
on a thread, as the worker does; the real process against real sandboxes is
test_pool_host_functions.py.
"""

from __future__ import annotations

import asyncio
import threading
import time
from pathlib import Path

from readie_executor import hostwire
from readie_pool._events import RuntimeInfo
from readie_protocol.connection import PoolConnection, Role
from readie_protocol.events import CallEvent, ReadyEvent
from readie_pool._engine import PoolEngine, PoolSetup
from readie_policy.jobs import MAX_EARLY_REPLY_BYTES
from readie_pool.testing import FakeBackend, MemorySink, MemorySource
from readie_worker.jobs import HostCall, HostReply


def setup_for(cwd: Path, workers: int = 1) -> PoolSetup:
    return PoolSetup(workers=workers, checkpoint="base", runtime=RuntimeInfo.pool("3.11.2"), cwd=cwd)


def serve(setup, scenario, backend):
    logs: list[dict] = []

    async def main():
        source, sink = MemorySource(), MemorySink()
        engine = PoolEngine(setup, backend, log_job=lambda event, **line: logs.append({"event": event, **line}))
        serving = asyncio.create_task(engine.serve(source, sink))
        await scenario(engine, source, sink, backend)
        code = await asyncio.wait_for(serving, 5)
        return code, sink.lines, engine

    code, lines, engine = asyncio.run(main())
    assert code == 0
    return code, lines, engine, backend, logs


def calls_from_code(job) -> list[HostCall]:
    """``call:search`` makes one call to search; ``call:a,b`` one to each."""
    if not job.code.startswith("call:"):
        return []
    names = job.code.split(":", 1)[1].split(",")
    return [HostCall(n, name, ("readie",), {"limit": 2}) for n, name in enumerate(names, 1)]


def host_backend(**extra) -> FakeBackend:
    return FakeBackend(host_calls=calls_from_code, **extra)


async def next_call(sink, count: int) -> dict:
    lines = await sink.wait_for(count)
    assert lines[count - 1]["event"] == "call", lines
    return lines[count - 1]


def test_a_call_becomes_an_event_and_the_reply_goes_back_to_the_job(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "t1", "functions": ["search"], "code": "call:search"})
        call = await next_call(sink, 2)
        assert call == {
            "event": "call", "id": "t1", "call_id": 1, "function": "search", "args": ["readie"], "kwargs": {"limit": 2},
        }
        source.feed_lines({"reply": {"call_id": 1, "result": ["first hit", "second hit"]}})
        await sink.wait_for(3)
        source.end()

    _, lines, engine, fake, logs = serve(setup_for(tmp_path), scenario, host_backend())
    assert lines[2]["id"] == "t1" and lines[2]["exit"] == 0
    assert fake.replies == {"t1": [HostReply(result=["first hit", "second hit"])]}
    assert fake.started[0].functions == ("search",)
    assert engine.stats.host_calls == engine.stats.host_replies == 1 and engine.stats.jobs == 1
    assert [log["id"] for log in logs] == []  # --log=json is off here; call events are never job lines


def test_call_ids_are_pool_wide_and_replies_find_their_call(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": "a", "functions": ["search"], "code": "call:search"},
            {"id": "b", "functions": ["search"], "code": "call:search"},
        )
        await sink.wait_for(3)
        calls = {line["id"]: line["call_id"] for line in sink.lines[1:3]}
        assert sorted(calls.values()) == [1, 2]  # both tasks' first call, two ids
        source.feed_lines(
            {"reply": {"call_id": calls["b"], "result": "for b"}},
            {"reply": {"call_id": calls["a"], "error": "no luck for a"}},
        )
        await sink.wait_for(5)
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path, workers=2), scenario, host_backend())
    assert fake.replies == {"a": [HostReply(error="no luck for a")], "b": [HostReply(result="for b")]}


def test_an_unknown_or_repeated_reply_is_a_request_error_with_a_null_id(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "t", "functions": ["search"], "code": "call:search"})
        await next_call(sink, 2)
        source.feed_lines({"reply": {"call_id": 1, "result": 1}}, {"reply": {"call_id": 1, "result": 2}})
        source.feed_lines({"reply": {"call_id": 99, "error": "x"}})
        await sink.wait_for(5)
        source.end()

    _, lines, engine, fake, _ = serve(setup_for(tmp_path), scenario, host_backend())
    refusals = [line for line in lines[2:] if line["id"] is None]
    assert [r["error"]["message"].split(" (")[0] for r in refusals] == [
        "reply.call_id: no call waits for a reply with call_id 1",
        "reply.call_id: no call waits for a reply with call_id 99",
    ]
    assert all((r["exit"], r["error"]["type"], r["policy"]) == (-1, "RequestError", None) for r in refusals)
    assert fake.replies == {"t": [HostReply(result=1)]}
    assert engine.stats.late_replies == 2 and engine.stats.jobs == 3  # the job and two refusals


def test_a_reply_gets_through_when_every_permit_is_held(tmp_path):
    # workers=1: the calling job and a queued job hold both permits; the next
    # job line waits for one, and the reply written after it must still be read.
    backend = host_backend(gates={"queued": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        source.feed_lines(
            {"id": "caller", "functions": ["search"], "code": "call:search"},
            {"id": "queued", "code": "queued"},
            {"id": "behind", "code": "behind"},
        )
        call = await next_call(sink, 2)
        assert engine.accepted == 2  # "behind" is read but holds no permit
        source.feed_lines({"reply": {"call_id": call["call_id"], "result": "ok"}})
        await sink.wait_for(3)
        assert sink.lines[2]["id"] == "caller"
        fake.gates["queued"].set()
        await sink.wait_for(5)
        source.end()

    _, lines, engine, fake, _ = serve(setup_for(tmp_path, workers=1), scenario, backend)
    assert [line["id"] for line in lines[2:]] == ["caller", "queued", "behind"]
    assert fake.replies == {"caller": [HostReply(result="ok")]}
    assert engine.accepted == 3


def test_without_a_waiting_call_nothing_is_read_ahead(tmp_path):
    backend = FakeBackend(gates={"hold": asyncio.Event()})

    async def scenario(engine, source, sink, fake):
        for i in range(5):
            source.feed_lines({"id": i, "code": "hold"})
        source.feed_lines({"reply": {"call_id": 1, "result": 1}})
        await asyncio.sleep(0.05)
        assert (engine.accepted, source.unread) == (2, 4)  # as before host functions
        fake.gates["hold"].set()
        source.end()

    _, lines, *_ = serve(setup_for(tmp_path, workers=1), scenario, backend)
    assert len(lines) == 7  # five results and the reply's refusal


def test_the_hosts_slowness_counts_against_the_timeout(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "t", "functions": ["search"], "code": "call:search", "timeout": "200ms"})
        call = await next_call(sink, 2)
        started = time.monotonic()
        await sink.wait_for(3)  # the job's result, without a reply
        assert time.monotonic() - started < 2
        source.feed_lines({"reply": {"call_id": call["call_id"], "result": "late"}})
        await sink.wait_for(4)
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path), scenario, host_backend())
    assert fake.replies == {"t": [HostReply(error="search: no reply from the client within the task's timeout")]}
    assert lines[2]["id"] == "t"
    assert (lines[3]["id"], lines[3]["error"]["type"]) == (None, "RequestError")


def test_a_call_made_after_its_tasks_deadline_is_answered_at_once_and_never_posted(tmp_path):
    """Never a call event: the client may still be answering the task's last call, and a second
    call of one request while it does is a break of the protocol's order."""

    def late(job) -> list[HostCall]:  # the fake sets the job's deadline on its calls: past by then
        time.sleep(0.1)
        return [HostCall(1, "search", ("readie",), {})]

    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "t", "functions": ["search"], "code": "late", "timeout": "20ms"})
        await sink.wait_for(2)
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path), scenario, FakeBackend(host_calls=late))
    assert [line.get("event") for line in lines] == ["ready", None] and lines[1]["id"] == "t"
    assert fake.replies == {"t": [HostReply(error="search: the task's timeout has passed")]}


def test_eof_answers_a_waiting_call_with_an_error(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": "t", "functions": ["search"], "code": "call:search"})
        await next_call(sink, 2)
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path), scenario, host_backend())
    assert lines[2]["id"] == "t"
    assert fake.replies == {"t": [HostReply(error="search: stdin has ended, so no reply can come")]}


def test_a_session_declares_functions_once_and_every_step_calls_them(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "session": "nb", "functions": ["search"], "code": "x = 1"})
        await sink.wait_for(2)
        source.feed_lines({"id": 2, "session": "nb", "code": "call:search"})
        call = await next_call(sink, 3)
        assert (call["id"], call["call_id"], call["function"]) == (2, 1, "search")
        source.feed_lines({"reply": {"call_id": 1, "result": "step 2"}})
        await sink.wait_for(4)
        source.feed_lines({"id": 3, "session": "nb", "functions": ["other"], "code": "y"})
        await sink.wait_for(5)
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path), scenario, host_backend())
    assert (lines[3]["id"], lines[3]["step"], lines[3]["exit"]) == (2, 2, 0)
    assert fake.replies == {"2": [HostReply(result="step 2")]}
    assert fake.sessions[0].job.functions == ("search",)
    refused = lines[4]
    assert refused["error"]["message"].startswith("functions: session 'nb' is open")


def test_reserved_names_are_refused_before_anything_runs(tmp_path):
    async def scenario(engine, source, sink, fake):
        source.feed_lines({"id": 1, "functions": ["__import__"], "code": "x"})
        source.end()

    _, lines, _, fake, _ = serve(setup_for(tmp_path), scenario, host_backend())
    assert lines[1]["error"]["message"] == "functions: item 0: '__import__' is reserved in readie_host"
    assert fake.started == []


def test_a_short_reply_goes_to_reply_now_on_the_loop_a_long_one_and_a_failed_one_to_the_job_only(tmp_path):
    """``HostCall.reply_now`` (the worker's early send) gets a reply from a short line, on the
    pool's loop, before the job's thread has it; a long line's reply goes to the job's thread
    alone; a reply_now that raises costs neither the call nor the pool's intake."""
    handed: list[tuple[str, HostReply, bool]] = []

    def reply_now(request: str):
        def reply_now(reply: HostReply) -> bool:
            handed.append((request, reply, threading.current_thread() is threading.main_thread()))
            if request == "broken":
                raise MemoryError
            return True

        return reply_now

    def calls(job) -> list[HostCall]:
        return [HostCall(1, "search", (), {}, reply_now=reply_now(job.code))]

    long = "x" * MAX_EARLY_REPLY_BYTES

    async def scenario(engine, source, sink, fake):
        for count, request in enumerate(("short", "long", "broken", "after")):
            source.feed_lines({"id": request, "functions": ["search"], "code": request})
            call = await next_call(sink, 2 * count + 1 + 1)
            result = long if request == "long" else request
            source.feed_lines({"reply": {"call_id": call["call_id"], "result": result}})
            await sink.wait_for(2 * count + 3)
        source.end()

    _, lines, engine, fake, _ = serve(setup_for(tmp_path), scenario, FakeBackend(host_calls=calls))
    assert [(request, reply.result, on_loop) for request, reply, on_loop in handed] == [
        ("short", "short", True), ("broken", "broken", True), ("after", "after", True),
    ]
    assert fake.replies == {
        "short": [HostReply(result="short")], "long": [HostReply(result=long)],
        "broken": [HostReply(result="broken")], "after": [HostReply(result="after")],
    }
    assert engine.stats.host_replies == 4 and engine.stats.late_replies == 0


def test_call_events_of_deep_values_are_written_without_recursion():
    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    connection = PoolConnection(Role.POOL)
    connection.send(ReadyEvent.pool(workers=1))
    line = connection.send(CallEvent("t", 3, "echo", [deep], {"s": "a\nb\ud800"}))
    assert line.endswith(b"\n") and line.count(b"\n") == 1
    event = hostwire.loads(line)
    assert (event["event"], event["id"], event["call_id"], event["kwargs"]) == ("call", "t", 3, {"s": "a\nb\ud800"})
