"""Conformance, host functions: the real ``readie pool`` over pipes, each job a real gVisor sandbox.

Every check is against the pool protocol spec's "Host functions" section
(and docs/pool.md for what it leaves open): the spec's transcript field by
field, error replies, sessions, late and unknown replies, the timeout, and
hostile job code writing frames on its own socket. Every test runs twice:
with the worker in the pool's process, and through ``readie router`` in
front of two worker processes (``--router``), where the calls come back
over the worker's Interact stream.
"""

from __future__ import annotations

import json
import shutil
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from readie_executor import hostwire
from readie_pool.testing import PoolProcess, pool_placement
from readie_worker.jobs import MAX_REFUSED_FRAMES
from readie_worker.testing import CHANNEL_FORGER, runsc_in

from conftest import CHECKPOINTS

pytestmark = pytest.mark.runsc

SEARCH = "from readie_host import search\nprint(search('readie', limit=2))"


class Pool:
    def __init__(self, *args: str) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="rph-", dir="/tmp"))
        self.state = self.base / "state"
        self.process = PoolProcess(
            ["--checkpoints", str(CHECKPOINTS), "--state-dir", str(self.state), *args],
            cwd=self.base,
            stderr_path=self.base / "stderr.log",
        )
        self.ready = self.process.ready()

    def lines_until(self, *ids: Any, timeout: float = 30) -> list[dict[str, Any]]:
        """Every line read until results (not call events) for all of ``ids`` have come."""
        deadline = time.monotonic() + timeout
        lines, waiting = [], set(ids)
        while waiting:
            line = self.process.read(max(0.01, deadline - time.monotonic()))
            lines.append(line)
            if line.get("event") is None:
                waiting.discard(line["id"])
        return lines

    def call(self, timeout: float = 30) -> dict[str, Any]:
        line = self.process.read(timeout)
        assert line.get("event") == "call", line
        return line

    def reply(self, call_id: int, **answer: Any) -> None:
        self.process.send({"reply": {"call_id": call_id, **answer}})

    def cleanup(self) -> None:
        self.process.stop()
        leftovers = runsc_in(self.state).list_ids()
        if leftovers:
            runsc_in(self.state).sweep()
        shutil.rmtree(self.base, ignore_errors=True)
        assert leftovers == [], f"readie pool left runsc containers: {leftovers}"


@pytest.fixture(scope="module", params=["local", "router"])
def placement(request, checkpoints) -> Iterator[list[str]]:
    base = Path(tempfile.mkdtemp(prefix="rhp-", dir="/tmp"))
    with pool_placement(request.param, base, CHECKPOINTS / "manifest.json") as args:
        yield args
    shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def pool(placement) -> Iterator[Pool]:
    made = Pool("--workers", "2", *placement)
    yield made
    assert made.process.close() == 0
    made.cleanup()


def test_the_spec_transcript(pool):
    pool.process.send({"id": "t1", "functions": ["search"], "code": SEARCH})
    raw = pool.process.read_line()
    assert raw is not None
    call = json.loads(raw)
    assert list(call) == ["event", "id", "call_id", "function", "args", "kwargs"]
    assert call == {
        "event": "call", "id": "t1", "call_id": call["call_id"], "function": "search",
        "args": ["readie"], "kwargs": {"limit": 2},
    }
    assert type(call["call_id"]) is int and call["call_id"] >= 1
    pool.reply(call["call_id"], result=["first hit", "second hit"])
    result = pool.process.read()
    assert (result["id"], result["exit"], result["error"]) == ("t1", 0, None)
    assert result["stdout"] == "['first hit', 'second hit']\n"


def test_concurrent_jobs_get_distinct_call_ids_and_replies_find_their_job(pool):
    code = "import pynox_host\nprint(pynox_host.search('{q}'))"
    pool.process.send(
        {"id": "a", "functions": ["search"], "code": code.format(q="a")},
        {"id": "b", "functions": ["search"], "code": code.format(q="b")},
    )
    first, second = pool.call(), pool.call()
    assert first["call_id"] != second["call_id"]  # both are their task's call 1 in the worker
    for call in (second, first):  # answered in the other order
        pool.reply(call["call_id"], result=f"hit for {call['args'][0]} ({call['id']})")
    results = {line["id"]: line for line in pool.lines_until("a", "b")}
    assert results["a"]["stdout"] == "hit for a (a)\n" and results["b"]["stdout"] == "hit for b (b)\n"


