"""When an idle session is paused (``_idle_pause.IdleClock``), its sandbox stood in for by a
recording fake: the rule alone. The real thing: test_idle_pause_runsc.py."""

from __future__ import annotations

import threading
from dataclasses import dataclass

from readie_worker._idle_pause import MAX_IDLE_CPU_SHARE, IdleClock
from readie_worker.core import WorkerConfig

PAUSE_AFTER_IDLE_S = WorkerConfig.session_pause_s


@dataclass
class FakeSandbox:
    id: str = "rd-fake"
    network: object | None = None
    cpu: int | None = 0
    paused: bool = False
    resumes: int = 0
    resumable: bool = True
    interrupted: bool = False

    def cpu_ns(self) -> int | None:
        return self.cpu

    def pause(self) -> None:
        self.paused = True

    def resume(self) -> bool:
        self.resumes += 1
        self.paused = self.paused and not self.resumable
        return not self.paused

    def interrupt(self) -> None:
        self.interrupted = True


def idled(seconds: float) -> IdleClock:
    clock = IdleClock()
    clock.idle()
    assert clock.since is not None
    clock.since -= seconds
    return clock


def look(clock: IdleClock, sandbox: FakeSandbox | None, lock: threading.Lock | None = None) -> bool:
    return clock.pause_if_quiet(lock or threading.Lock(), lambda: sandbox, PAUSE_AFTER_IDLE_S)


def looked_at_twice(clock: IdleClock, sandbox: FakeSandbox, cpu_share: float) -> bool:
    """The pauser's first look samples the CPU; the second, a second later, decides."""
    assert not look(clock, sandbox)
    clock._seen = (clock._seen[0] - 1.0, clock._seen[1]) if clock._seen else None
    if sandbox.cpu is not None:
        sandbox.cpu += int(cpu_share * 1e9)
    return look(clock, sandbox)


def test_a_session_idle_long_and_quiet_is_paused_at_the_second_look():
    sandbox = FakeSandbox()
    assert looked_at_twice(idled(PAUSE_AFTER_IDLE_S + 1), sandbox, cpu_share=0.03)
    assert sandbox.paused


def test_one_idle_briefly_or_whose_code_computes_is_not():
    for clock, share in ((idled(PAUSE_AFTER_IDLE_S / 2), 0.0), (idled(PAUSE_AFTER_IDLE_S + 1), MAX_IDLE_CPU_SHARE * 2)):
        sandbox = FakeSandbox()
        assert not looked_at_twice(clock, sandbox, share)
        assert not sandbox.paused


def test_a_networked_session_or_one_whose_cpu_is_unknown_is_never_paused():
    for sandbox in (FakeSandbox(network=object()), FakeSandbox(cpu=None)):
        assert not looked_at_twice(idled(PAUSE_AFTER_IDLE_S + 1), sandbox, cpu_share=0.0)
        assert not sandbox.paused


def test_holding_the_session_resumes_it_and_a_new_wait_starts_from_nothing():
    sandbox = FakeSandbox()
    clock = idled(PAUSE_AFTER_IDLE_S + 1)
    assert looked_at_twice(clock, sandbox, cpu_share=0.0)
    assert clock.paused  # what the worker's gauge counts
    clock.held(sandbox)
    assert (sandbox.paused, sandbox.resumes, clock.since, clock.paused) == (False, 1, None, False)
    assert not look(clock, sandbox)  # held: not idle at all
    clock.idle()
    assert not look(clock, sandbox)  # a new wait: its first look only samples
    assert not sandbox.paused


def test_a_session_whose_lock_is_taken_or_that_is_not_idle_is_passed_over_without_waiting():
    sandbox, clock, lock = FakeSandbox(), idled(PAUSE_AFTER_IDLE_S + 1), threading.Lock()
    assert not look(clock, sandbox)
    with lock:  # its step, hibernation or file holds it: the pauser goes on to the next session
        assert not look(clock, sandbox, lock)
    assert not look(clock, None)  # not idle: the session gives no sandbox
    assert not sandbox.paused


def test_a_sandbox_that_cannot_be_resumed_is_interrupted_so_that_its_next_use_fails_at_once():
    sandbox = FakeSandbox(resumable=False)
    clock = idled(PAUSE_AFTER_IDLE_S + 1)
    assert looked_at_twice(clock, sandbox, cpu_share=0.0)
    clock.held(sandbox)
    assert (sandbox.paused, sandbox.interrupted) == (True, True)
