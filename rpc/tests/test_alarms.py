"""The one alarm thread behind every stream's watchdog (``_alarms``): due alarms run in order,
cancelled ones never, and cancelled entries do not pile up in its heap."""

from __future__ import annotations

import threading

from readie_rpc import _alarms


def test_alarms_run_when_due_in_order_and_a_cancelled_one_never() -> None:
    ran: list[str] = []
    done = threading.Event()
    _alarms.after(0.3, lambda: ran.append("cancelled")).cancel()  # well before it is due, even on busy cores
    _alarms.after(0.6, lambda: (ran.append("late"), done.set()))
    _alarms.after(0.1, lambda: ran.append("early"))
    assert done.wait(5)
    assert ran == ["early", "late"]


def test_cancelled_alarms_do_not_pile_up() -> None:
    live = _alarms.after(3600, lambda: None)
    for _ in range(1000):  # a stream's steps: each sets its watchdog and cancels it
        _alarms.after(3600, lambda: None).cancel()
    assert len(_alarms._ALARMS._heap) <= 2 * 2  # `live` and the other test's, if any, twice over
    live.cancel()
