"""The scenarios, in the order a run measures them.

Each module's ``run(bench, done)`` returns JSON-ready entries keyed by
scenario name; ``done`` holds what earlier scenarios returned, for the few
figures that combine two (restore time vs image size uses scenario 1).
"""

from __future__ import annotations

from . import egress, handover, hibernate, later, latency, memory, old_runsc, phases, router, scaling, soak, step_checkpoint, throughput, transfers

# (what --only calls it, module, entries it produces)
SCENARIOS = (
    ("latency", latency, ("start", "job")),
    ("memory", memory, ("memory",)),
    ("throughput", throughput, ("throughput",)),
    ("scaling", scaling, ("scaling",)),
    ("later", later, ("session_step", "host_function", "stream")),
    ("router", router, ("router_hop",)),
    ("phases", phases, ("phases",)),
    ("old_runsc", old_runsc, ("old_runsc",)),
    ("soak", soak, ("soak",)),
    ("hibernate", hibernate, ("hibernate",)),
    ("transfers", transfers, ("transfers",)),
    ("step_checkpoint", step_checkpoint, ("step_checkpoint",)),
    ("handover", handover, ("handover",)),
    ("egress", egress, ("egress",)),
)
#: Run only when named (``--only soak``, ``make soak``) or in the smoke run: at the
#: bench's size the soak takes about an hour, and ``make bench`` has ten minutes.
ON_DEMAND = frozenset({"soak"})
