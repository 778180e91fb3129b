"""Networked jobs and sessions through the Worker (issue 32): restored from the plain checkpoint
into a namespace wired by the job's policy, what it refused told in the result, nothing left.

``egress_netns`` is the tests' own namespace standing for the outside world (``_egress_world``),
``egress_dns`` its resolver; the host holds blackhole routes for every test address meanwhile."""

from __future__ import annotations

import json
import socket

import pytest
from structlog.testing import capture_logs

from readie_policy.egress import parse_destinations, resolve_egress
from readie_protocol.events import RefusedConnection
from readie_worker import _netns
from readie_worker.core import Worker, WorkerConfig
from readie_worker.jobs import CodeJob, Step
from readie_worker.testing import wait_until
from worker.tests import _egress_world as w

from conftest import CHECKPOINTS  # noqa: E402

pytestmark = pytest.mark.runsc

# The operator's ceiling: the allowed test network (private: naming it opens it), and names.
CEILING = parse_destinations([f"10.199.1.0/24:{w.PORT}", "allowed.test", "rebind.test"])
# The sandbox's /30s (egress_net.DEFAULT_POOL) and the readie names a worker uses by default.
PREFIX, TABLE = "rdie", "readie"

# In the sandbox: connect to each target; look each name up (getaddrinfo: /etc/resolv.conf names
# the sandbox's resolver) and connect to its answer. One JSON line.
PROBE = w.CONNECT + """
import json

def lookup(name):
    try:  # through glibc and /etc/resolv.conf, as any library in a job looks a name up
        return [0, socket.getaddrinfo(name, PORT, socket.AF_INET, socket.SOCK_STREAM)[0][4][0]]
    except socket.gaierror as exc:
        return [exc.errno, None]

connects = {f"{a}:{p}": connect(a, p) for a, p in TARGETS}  # first: an answered name opens its address
looked = {name: lookup(name) for name in NAMES}
print(json.dumps({
    "connects": connects,
    "lookups": looked,
    "by_name": {name: connect(address, PORT)[0] for name, (_, address) in looked.items() if address},
}))
"""


def probe(targets: list[tuple[str, int]], names: list[str] = ()) -> str:
    return f"TARGETS = {targets!r}\nNAMES = {list(names)!r}\nPORT = {w.PORT}\n" + PROBE


def networked(code: str, asked: list[str] | bool, ceiling=CEILING) -> CodeJob:
    egress = resolve_egress(asked if isinstance(asked, bool) else parse_destinations(asked), ceiling)
    return CodeJob(checkpoint="base", code=code, name="probe.py", network=True, egress=egress, timeout_ms=30_000)


def refused_fast(connects: dict, target: str) -> bool:
    outcome, seconds = connects[target]
    return outcome == "ECONNREFUSED" and seconds < 0.5  # reject, never a drop that hangs the job


@pytest.fixture(scope="module")
def worker():
    with w.world() as world:
        config = WorkerConfig.in_temp(
            CHECKPOINTS / "manifest.json", warm={"base": 1}, egress_netns=w.EGRESS, egress_dns=(w.UPSTREAM_DNS,),
        )
        started = Worker(config).start()
        try:
            yield started, world
        finally:
            started.close()
        assert w.leftovers(PREFIX, TABLE) == [], "the worker left egress wiring behind"