def test_an_error_reply_raises_host_error_with_its_text(pool):
    pool.process.send({"id": "e", "functions": ["search"], "code": "from readie_host import search\nsearch('x')"})
    pool.reply(pool.call()["call_id"], error="backend unavailable")
    result = pool.process.read()
    assert (result["id"], result["exit"]) == ("e", 1)
    assert (result["error"]["type"], result["error"]["message"], result["error"]["line"]) == (
        "HostError", "backend unavailable", 2,
    )


def test_a_sessions_first_request_declares_the_functions_for_every_step(pool):
    p = pool.process
    first = p.run({"id": "s1", "session": "agent", "functions": ["search"], "code": "from readie_host import search"})
    assert (first["step"], first["exit"]) == (1, 0), first
    p.send({"id": "s2", "session": "agent", "code": "hits = search('step two')\nprint(hits)"})
    call = pool.call()
    assert (call["id"], call["function"], call["args"]) == ("s2", "search", ["step two"])
    pool.reply(call["call_id"], result=["one"])
    second = p.read()
    assert (second["id"], second["step"], second["stdout"]) == ("s2", 2, "['one']\n")
    refused = p.run({"id": "s3", "session": "agent", "functions": ["other"], "code": "pass"})
    assert refused["error"]["message"].startswith("functions: session 'agent' is open")
    assert p.run({"id": "s4", "session": "agent", "close": True})["closed"] is True


def test_waiting_for_the_host_counts_against_the_timeout_and_a_late_reply_is_refused(pool):
    started = time.monotonic()
    pool.process.send({"id": "slow", "functions": ["search"], "code": SEARCH, "timeout": "1s"})
    call = pool.call()
    result = pool.process.read()  # nobody replies
    assert (result["id"], result["exit"], result["error"]["type"]) == ("slow", 124, "TimeoutError")
    assert time.monotonic() - started < 10
    pool.reply(call["call_id"], result="too late")
    late = pool.process.read()
    assert (late["id"], late["exit"], late["policy"], late["error"]["type"]) == (None, -1, None, "RequestError")
    assert late["error"]["message"].startswith(f"reply.call_id: no call waits for a reply with call_id {call['call_id']}")
    pool.reply(10**9, error="never asked")
    unknown = pool.process.read()
    assert unknown["id"] is None and "call_id 1000000000" in unknown["error"]["message"]


def test_deep_values_cross_the_pool_both_ways(pool):
    code = (
        "from readie_host import echo\n"
        "deep = []\n"
        "for _ in range(100_000):\n"
        "    deep = [deep]\n"
        "back, levels = echo(deep), 0\n"
        "while back:\n"
        "    (back,), levels = back, levels + 1\n"
        "print(levels)\n"
    )
    pool.process.send({"id": "deep", "functions": ["echo"], "code": code})
    raw = pool.process.read_line()
    assert raw is not None
    call = hostwire.loads(raw)  # json.loads would hit its recursion limit
    assert (call["event"], call["function"]) == ("call", "echo")
    (value,) = call["args"]
    pool.process.send_raw(b'{"reply": {"call_id": %d, "result": ' % call["call_id"] + hostwire.dumps(value) + b"}}\n")
    result = pool.process.read(60)
    assert (result["id"], result["exit"], result["stdout"]) == ("deep", 0, "100000\n"), result


# --------------------------------------------------------------------------- hostile job code

# Finds the executor's connection among the process's descriptors and speaks
# framing v2 on it by hand (as in worker/tests/test_host_functions_runsc.py).
FORGER = CHANNEL_FORGER

FORGED = FORGER + r'''
for payload in (
    b'{"call":{"call_id":1,"function":"delete_everything","args":[],"kwargs":{}}}',
    b'{"call":{"call_id":9,"function":"search","args":["x"],"kwargs":{}}}',
    b'{"call":{"call_id":1,"function":"search","args":[],"kwargs":{},"as_root":true}}',
    b'{"call":' + b"[" * 100_000,
):
    print(ask(sock, payload)["error"][:120])
from readie_host import search
print("honest:", search("still works"))
'''


