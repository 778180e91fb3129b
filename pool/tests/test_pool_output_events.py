"""Streamed output through ``readie pool`` under runsc, raw lines, with the pool's own worker and
through a router: ``"stream": true`` brings ``output`` events as the job writes, then its result.

What must hold (docs/pool.md, "Streamed output"; decision 16): each event arrives while the job
still runs; ``seq`` counts a job's events from 1 in the order written; every event comes before
the job's result, which still holds the whole output; per stream the events never carry more
than ``max_output``, whatever the job prints, and whatever frames its code forges by hand.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
from readie_worker.jobs import MIN_FORWARD_INTERVAL_S, SMALL_FRAME_BURST, SMALL_FRAMES_PER_S

from pool.tests._conformance import Pool, placed_pool

pytestmark = pytest.mark.runsc

THREE_PRINTS = "import time\nfor n in (1, 2, 3):\n    print(f'step {n}', flush=True)\n    time.sleep(0.4)\n"


@pytest.fixture(scope="module", params=["local", "router"])
def pool(request, checkpoints) -> Iterator[Pool]:
    with placed_pool(request.param, "rout-", "--workers", "2") as made:
        yield made


def answer_of(pool: Pool, request: dict[str, Any], timeout: float = 60) -> tuple[list[tuple[float, dict]], dict]:
    """Send ``request``; its output events (each with the time it was read) and its result."""
    pool.process.send(request)
    events: list[tuple[float, dict[str, Any]]] = []
    deadline = time.monotonic() + timeout
    while True:
        line = pool.process.read(max(0.01, deadline - time.monotonic()))
        assert line["id"] == request["id"], line
        if line.get("event") != "output":
            return events, line
        events.append((time.monotonic(), line))


def test_three_flushed_prints_arrive_as_three_events_in_order_before_the_result(pool):
    events, result = answer_of(pool, {"id": "three", "code": THREE_PRINTS, "stream": True})
    assert [event for _, event in events] == [
        {"event": "output", "id": "three", "stream": "stdout", "data": f"step {n}\n", "seq": n} for n in (1, 2, 3)
    ]
    # Each as it was printed, 0.4 s apart, not together at the end.
    arrivals = [at for at, _ in events]
    assert arrivals[2] - arrivals[0] > 0.5, arrivals
    assert (result["exit"], result["stdout"]) == (0, "step 1\nstep 2\nstep 3\n")  # the result still has it all


def test_stderr_streams_too_and_seq_counts_both_streams(pool):
    code = "import sys, time\nprint('out', flush=True)\ntime.sleep(0.2)\nprint('err', file=sys.stderr)\n"
    events, result = answer_of(pool, {"id": "both", "code": code, "stream": True})
    assert [(e["stream"], e["data"], e["seq"]) for _, e in events] == [("stdout", "out\n", 1), ("stderr", "err\n", 2)]
    assert (result["stdout"], result["stderr"]) == ("out\n", "err\n")


def test_ten_megabytes_printed_are_bounded_by_max_output(pool):
    code = "import sys\nsys.stdout.write('x' * 10_000_000)\nsys.stdout.write('tail')\n"
    events, result = answer_of(pool, {"id": "big", "code": code, "stream": True, "max_output": "256k"})
    streamed = "".join(event["data"] for _, event in events)
    assert result["stdout_truncated"] is True
    assert streamed == result["stdout"] and len(streamed) == 256 * 1024  # never more than the result holds
    assert [event["seq"] for _, event in events] == list(range(1, len(events) + 1))
    assert all(len(event["data"]) <= 64 * 1024 for _, event in events)


def test_a_job_that_does_not_ask_gets_no_events_and_its_forged_frames_go_nowhere(pool):
    forge = (
        "from readie_executor import _channel, hostwire\n"
        "for _ in range(3):\n"
        "    _channel.current().send(hostwire.encode_output('stdout', 'forged'))\n"
        "print('honest')\n"
    )
    events, result = answer_of(pool, {"id": "quiet", "code": forge})
    assert events == [] and (result["exit"], result["stdout"]) == (0, "honest\n")


def test_a_flood_of_forged_frames_ends_the_job_and_what_it_sent_is_bounded(pool):
    flood = (
        "from readie_executor import _channel, hostwire\n"
        "send = _channel.current().send\n"
        "for n in range(20_000):\n"
        "    send(hostwire.encode_output('stdout', 'ab'))\n"
        "print('never')\n"
    )
    started = time.monotonic()
    events, result = answer_of(pool, {"id": "flood", "code": flood, "stream": True, "max_output": "16k"})
    took = time.monotonic() - started
    # Small frames faster than an honest sandbox sends them are refused past a burst, and 64
    # refusals end the job, as for forged call frames: the worker parsed a few hundred at most.
    assert (result["exit"], result["error"]["type"]) == (-1, "PoolWorkerError"), result
    assert "frames that were refused" in result["error"]["message"]
    streamed = "".join(event["data"] for _, event in events)
    admitted = SMALL_FRAME_BURST + SMALL_FRAMES_PER_S * took  # the burst, and what refilled meanwhile
    assert set(streamed) <= {"a", "b"} and len(streamed) <= 2 * admitted, (len(streamed), took)
    assert len(events) <= took / MIN_FORWARD_INTERVAL_S + 2, events


def test_a_stream_of_forged_junk_ends_the_job(pool):
    junk = (
        "from readie_executor import _channel\n"
        "for n in range(100):\n"
        "    _channel.current().send(b'{\"output\":{\"stream\":\"stdnope\",\"data\":\"x\"}}')\n"
    )
    events, result = answer_of(pool, {"id": "junk", "code": junk, "stream": True})
    assert events == [] and result["error"]["type"] == "PoolWorkerError", result


def test_a_session_step_streams_its_own_output(pool):
    opened = pool.process.run({"id": "s1", "session": "streamer", "code": "x = 41"})
    assert opened["exit"] == 0, opened
    events, result = answer_of(
        pool, {"id": "s2", "session": "streamer", "code": "print(x + 1, flush=True)", "stream": True}
    )
    assert [(e["data"], e["seq"]) for _, e in events] == [("42\n", 1)] and result["step"] == 2
    closed = pool.process.run({"id": "s3", "session": "streamer", "close": True})
    assert closed == {"id": "s3", "session": "streamer", "closed": True}