def test_a_job_reaches_its_allowed_network_and_name_and_is_told_what_was_refused(worker):
    worker, world = worker
    targets = [(w.ALLOWED, w.PORT), (w.DENIED, w.PORT), (w.METADATA, 80), (w.ALLOWED, 9000)]
    world.upstream.names["rebind.test"] = w.DENIED  # an allowed name re-pointed at a denied address
    try:
        with capture_logs() as logs:
            outcome = worker.run_job(networked(probe(targets, ["allowed.test", "denied.test", "rebind.test"]),
                                               [f"10.199.1.0/24:{w.PORT}", "allowed.test", "rebind.test"]))
    finally:
        world.upstream.names["rebind.test"] = w.ALLOWED
    assert outcome.exit == 0 and outcome.backend == "gvisor:runsc-restore", outcome
    seen = json.loads(outcome.stdout)
    connects = seen["connects"]
    assert connects[f"{w.ALLOWED}:{w.PORT}"][0] == "ok"
    assert all(refused_fast(connects, t) for t in (f"{w.DENIED}:{w.PORT}", f"{w.METADATA}:80", f"{w.ALLOWED}:9000")), connects
    assert seen["lookups"]["allowed.test"] == [0, w.ALLOWED] and seen["by_name"] == {"allowed.test": "ok"}
    assert seen["lookups"]["denied.test"] == [socket.EAI_NONAME, None]  # NXDOMAIN: a name not allowed
    assert seen["lookups"]["rebind.test"] == [socket.EAI_NONAME, None]  # its only answer was denied: dropped
    report = outcome.network
    assert report is not None and report.refused_connections == 3, report
    assert set(report.refused) == {RefusedConnection(w.DENIED, w.PORT, 1), RefusedConnection(w.METADATA, 80, 1),
                                   RefusedConnection(w.ALLOWED, 9000, 1)}
    assert report.refused_lookups == 2 and set(report.refused_names) == {"denied.test", "rebind.test"}
    assert report.allowed_connections == 2  # ALLOWED:8000, and allowed.test's answer
    [line] = [entry for entry in logs if entry["event"] == "job"]  # the log line names the refusals
    assert set(line["network_refused_to"]) == {f"{w.DENIED}:{w.PORT}", f"{w.METADATA}:80", f"{w.ALLOWED}:9000"}
    assert (line["network_refused"], set(line["network_refused_names"])) == (3, {"denied.test", "rebind.test"})
    assert worker.egress.warm["base"].hits + worker.egress.warm["base"].misses >= 1  # a networked warm set's


def test_true_is_the_public_internet_never_the_metadata_endpoint_or_private_networks(worker):
    worker, _ = worker
    outcome = worker.run_job(networked(probe([(w.METADATA, w.PORT), (w.ALLOWED, w.PORT)], ["public.test", "allowed.test"]), True, ceiling=True))
    seen = json.loads(outcome.stdout)
    connects = seen["connects"]
    assert refused_fast(connects, f"{w.METADATA}:{w.PORT}") and refused_fast(connects, f"{w.ALLOWED}:{w.PORT}"), connects
    # Every name resolves under true (an attacker review found none did), to a public address only.
    assert seen["lookups"]["public.test"] == [0, w.PUBLIC] and seen["by_name"] == {"public.test": "ok"}, seen
    assert seen["lookups"]["allowed.test"] == [socket.EAI_NONAME, None]  # its one answer is private: dropped
    report = outcome.network
    assert report is not None and (report.refused_connections, report.allowed_connections, report.refused_lookups) == (2, 1, 1), report


def test_a_plain_job_on_the_same_worker_has_no_network_and_no_report(worker):
    worker, _ = worker
    outcome = worker.run_job(CodeJob(checkpoint="base", code="import socket; print(sorted(n for _, n in socket.if_nameindex()))"))
    assert outcome.stdout == "['lo']\n" and outcome.network is None, outcome


def test_each_session_step_reports_its_own_refusals(worker):
    worker, _ = worker
    session, first = worker.open_session(networked(probe([(w.DENIED, w.PORT)]), [f"10.199.1.0/24:{w.PORT}", "allowed.test"]))
    network = session._sandbox.network  # its own wiring (the warm set refills another beside it)
    try:
        assert first.outcome.network is not None and first.outcome.network.refused_connections == 1, first
        step = session.run_step(Step(probe([(w.ALLOWED, w.PORT), (w.DENIED, w.PORT), (w.DENIED, w.PORT)], ["allowed.test"])))
        seen = json.loads(step.outcome.stdout)
        assert seen["connects"][f"{w.ALLOWED}:{w.PORT}"][0] == "ok" and seen["by_name"] == {"allowed.test": "ok"}, seen
        report = step.outcome.network
        assert report is not None and report.refused == (RefusedConnection(w.DENIED, w.PORT, 2),), report  # this step's two
        quiet = session.run_step(Step("print('nothing refused')"))
        assert quiet.outcome.network is not None and quiet.outcome.network.refused_connections == 0
    finally:
        session.close()
    assert network is not None and wait_until(lambda: not _netns.present(network.netns), timeout=10)  # removed with it
