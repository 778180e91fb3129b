"""Every sandbox woken from one image draws its own random numbers (issue 26, decision 23).

Real pandas checkpoints, real restores: five jobs (warm and fresh restores),
a session and two forks of it (so three sessions resumed from one hibernation
image), each drawing from every generator the issue names. Without the
re-seeding all of them print the same values (the control is the template's
own state, which every one of them would otherwise continue).
"""

from __future__ import annotations

import json

import pytest

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ErrorType
from readie_worker.jobs import CodeJob, Step

pytestmark = pytest.mark.runsc

from conftest import CHECKPOINTS  # noqa: E402

DRAW = """\
import json, random, tempfile, uuid
import numpy as np
print(json.dumps({
    "random": random.random(),
    "getrandbits": random.getrandbits(64),
    "choice": random.choice(range(10**9)),
    "numpy": float(np.random.random()),
    "uuid1_clock_seq": uuid.uuid1().clock_seq,
    "tempfile": next(tempfile._get_candidate_names()),
}))
"""
GENERATORS = ("random", "getrandbits", "choice", "numpy", "uuid1_clock_seq", "tempfile")


@pytest.fixture(scope="module")
def worker(checkpoints):
    config = WorkerConfig.in_temp(CHECKPOINTS / "manifest.json", warm={"pandas": 2}, slots=2, max_sessions=8)
    worker = Worker(config).start()
    yield worker
    worker.close()
    assert worker.runsc.list_ids() == []


def pandas_job(code: str) -> CodeJob:
    return CodeJob(checkpoint="pandas", code=code, name="draw.py")


def draws(stdout: str) -> dict[str, object]:
    values = json.loads(stdout)
    assert sorted(values) == sorted(GENERATORS)
    return values


def assert_all_differ(samples: list[dict[str, object]]) -> None:
    for generator in GENERATORS:
        seen = [sample[generator] for sample in samples]
        assert len(set(seen)) == len(seen), f"{generator}: {seen}"


def test_five_sandboxes_restored_from_one_checkpoint_draw_different_numbers(worker):
    outcomes = [worker.run_job(pandas_job(DRAW)) for _ in range(5)]
    assert all(outcome.exit == 0 for outcome in outcomes), [outcome.error for outcome in outcomes]
    assert len({outcome.sandbox_id for outcome in outcomes}) == 5  # five sandboxes, not one reused
    assert_all_differ([draws(outcome.stdout) for outcome in outcomes])


def test_the_string_hash_seed_is_random_per_capture_not_fixed(worker):
    # What cannot be re-seeded (docs/security.md) is at least not a constant of readie's.
    outcome = worker.run_job(pandas_job("import os, sys\nprint(sys.flags.hash_randomization, 'PYTHONHASHSEED' in os.environ)"))
    assert outcome.stdout == "1 False\n", outcome


def test_a_session_and_two_forks_resumed_from_one_image_draw_different_numbers(worker):
    parent, first = worker.open_session(pandas_job("import random\nmine = random.Random(7)  # the session's own"))
    assert first.outcome.exit == 0, first.outcome
    forks = []
    try:
        forks = [worker.fork_session(parent)[0] for _ in range(2)]
        # The parent hibernated at the first fork; the second shared its image: three resumes of one image.
        samples = []
        for session in (parent, *forks):
            step = session.run_step(Step(DRAW + "print(mine.random())\n"))
            assert step.resumed_ms is not None and step.outcome.exit == 0, step.outcome
            drawn, own = step.outcome.stdout.splitlines()
            samples.append((draws(drawn), own))
        assert_all_differ([sample for sample, _ in samples])
        # __main__ is the session's state: a generator it seeded keeps its sequence in every fork.
        assert len({own for _, own in samples}) == 1
    finally:
        for session in (*forks, parent):
            session.close()


def test_a_session_that_breaks_the_reseeding_is_refused_at_its_resume(worker):
    session, first = worker.open_session(pandas_job("import random\nrandom.seed = None"))
    try:
        assert first.outcome.exit == 0, first.outcome
        session.hibernate()
        step = session.run_step(Step("print('served half re-seeded')"))
        assert step.session_ended and step.outcome.stdout == ""
        assert step.outcome.error.type == ErrorType.SANDBOX_SETUP
        # Why is the executor's own line, in the worker's log (no sandbox text reaches a client).
        assert "could not resume" in step.outcome.error.message
    finally:
        session.close()
