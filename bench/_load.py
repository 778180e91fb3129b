"""Closed-loop load: N clients, each sending its next job as soon as the last one answers."""

from __future__ import annotations

import os
import threading
import time
from typing import Any, Protocol

from ._jobs import JobKind, Sample
from ._procs import busy_fraction, machine_cpu, tree_cpu_split


class JobPath(Protocol):
    def run(self, kind: JobKind) -> Sample: ...


def drive(path: JobPath, kind: JobKind, clients: int, duration_s: float) -> dict[str, Any]:
    """Run ``clients`` loops for ``duration_s``; count the jobs that finished inside the window.

    A job still running at the deadline is waited for but not counted, so the
    rate is completions per second of window, never inflated by a tail.
    """
    lock = threading.Lock()
    finished: list[tuple[float, Sample]] = []
    started = time.monotonic()
    deadline = started + duration_s

    def client() -> None:
        while time.monotonic() < deadline:
            sample = path.run(kind)
            with lock:
                finished.append((time.monotonic(), sample))

    me = os.getpid()
    cpu_before, split_before = machine_cpu(), tree_cpu_split(me)
    threads = [threading.Thread(target=client, name=f"client-{i}") for i in range(clients)]
    for thread in threads:
        thread.start()
    time.sleep(max(0.0, deadline - time.monotonic()))
    # At the deadline: the tail after it is not the window's.
    cpu_after, split_after = machine_cpu(), tree_cpu_split(me)
    for thread in threads:
        thread.join()
    busy = busy_fraction(cpu_before, cpu_after)
    spent = {part: split_after[part] - split_before[part] for part in split_after}
    ours = sum(spent.values()) / (duration_s * len(os.sched_getaffinity(0)))
    inside = [sample for done, sample in finished if done <= deadline]
    good = [s for s in inside if s.error is None]
    errors = [s.error for s in inside if s.error is not None]
    return {
        "clients": clients,
        "window_s": duration_s,
        "completed": len(good),
        "errors": len(errors),
        "first_error": errors[0] if errors else None,
        "latencies_ms": [s.elapsed_ms for s in good],
        # Share of all cores busy (anyone's work): near 1.0 means the cores were the limit.
        "machine_busy": busy,
        # Of that, this run's process tree (bench, readie pool, sandboxes) and everyone else.
        "ours_busy": round(ours, 3),
        "others_busy": round(max(0.0, busy - ours), 3) if busy is not None else None,
        # Where the window's CPU went, per completed job: the bench's clients, readie
        # pool's Python (engine and worker), and the sandboxes with their runsc commands.
        "cpu_s_per_job": {part: round(cpu / len(good), 4) for part, cpu in spent.items()} if good else None,
    }
