"""Scenario 15: a session's step with per-step checkpoints on vs off (issue 30, decision 32).

Two in-process workers side by side, one with ``session_checkpoint="step"``
and one without, each keeping one session with a notebook's state (pandas:
a DataFrame of ``STATE_ROWS`` rows). Each round runs one step in each, in a
shuffled order, and then waits ``THINK_S``: an agent's steps come seconds
apart (a model call between them), and the checkpoint runs in that gap,
after the step's result was returned. A step's wall time includes any wait
for the previous step's checkpoint: ``step_over_off`` is what a client
sees (issue 30 asks p50 within 1.2x).

What a checkpoint costs: its wall time (from the step's end to the session
idle again) and its CPU: the sandbox's processes (sentry, gofer) over the
step and its checkpoint, less the same over the other arm's step, plus the
runsc commands reaped meanwhile.
"""

from __future__ import annotations

import random
import time
from typing import Any

from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ReadieError
from readie_worker.jobs import CodeJob, Step
from readie_worker.sessions import SandboxSession

from .._bench import Bench
from .._procs import children_cpu_s, cpu_s, sandbox_pids
from .._stats import paired_ratio, ratio, summary
from .hibernate import STATE_ROWS

# Fixed, so two runs shuffle their arms the same way.
RANDOM_SEED = 20261203
ARMS = ("off", "step")
# Between an agent's steps (a model's answer takes seconds; half a second is the short end).
THINK_S = 0.5
SETUP = f"import pandas as pd\ndf = pd.DataFrame({{'n': range({STATE_ROWS})}})\nn = 0\nprint('set')\n"
BASE_SETUP = "n = 0\nprint('set')\n"


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    # The largest image (pandas, the session); a smoke run takes the smallest.
    name = bench.names[0] if bench.settings.smoke_scope else bench.names[-1]
    pandas = "pandas" in bench.checkpoint(name).preimport
    # No warm pools: each session's sandbox is restored for it, and no refill runs beside the steps.
    workers = {
        arm: Worker(WorkerConfig.in_temp(bench.manifest_path, warm={}, slots=bench.settings.slots, session_checkpoint=arm))
        for arm in ARMS
    }
    sessions: dict[str, SandboxSession] = {}
    wall: dict[str, dict[int, float]] = {arm: {} for arm in ARMS}
    errors: list[str] = []
    rng = random.Random(RANDOM_SEED)
    left: int | str = "?"
    cpu: dict[str, float] = {}
    try:
        for arm, worker in workers.items():
            worker.start()
            session, first = worker.open_session(CodeJob(checkpoint=name, code=SETUP if pandas else BASE_SETUP))
            sessions[arm] = session
            if first.outcome.stdout != "set\n":
                raise ReadieError(f"{arm}: the session's setup printed {first.outcome.stdout[-200:]!r}")
        sessions["step"].wait_for_checkpoint()
        bench.settle()
        pids = {arm: sandbox_pids(session.sandbox_id or "") for arm, session in sessions.items()}
        before = {arm: cpu_s(pids[arm]) for arm in ARMS}
        children_before = children_cpu_s()
        code = "n += 1\nprint(n, len(df))\n" if pandas else "n += 1\nprint(n)\n"
        for round_index in range(bench.settings.session_steps):
            order = list(ARMS)
            rng.shuffle(order)
            for arm in order:
                try:
                    wall[arm][round_index] = _step(sessions[arm], code)
                except ReadieError as exc:  # one failed step costs its sample, not the scenario
                    errors.append(f"round {round_index} {arm}: {type(exc).__name__}: {exc}")
                time.sleep(THINK_S)
        sessions["step"].wait_for_checkpoint()
        # The runsc commands reaped meanwhile are the checkpoints' (no pool refills).
        cpu = {arm: cpu_s(pids[arm]) - before[arm] for arm in ARMS}
        cpu["runsc"] = children_cpu_s() - children_before
    finally:
        for session in sessions.values():
            session.close()
        for worker in workers.values():
            worker.close()
        try:
            left = sum(len(worker.runsc.list_ids()) for worker in workers.values())
        except (ReadieError, OSError) as exc:
            left = f"cannot list: {exc}"
    arms = {arm: summary(list(wall[arm].values())) for arm in ARMS}
    registry = workers["step"].metrics.registry
    histogram = "readie_worker_session_checkpoint_duration_seconds"
    done_ok = registry.get_sample_value(f"{histogram}_count", {"result": "ok"}) or 0.0
    seconds = registry.get_sample_value(f"{histogram}_sum", {"result": "ok"}) or 0.0
    steps = len(wall["step"])
    return {
        "step_checkpoint": {
            "what": f"a {name} session's step (a DataFrame of {STATE_ROWS:,} rows) with session_checkpoint "
            f"step vs off, one step each per round in a shuffled order, {THINK_S} s of think time after each "
            "(an agent's steps come seconds apart); Worker API in process",
            "checkpoint": name,
            "think_s": THINK_S,
            "step_ms": arms["step"],
            "off_ms": arms["off"],
            "step_over_off": ratio(arms["step"], arms["off"]),
            "step_over_off_paired": paired_ratio([(wall["step"][i], wall["off"][i]) for i in wall["step"] if i in wall["off"]]),
            "checkpoints": int(done_ok),
            "checkpoints_failed": int(registry.get_sample_value(f"{histogram}_count", {"result": "failed"}) or 0),
            "checkpoint_ms_mean": round(seconds / done_ok * 1000, 1) if done_ok else None,
            # The sandbox's processes with checkpoints less without, plus runsc, per checkpoint.
            "checkpoint_cpu_s": round((cpu["step"] - cpu["off"] + cpu["runsc"]) / steps, 3) if cpu and steps else None,
            "errors": errors,
            "containers_left": left,
        }
    }


def _step(session: SandboxSession, code: str) -> float:
    """One step's wall milliseconds as a client sees them (any wait for the last checkpoint included)."""
    started = time.monotonic()
    outcome = session.run_step(Step(code)).outcome
    elapsed_ms = (time.monotonic() - started) * 1000
    if outcome.exit != 0:
        raise ReadieError(f"the step failed: {outcome.error}")
    return elapsed_ms
