"""Per-step checkpoints' bookkeeping (``_step_checkpoint.StepCheckpoints``), and the setting's check.

The checkpoint itself runs in real sandboxes (test_step_checkpoint_runsc.py);
here, what happens around it: one at a time, the session made idle again
whatever happened, a failure counted, a session another worker took never
written, a close that outwaited it torn down only after it, a lease lost
while an attach prepared acted on once the session exists.
"""

from __future__ import annotations

import threading

import pytest

from readie_worker import _step_checkpoint as step_checkpoint
from readie_worker._session_keeping import _LeaseTaken
from readie_worker._step_checkpoint import StepCheckpoints
from readie_worker.cli import build_parser
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ConfigError, SandboxSetupError


class _Store:
    def __init__(self, holds: bool) -> None:
        self._holds = holds

    def holds(self, key: str) -> bool:
        return self._holds


class _Images:
    """Stands for the worker's SessionImages: records writes, or blocks one until released."""

    def __init__(self, holds: bool = True, fails: bool = False) -> None:
        self.store = _Store(holds)
        self.fails = fails
        self.release = threading.Event()
        self.writes: list[int] = []

    def write(self, key, sandbox, *, job, memory_limit, step, lease, save):
        self.release.wait(5)
        if self.fails:
            raise SandboxSetupError("the session store is full")
        self.writes.append(step)
        return 1


def run(images: _Images) -> tuple[StepCheckpoints, list[tuple[str, float]], threading.Event]:
    observed: list[tuple[str, float]] = []
    finished = threading.Event()
    checkpoints = StepCheckpoints("ws-test", lambda result, seconds: observed.append((result, seconds)))
    checkpoints.start(images, "k", "lease", None, None, None, 7, finished.set)  # type: ignore[arg-type]
    return checkpoints, observed, finished


def test_a_checkpoint_is_waited_for_and_the_session_is_idle_after_it():
    images = _Images()
    checkpoints, observed, finished = run(images)
    assert not finished.wait(0.05), "busy while it runs"
    images.release.set()
    checkpoints.wait()
    assert finished.is_set() and images.writes == [7] and [result for result, _ in observed] == ["ok"]


def test_a_failed_checkpoint_is_counted_and_still_makes_the_session_idle():
    images = _Images(fails=True)
    images.release.set()
    checkpoints, observed, finished = run(images)
    checkpoints.wait()
    assert finished.is_set() and images.writes == [] and [result for result, _ in observed] == ["failed"]


def test_a_session_another_worker_took_is_never_written():
    images = _Images(holds=False)
    images.release.set()
    checkpoints, observed, finished = run(images)
    checkpoints.wait()
    assert images.writes == [] and [result for result, _ in observed] == ["failed"] and finished.is_set()


def test_an_unknown_session_checkpoint_setting_is_refused_before_anything_starts(tmp_path):
    config = WorkerConfig.in_temp(tmp_path / "manifest.json", session_checkpoint="always")
    with pytest.raises(ConfigError, match="session_checkpoint"):
        Worker(config).start()


def test_readie_worker_takes_the_setting_and_refuses_others():
    assert build_parser().parse_args(["--session-checkpoint", "step"]).session_checkpoint == "step"
    assert build_parser().parse_args([]).session_checkpoint == "off"
    with pytest.raises(SystemExit):
        build_parser().parse_args(["--session-checkpoint", "always"])


def test_a_close_that_outwaits_a_checkpoint_leaves_the_teardown_to_its_thread(monkeypatch):
    """Finding 6: the sandbox is destroyed and the entry let go only once the checkpoint ended."""
    monkeypatch.setattr(step_checkpoint, "CHECKPOINT_WAIT_S", 0.05)
    images = _Images()
    checkpoints, _, finished = run(images)
    assert checkpoints.wait() is False, "the bounded wait says it gave up"
    torn_down = threading.Event()
    checkpoints.then(torn_down.set)
    assert not torn_down.wait(0.05), "not while the checkpoint still writes"
    images.release.set()
    assert torn_down.wait(5) and finished.is_set() and images.writes == [7]
    ran = []
    checkpoints.then(lambda: ran.append(1))  # none running: at once
    assert ran == [1]


class _Session:
    def __init__(self) -> None:
        self.taken = 0

    def lease_taken(self) -> None:
        self.taken += 1


def test_a_lease_lost_while_an_attach_prepares_ends_the_session_once_it_exists():
    """Finding 2d: the loss is remembered until the session is bound, then acted on."""
    forward = _LeaseTaken()
    forward()  # the lease beat found it taken: no session yet
    session = _Session()
    forward.bind(session)  # type: ignore[arg-type]
    assert session.taken == 1
    kept = _Session()
    other = _LeaseTaken()
    other.bind(kept)  # type: ignore[arg-type]
    assert kept.taken == 0
    other()
    assert kept.taken == 1