def test_forged_frames_never_reach_the_client(pool):
    p = pool.process
    p.send({"id": "forger", "functions": ["search"], "code": FORGED, "timeout": "60s"})
    call = pool.call()  # the only call event: the honest one
    assert (call["id"], call["function"], call["args"]) == ("forger", "search", ["still works"])
    pool.reply(call["call_id"], result="found")
    result = p.read(60)
    assert (result["id"], result["exit"]) == ("forger", 0), result
    lines = result["stdout"].splitlines()
    assert len(lines) == 5 and all(line.startswith("host call refused: ") for line in lines[:4]), lines
    assert "'delete_everything' is not a declared host function" in lines[0]
    assert lines[4] == "honest: found"


# Honest call frames, written by hand: all of them before any reply is read, so the worker's
# replies pile up in the socket. Short reply lines go into the sandbox from the pool's event loop
# when the socket takes them at once, long ones from the job's thread, as does whatever the loop
# could not send: the replies alternate, so the two senders take turns on one stream.
# The calls must all fit in the socket at once: Linux charges each small write about 770 bytes
# of a 208 KiB buffer, so about 278 fit. With more, the sandbox waits to write a call while the
# worker waits to write a reply the sandbox is not reading yet: the program's own deadlock, which
# only its timeout ends (CI hit it with 300).
UNREAD_CALLS = 100
UNREAD_REPLIES = FORGER + r'''
calls = %d
for call_id in range(1, calls + 1):
    send(sock, b'{"call":{"call_id":%%d,"function":"echo","args":[%%d],"kwargs":{}}}' %% (call_id, call_id))
for call_id in range(1, calls + 1):
    reply = json.loads(receive(sock))["reply"]
    assert reply == {"call_id": call_id, "result": "%%06d" %% call_id * (500 if call_id %% 2 else 4_000)}, str(reply)[:80]
print("all whole, in order")
''' % UNREAD_CALLS


def test_replies_the_sandbox_leaves_unread_arrive_whole_and_in_order_whichever_thread_sent_them(pool):
    p = pool.process
    p.send({"id": "unread", "functions": ["echo"], "code": UNREAD_REPLIES, "timeout": "60s"})
    for _ in range(UNREAD_CALLS):
        call = pool.call(60)
        (number,) = call["args"]
        # 3 kB (under MAX_EARLY_REPLY_BYTES) and 24 kB: 1.35 MB, six times the socket's buffer
        pool.reply(call["call_id"], result="%06d" % number * (500 if number % 2 else 4_000))
    result = p.read(60)
    assert (result["id"], result["exit"], result["stdout"]) == ("unread", 0, "all whole, in order\n"), result


def test_a_flood_of_junk_ends_the_job_and_the_pool_keeps_serving(pool):
    p = pool.process
    before = p.run({"id": "st1", "stats": True})["host"]["refused_frames"]
    flood = FORGER + "for i in range(10_000):\n    send(sock, b'{\"call\":junk %d}' % i)\nprint('flooded')\n"
    p.send({"id": "flood", "functions": ["search"], "code": flood, "timeout": "30s"})
    result = p.read(60)  # no call event first: junk never reaches the client
    assert (result["id"], result["exit"], result["error"]["type"]) == ("flood", -1, "PoolWorkerError"), result
    assert f"at most {MAX_REFUSED_FRAMES} are allowed" in result["error"]["message"]
    assert p.run({"id": "st2", "stats": True})["host"]["refused_frames"] == before + MAX_REFUSED_FRAMES + 1
    # The pool serves the next job, host functions included.
    p.send({"id": "next", "functions": ["search"], "code": SEARCH})
    pool.reply(pool.call()["call_id"], result=["after"])
    assert p.read()["stdout"] == "['after']\n"


def test_an_undeclared_name_is_not_importable_and_calls_nothing(pool):
    code = "import readie_host\nprint(sorted(n for n in dir(readie_host) if not n.startswith('_')))\nfrom readie_host import nope"
    result = pool.process.run({"id": "u", "functions": ["search"], "code": code})
    assert result["stdout"] == "['HostError', 'search']\n"
    assert result["error"]["type"] == "ImportError"
