"""Scenario 17: a networked job beside a plain one (issue 32, decision 36).

One in-process worker with egress (``egress_netns``) keeps one warm sandbox of the checkpoint
and one warm networked sandbox (restored into a namespace of its own, wired to refuse
everything until a job takes it). Each round runs ``print(1)`` as a plain job and as a
networked one (``allow_network`` a list within the ceiling), in a shuffled order, each once
both warm sets are full again and the machine settled: the networked job's wall time includes
its hand-out (one nft batch giving the sandbox the job's rules) and reading what its policy
refused and allowed after it. Issue 32 asks ``networked_over_plain`` p50 <= 2.

Nothing leaves the machine: the egress namespace and the world behind it are the tests' own
(worker/tests/_egress_world.py), behind host blackhole routes for every address they use, and
the scenario's one connecting job only reaches that world.
"""

from __future__ import annotations

import random
import shutil
import time
from typing import Any

from readie_policy.egress import parse_destinations, resolve_egress
from readie_worker.core import Worker, WorkerConfig
from readie_worker.errors import ReadieError
from readie_worker.jobs import CodeJob

from .._bench import Bench
from .._stats import paired_ratio, ratio, summary

# Fixed, so two runs shuffle their arms the same way.
RANDOM_SEED = 20261204
ARMS = ("plain", "networked")
# A warm set refills in a restore's time (~0.3-0.5 s here); a round waits for both at most this.
REFILL_WAIT_S = 30.0
CODE = "print(1)"


def run(bench: Bench, done: dict[str, Any]) -> dict[str, Any]:
    missing = [tool for tool in ("ip", "nft", "nsenter") if shutil.which(tool) is None]
    if missing:
        return {"egress": {"available": False, "reason": f"needs {', '.join(missing)}"}}
    from worker.tests import _egress_world as w  # the tests' own world: nothing leaves the machine

    name = bench.names[0]  # base: the figure is the network's cost, not an import's
    egress = resolve_egress(parse_destinations([f"10.199.1.0/24:{w.PORT}"]), parse_destinations([f"10.199.1.0/24:{w.PORT}"]))
    jobs = {
        "plain": CodeJob(checkpoint=name, code=CODE),
        "networked": CodeJob(checkpoint=name, code=CODE, network=True, egress=egress),
    }
    wall: dict[str, dict[int, float]] = {arm: {} for arm in ARMS}
    errors: list[str] = []
    rng = random.Random(RANDOM_SEED)
    left: list[str] | str = "?"
    hits: dict[str, int] = {}
    with w.world():
        config = WorkerConfig.in_temp(bench.manifest_path, warm={name: 1}, slots=bench.settings.slots,
                                      egress_netns=w.EGRESS, egress_dns=(w.UPSTREAM_DNS,))
        worker = Worker(config)
        try:
            worker.start()
            assert worker.egress is not None
            sets = (worker.warm[name], worker.egress.warm[name])
            reached = worker.run_job(CodeJob(checkpoint=name, network=True, egress=egress, code=(
                f"import socket\nsocket.create_connection(({w.ALLOWED!r}, {w.PORT}), timeout=5).close()\nprint('reached')")))
            if reached.stdout != "reached\n":
                raise ReadieError(f"a networked job did not reach the test world: {reached.error or reached.stdout[-200:]}")
            for round_index in range(bench.settings.egress_rounds):
                order = list(ARMS)
                rng.shuffle(order)
                for arm in order:
                    if not all(warm.wait_until_full(REFILL_WAIT_S) for warm in sets):
                        errors.append(f"round {round_index}: the warm sets did not refill within {REFILL_WAIT_S:.0f} s")
                    bench.settle()
                    try:
                        wall[arm][round_index] = _job(worker, jobs[arm])
                    except ReadieError as exc:  # one failed job costs its sample, not the scenario
                        errors.append(f"round {round_index} {arm}: {exc}")
            hits = {"plain": sets[0].hits, "networked": sets[1].hits}
        finally:
            worker.close()
        left = w.leftovers("rdie", "readie")
    arms = {arm: summary(list(wall[arm].values())) for arm in ARMS}
    return {
        "egress": {
            "what": f"print(1) on {name}, a plain warm job vs a networked one (allow_network a list within the "
            "ceiling: a warm networked sandbox given its rules at hand-out, its report read after), one each per "
            "round in a shuffled order, both warm sets full and the machine settled before each; Worker API in "
            "process, the tests' own egress namespace",
            "checkpoint": name,
            "plain_ms": arms["plain"],
            "networked_ms": arms["networked"],
            "networked_over_plain": ratio(arms["networked"], arms["plain"]),
            "networked_over_plain_paired": paired_ratio(
                [(wall["networked"][i], wall["plain"][i]) for i in wall["networked"] if i in wall["plain"]]),
            "warm_hits": hits,
            "errors": errors,
            "wiring_left": left,
        }
    }


def _job(worker: Worker, job: CodeJob) -> float:
    started = time.monotonic()
    outcome = worker.run_job(job)
    elapsed_ms = (time.monotonic() - started) * 1000
    if outcome.exit != 0 or outcome.stdout != "1\n":
        raise ReadieError(f"print(1) answered {outcome.error or outcome.stdout[-200:]!r}")
    if job.network and (outcome.network is None or outcome.network.refused_connections):
        raise ReadieError(f"a networked print(1) reported {outcome.network}")
    return elapsed_ms
