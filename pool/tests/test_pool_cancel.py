"""Cancelling a job through ``readie pool``, raw lines, with the pool's own worker and through a router.

``{"id", "cancel": JOB}`` stops a queued or running job and frees its
sandbox; the cancel is answered by a ``cancelled`` event (``found``: the
job was still queued or running), the job by its own result, once.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from pool.tests._conformance import Pool, placed_pool

pytestmark = pytest.mark.runsc


@pytest.fixture(scope="module", params=["local", "router"])
def pool(request, checkpoints) -> Iterator[Pool]:
    with placed_pool(request.param, "rcn-", "--workers", "2") as made:
        yield made


def test_a_running_job_is_stopped_and_its_slot_freed(pool):
    pool.process.send({"id": "slow", "code": "import time\nprint('started', flush=True)\ntime.sleep(60)", "timeout": "90s"})
    time.sleep(2)  # running in its sandbox by now
    cancelled_at = time.monotonic()
    pool.process.send({"id": "c1", "cancel": "slow"})
    answers = {line["id"]: line for line in pool.process.results(2, timeout=30)}
    assert answers["c1"] == {"id": "c1", "event": "cancelled", "target": "slow", "found": True}
    slow = answers["slow"]
    assert slow["exit"] == -1 and slow["error"]["type"] == "PoolWorkerError", slow
    assert time.monotonic() - cancelled_at < 15, "the job stopped at the cancel, not at its 60 s"
    # Its slot is free again.
    after = pool.process.run({"id": "after", "code": "print('after')"}, timeout=30)
    assert (after["id"], after["exit"], after["stdout"]) == ("after", 0, "after\n")


def test_a_queued_job_is_cancelled_before_it_runs(pool):
    """Both slots busy, the queue (twice the workers) has room: the job waits for a slot, the cancel
    gets in. (A cancel is a line like any other: with the queue full, the pool reads it once a line
    ahead of it is answered.)"""
    for n in (1, 2):
        pool.process.send({"id": f"busy{n}", "code": "import time\ntime.sleep(3)"})
    time.sleep(1)
    pool.process.send({"id": "queued", "code": "print('never')"})
    pool.process.send({"id": "c2", "cancel": "queued"})
    answers = {line["id"]: line for line in pool.process.results(4, timeout=30)}
    assert answers["c2"]["found"] is True
    queued = answers["queued"]
    assert queued["exit"] == -1 and queued["error"]["type"] == "PoolWorkerError" and queued["stdout"] == "", queued
    assert answers["busy1"]["exit"] == answers["busy2"]["exit"] == 0


def test_cancelling_what_is_not_running_finds_nothing_and_a_bad_cancel_is_refused(pool):
    assert pool.process.run({"id": "c3", "cancel": "no-such-job"}) == {
        "id": "c3", "event": "cancelled", "target": "no-such-job", "found": False
    }
    refused = pool.process.run({"id": "c4", "cancel": True})
    assert refused["error"]["type"] == "RequestError" and "cancel" in refused["error"]["message"]


def test_a_running_session_step_is_stopped_and_its_session_ends(pool):
    opened = pool.process.run({"id": "s1", "session": "long", "code": "x = 1"})
    assert opened["exit"] == 0, opened
    pool.process.send({"id": "s2", "session": "long", "code": "import time\ntime.sleep(60)", "timeout": "90s"})
    time.sleep(2)
    cancelled_at = time.monotonic()
    pool.process.send({"id": "c5", "cancel": "s2"})
    answers = {line["id"]: line for line in pool.process.results(2, timeout=30)}
    assert answers["c5"] == {"id": "c5", "event": "cancelled", "target": "s2", "found": True}
    step = answers["s2"]
    assert step["error"]["type"] == "PoolWorkerError" and step["session_ended"] is True, step
    assert time.monotonic() - cancelled_at < 15, "the step stopped at the cancel, not at its 60 s"
    fresh = pool.process.run({"id": "s3", "session": "long", "code": "print('x' in dir())"})
    assert (fresh["step"], fresh["stdout"]) == (1, "False\n"), fresh  # a new session under the name
